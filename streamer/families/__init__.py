"""Family adapters: what surrounds mlx-lm's layers for each model_type."""
