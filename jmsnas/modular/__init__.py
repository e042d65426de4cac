"""Modularizing a trained network for parallel loading (paper 002): blocks, a measured loading-time model,
balanced contiguous children (exact, Q-learning, equal layers), children as orbax checkpoints loaded in parallel
with streaming inference, and fine-tuning of the last child."""
