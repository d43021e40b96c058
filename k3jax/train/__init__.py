"""k3jax.train."""
