"""Op knowledge in one home: families (families.py), read by every pass."""
