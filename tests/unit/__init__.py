"""Behavioural tests of the single-process core engine."""
