"""k3jax.nn."""
