"""The package version, apart from the root so that inner modules can read it without a cycle."""

__version__ = "0.1.0"
