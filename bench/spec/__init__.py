"""Speculative decoding: the γ sweep (``bench.spec.sweep``), adaptive γ, the copy-drafter ceiling and replay, and Ember vs mlx-lm with a draft model."""
