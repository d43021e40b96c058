"""k3jax.ops."""
