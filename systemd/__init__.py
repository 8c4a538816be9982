"""systemd user units for towerd, shipped as package data (see client/systemd_units.py)."""
