"""See docs/design.md for this package's place in the data flow."""
