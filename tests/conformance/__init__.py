"""One suite every storage backend passes: local files, fsspec memory, S3 (moto), tiered."""
