"""Runtime helpers for experiment scripts: JAX's persistent compilation cache, compile counters, and the
device's dense bf16 GEMM rate (the MFU denominator).

With the persistent cache on, a re-traced function whose HLO (and compile options) is unchanged loads
its executable from disk instead of compiling: the cache key hashes the HLO, so a hit is proof that the
HLO was identical. `CompileCounter` reads JAX's own monitoring events to show it.
"""
from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np


class CompileCounter:
    """Counts JAX compile events (jax.monitoring) between `reset()` calls: compile requests,
    persistent-cache hits/misses and backend compile seconds."""

    _EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "compile_requests",
               "/jax/compilation_cache/cache_hits": "cache_hits",
               "/jax/compilation_cache/cache_misses": "cache_misses"}
    _DURATIONS = {"/jax/core/compile/backend_compile_duration": "backend_compile_s",
                  "/jax/compilation_cache/compile_time_saved_sec": "compile_time_saved_s"}

    def __init__(self):
        self.counts: dict[str, float] = {}
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, name, **kwargs):
        if name in self._EVENTS:
            key = self._EVENTS[name]
            self.counts[key] = self.counts.get(key, 0) + 1

    def _on_duration(self, name, duration, **kwargs):
        if name in self._DURATIONS:
            key = self._DURATIONS[name]
            self.counts[key] = self.counts.get(key, 0.0) + float(duration)

    def reset(self) -> dict[str, float]:
        out = {k: self.counts.get(k, 0) for k in (*self._EVENTS.values(), *self._DURATIONS.values())}
        self.counts = {}
        return out


def median_ms(fn, *args, iters: int, warmup: int = 3) -> float:
    """Median wall time in ms of ``fn(*args)`` over ``iters`` calls, each waited for with
    ``jax.block_until_ready``, after ``warmup`` untimed calls (the first compiles)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def enable_compilation_cache(cache_dir: str) -> None:
    """Turn on JAX's persistent compilation cache in `cache_dir` for every executable (no size or
    compile-time threshold), before the first compilation."""
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def measure_matmul_rate(n: int, reps: int, *, seed: int = 0) -> dict:
    """Median dense bf16 GEMM rate of the default device on [n, n] x [n, n] (fp32 accumulation).

    Args:
      n: matrix size (FLOPs per GEMM = 2·n³).
      reps: number of timed GEMMs after one warm-up call (median over them).
    Returns:
      {"n", "reps", "median_s", "flops_per_s" (FLOP/s, float), "all_s" (list of seconds)}.
    Raises:
      ValueError: n or reps not positive.
    Source: the dense-GEMM reference of ANCHORS.md (bf16, medians, block_until_ready around each call).
    """
    if n <= 0 or reps <= 0:
        raise ValueError(f"n and reps must be positive, got {n=}, {reps=}")
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    gemm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    gemm(a, b).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        gemm(a, b).block_until_ready()
        times.append(time.perf_counter() - t0)
    median = float(np.median(times))
    return {"n": n, "reps": reps, "median_s": median, "flops_per_s": 2.0 * n ** 3 / median, "all_s": times}


def grouped_matmul_in_use() -> str:
    """The MoE grouped-matmul implementation `k3jax.ops.dispatch` picks on this device for
    `implementation=None` ("blocked" on CPU; on GPU "tokamax"/"jla" when installed and supported, else
    "xla", which is ~60x slower than a library kernel on the H200 — worth knowing before reading a
    tokens/s number)."""
    from k3jax.ops.dispatch import default_grouped_matmul  # noqa: PLC0415
    name = default_grouped_matmul()
    if name == "xla" and jax.default_backend() == "gpu":
        print("WARNING: MoE grouped matmul falls back to XLA ragged_dot on this GPU (install tokamax or "
              "jax-linear-attention for the library kernel); MoE tokens/s will be far below the kernel's",
              flush=True)
    return name


def package_versions(names) -> dict[str, str]:
    """Installed versions of the distributions ``names`` (pip names, e.g. "jax-linear-attention");
    those not installed are left out (a benchmark records what ran, not what could have)."""
    import importlib.metadata as md  # noqa: PLC0415
    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out
