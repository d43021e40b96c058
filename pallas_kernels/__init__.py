"""Pallas kernels for k3jax. Never imports k3jax (one-way dependency)."""
