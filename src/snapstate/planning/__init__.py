"""Pure planning: who writes what, where it goes in which file, what to read on load. No I/O."""
