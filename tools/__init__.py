"""Training and conversion scripts (not imported by the runtime): python -m tools.<name>."""
