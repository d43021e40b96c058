"""k3jax: KDA linear attention, Quantile Balancing and Block Attention Residuals in JAX/Flax."""
from setuptools import find_packages, setup

setup(
    name="k3jax",
    version="0.1.0",
    description="Kimi K3 techniques in JAX: KDA with lower-bounded decay, Quantile Balancing, Block AttnRes",
    packages=find_packages(include=["k3jax", "k3jax.*", "pallas_kernels", "pallas_kernels.*"]),
    python_requires=">=3.12",
    install_requires=[
        "jax==0.11.2",
        "jaxlib==0.11.2",
        "flax",
        "optax",
        "chex",
        "orbax-checkpoint",
        "absl-py",
        "ml_collections",
        "grain",
        "tensorboardX",
        "tqdm",
        "numpy",
        "tokenizers",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "matplotlib", "jupytext", "nbclient", "ipykernel", "datasets"],
        "gpu": ["jax[cuda13]==0.11.2", "jax-linear-attention==0.1.0", "tokamax==0.0.17"],
        "notebooks": ["matplotlib", "jupytext", "nbclient", "ipykernel", "jupyterlab"],
        "hf": ["datasets"],
    },
)
