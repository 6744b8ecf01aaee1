"""The engine: stage (the only blocking part), persist in the background, commit, read."""
