"""k3jax.data."""
