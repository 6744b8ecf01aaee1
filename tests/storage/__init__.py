"""Tests particular to one storage backend: S3 through fsspec, and tiers."""
