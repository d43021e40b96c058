"""k3jax.models."""
