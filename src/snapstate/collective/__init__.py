"""Coordination between ranks: foreground collectives and a background-safe barrier."""
