"""Test setup: 8 fake CPU devices (set before any JAX work) and the `gpu` marker."""
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (runs on the H200 device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
