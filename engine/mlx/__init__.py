"""The MLX backend: model loading (mlx-lm, GGUF), batched decode, sampling, CPU tuning, sharding."""
