"""k3jax: the three Kimi K3 techniques in JAX (KDA, Quantile Balancing, Block AttnRes)."""

__version__ = "0.1.0"
