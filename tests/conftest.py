"""Test setup: 8 fake CPU devices (set before any JAX work), the `gpu` marker, the `full` tier, and on a
machine without a JAX GPU plugin XLA:CPU's LLVM at -O0: the suite is mostly compilation, which this cuts by
~27% (1502 -> 1092 s on 2 cores). The HLO programs are the same; results can differ in the last bit (at -O3
LLVM contracts a * b + c into an FMA), so no test compares bit for bit across jits of different levels
(tests/kda_testing.RUN_BOUND). Subprocesses and notebook kernels inherit the setting;
`K3JAX_TEST_XLA_OPT=1` keeps XLA's default.

The `full` tier (see `in_full_tier`) is the rest of the interpret-mode kernel matrix and the longest
shapes: `make test` (CI) deselects it to bring the suite toward CI's 20 minutes on 2 cores, keeping one
case per behaviour, in the way JAX's CI samples its generated cases; `make test-full` (`pytest
--full-tier`) runs it. Nothing is deselected on a GPU backend (`pytest -m gpu` there selects the compiled classes)."""
import os
import pkgutil

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _gpu_plugin_installed() -> bool:
    """A CUDA or ROCm PJRT plugin under the `jax_plugins` namespace (jax[cuda13] installs xla_cuda13)."""
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in m.name or "rocm" in m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


_FLAGS = os.environ.get("XLA_FLAGS", "")
if (os.environ.get("K3JAX_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in _FLAGS
        and not _gpu_plugin_installed()):
    os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def pytest_addoption(parser):
    parser.addoption("--full-tier", action="store_true", default=False,
                     help="also run the `full` tier (`make test-full`)")


def in_full_tier(item) -> bool:
    """The `full` marker, or the item's name (`test_x[params]`, or `test_x` for all of its cases) in its
    class's `full_tier`: the cases beyond one per behaviour, mostly interpret-mode kernel cases."""
    names = getattr(getattr(item, "cls", None), "full_tier", ())
    return (item.get_closest_marker("full") is not None or item.name in names
            or getattr(item, "originalname", None) in names)


def pytest_collection_modifyitems(config, items):
    """Off a GPU: skip `gpu` items (with the reason) and, without --full-tier, deselect the full tier except
    tests named by node id on the command line. On a GPU backend nothing is deselected."""
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a GPU (runs on the H200 device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
    if config.getoption("--full-tier"):
        return
    named = [arg for arg in config.args if "::" in arg]

    def left_out(item):
        return ("gpu" not in item.keywords and in_full_tier(item)
                and not any(item.nodeid.startswith(arg) for arg in named))
    full = [item for item in items if left_out(item)]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not left_out(item)]
