"""Speculative decoding parts: the gamma policy, prompt lookup and the draft models."""
