"""The on-disk format snapstate/1: manifest, safetensors-compatible shards, checksums."""
