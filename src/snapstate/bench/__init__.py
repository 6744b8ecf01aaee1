"""The study harness: reruns the checkpointing study for every method side by side."""
