"""Test setup: 8 fake CPU devices (set before any JAX work), the `gpu` marker, and on a machine without
JAX's CUDA plugin XLA:CPU's LLVM at -O0: the suite is mostly compilation, which this cuts by ~35% (the
programs and their numerics are XLA's own; only LLVM's optimisation of the emitted loops is skipped).
Subprocesses and notebook kernels inherit the setting. `K3JAX_TEST_XLA_OPT=1` keeps XLA's default."""
import importlib.metadata
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _cuda_plugin_installed() -> bool:
    return any((d.metadata["Name"] or "").replace("_", "-").startswith("jax-cuda")
               for d in importlib.metadata.distributions())


_FLAGS = os.environ.get("XLA_FLAGS", "")
if (os.environ.get("K3JAX_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in _FLAGS
        and not _cuda_plugin_installed()):
    os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_backend_optimization_level=0").strip()

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
