"""Serving: Ember vs ``mlx_lm.server``, engine overhead, startup, constrained decoding, agent turns, prefix-aware routing."""
