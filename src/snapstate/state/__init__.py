"""The state model: Stateful objects, rank-local state, RNG state, flattening to leaves."""
