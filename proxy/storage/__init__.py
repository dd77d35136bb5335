"""Where blob bytes live."""
