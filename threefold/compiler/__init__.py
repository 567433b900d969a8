"""See DESIGN.md for this package's place in the data flow."""
