"""WindowData (in progress)."""
