"""The one harness of the experiment scripts: timing (per call and back to back), the ANCHORS input
recipes, the named benchmark shapes, accuracy metric, environment record, JSON + markdown writers,
profiler-trace and HLO parsing, JAX's persistent compilation cache, compile counters, and the device's
dense bf16 GEMM rate (the MFU denominator). Library code never imports this module.

Timing (docs/benchmarks.md): `time_call` gives the per-call host wall time (median of fresh-input calls,
each synchronised) and the back-to-back device-bound time (groups of calls dispatched without waiting,
one sync a group). With the persistent cache on, a re-traced function whose HLO is unchanged loads its
executable from disk: the cache key hashes the HLO, so a hit is proof that the HLO was identical.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------------------------- shapes

# KDA benchmark shapes, B x T x H x K (V = K): the four H200 shapes of ANCHORS.md and a tiny CPU one.
KDA_SHAPES = {"8x4096x16": "8x4096x16x128", "2x16384x16": "2x16384x16x128", "1x65536x16": "1x65536x16x128",
              "16x2048x32": "16x2048x32x128", "tiny": "1x128x2x32"}
KDA_GPU_SHAPES = tuple(KDA_SHAPES[k] for k in ("8x4096x16", "2x16384x16", "1x65536x16", "16x2048x32"))
# MoE grouped GEMM (routed rows m, contraction k, output n, experts) and MoE layer (tokens, d_model, d_ff,
# experts, top_k) shapes: the ANCHORS.md H200 reference (m = 4096 tokens x top-8) and a tiny CPU one.
MOE_GEMM_SHAPES = {"anchor": dict(m=32768, k=2048, n=1024, experts=64), "tiny": dict(m=64, k=16, n=8, experts=4)}
MOE_LAYER_SHAPES = {"anchor": dict(tokens=16384, d_model=2048, d_ff=1024, experts=64, top_k=8),
                    "tiny": dict(tokens=32, d_model=16, d_ff=8, experts=4, top_k=2)}


def parse_kda_shape(shape: str) -> tuple[int, int, int, int]:
    """'BxTxHxK' (or a KDA_SHAPES name) -> (B, T, H, K). Raises ValueError naming `shape`."""
    text = KDA_SHAPES.get(shape, shape)
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape must be BxTxHxK with positive integers or one of {sorted(KDA_SHAPES)}; got {shape=}")
    return tuple(int(p) for p in parts)


# ----------------------------------------------------------------------------------------------- inputs


def make_kda_inputs(key, B, T, H, K, dtype, *, V: int | None = None):
    """Fresh ANCHORS-recipe KDA inputs (q, k, v, g, beta, do) for the benchmarks.

    q, v, do ~ N(0, 1); k ~ N(0, 1) L2-normalised over K; g = -5 sigmoid(N(0, 1)) (log-space, natural log,
    in [-5, 0)); beta = sigmoid(N(0, 1)). Shapes: q, k, g [B, T, H, K]; v, do [B, T, H, V] (V = K by
    default); beta [B, T, H]. g is fp32, the others `dtype`. Source: /work/shared/ANCHORS.md, KDA inputs.
    """
    V = K if V is None else V
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, H, K), dtype)
    k = jax.random.normal(ks[1], (B, T, H, K), jnp.float32)
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V), dtype)
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H), jnp.float32)).astype(dtype)
    do = jax.random.normal(ks[5], (B, T, H, V), dtype)
    return q, k, v, g, beta, do


def packed_segment_ids(B: int, T: int, docs_per_row: int, *, seed: int = 0, min_len: int = 64):
    """[B, T] int32 document ids of packed rows (ids from 1): exponential document lengths of mean
    T / docs_per_row, at least `min_len` tokens, the last one cut at T (ANCHORS' packed-document recipe).
    Raises ValueError for docs_per_row < 1."""
    return jnp.asarray(packed_segment_ids_np(B, T, docs_per_row, seed=seed, min_len=min_len))


def packed_segment_ids_np(B: int, T: int, docs_per_row: int, *, seed: int = 0, min_len: int = 64) -> np.ndarray:
    """packed_segment_ids as a numpy array (no JAX backend touched: usable before a torch process
    takes the GPU). Raises ValueError for docs_per_row < 1."""
    if docs_per_row < 1:
        raise ValueError(f"docs_per_row must be >= 1; got {docs_per_row}")
    rng = np.random.default_rng(seed)
    out = np.zeros((B, T), np.int32)
    for b in range(B):
        pos, doc = 0, 1
        while pos < T:
            n = max(min_len, int(rng.exponential(T / docs_per_row)))
            out[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out


def cu_seqlens(segment_ids) -> list[int]:
    """fla's varlen form of packed rows: the offsets [0, ..., B*T] of every document in the rows
    flattened to one sequence (a row end is a boundary too; a document starts wherever the id differs
    from the previous token's, as the kernels' segment_ids). segment_ids: [B, T] integers."""
    ids = np.asarray(segment_ids)
    if ids.ndim != 2 or ids.size == 0:
        raise ValueError(f"segment_ids must be a non-empty [B, T] array; got shape {ids.shape}")
    B, T = ids.shape
    starts = np.ones((B, T), bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return [int(i) for i in np.flatnonzero(starts.reshape(-1))] + [B * T]


def rms_ratio(out, ref) -> float:
    """sqrt(mean((out - ref)^2) / mean(ref^2)), in float64: fla's relative RMS error of `out` against the
    reference `ref` (equal shapes, any float dtypes; 1e-30 floor on the denominator; NaN when `out` has a
    non-finite entry)."""
    out = np.asarray(jnp.asarray(out, jnp.float32) if getattr(out, "dtype", None) == jnp.bfloat16 else out, np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32) if getattr(ref, "dtype", None) == jnp.bfloat16 else ref, np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have equal shapes; got {out.shape=}, {ref.shape=}")
    if not np.all(np.isfinite(out)):
        return float("nan")
    return float(np.sqrt(np.mean(np.square(out - ref)) / max(float(np.mean(np.square(ref))), 1e-30)))


# ----------------------------------------------------------------------------------------------- timing


def time_call(fn: Callable, make_args: Callable[[int], tuple], *, iters: int, warmup: int,
              stream_calls: int = 0, stream_reps: int = 0) -> dict:
    """Per-call and back-to-back time of fn(*make_args(i)).

    Per call: one compiling call on make_args(0), `warmup` calls on make_args(1..), then `iters` calls
    on make_args(1000 + i), each argument tuple made ready before the clock starts and each call waited
    for with `block_until_ready`: median/min/max host wall ms, dispatch and synchronisation included.
    Back to back (stream_calls > 0 and stream_reps > 0): `stream_reps` groups, each on one fresh input
    set make_args(2000 + i), of `stream_calls` calls dispatched without waiting and one
    `block_until_ready` after the last; group time / stream_calls, median over the groups: the device
    time per call once the host's dispatch overlaps the previous call.
    Returns dict(median_ms, min_ms, max_ms, iters, compile_s) and, with groups, stream_ms, stream_calls,
    stream_reps. Raises ValueError for iters < 1 or a negative warmup / stream_calls / stream_reps.
    """
    if iters < 1 or warmup < 0 or stream_calls < 0 or stream_reps < 0:
        raise ValueError(f"need iters >= 1 and warmup, stream_calls, stream_reps >= 0; got {iters=}, {warmup=}, "
                         f"{stream_calls=}, {stream_reps=}")
    args = jax.block_until_ready(make_args(0))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))                                       # compile + first run
    compile_s = time.perf_counter() - t0
    for i in range(warmup):
        jax.block_until_ready(fn(*jax.block_until_ready(make_args(1 + i))))
    times = []
    for i in range(iters):
        args = jax.block_until_ready(make_args(1000 + i))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    out = dict(median_ms=1e3 * statistics.median(times), min_ms=1e3 * min(times), max_ms=1e3 * max(times),
               iters=iters, compile_s=compile_s)
    if stream_calls > 0 and stream_reps > 0:
        groups = []
        for i in range(stream_reps):
            args = jax.block_until_ready(make_args(2000 + i))
            t0 = time.perf_counter()
            for _ in range(stream_calls):
                last = fn(*args)              # dispatched without waiting; the stream runs them in order
            jax.block_until_ready(last)
            groups.append((time.perf_counter() - t0) / stream_calls)
        out.update(stream_ms=1e3 * statistics.median(groups), stream_calls=stream_calls, stream_reps=stream_reps)
    return out


# ----------------------------------------------------------------------------------------------- runtime


class CompileCounter:
    """Counts JAX compile events (jax.monitoring) between `reset()` calls: compile requests,
    persistent-cache hits/misses, backend compile seconds and, under "phases_s", the seconds of each of
    jax's compile phases ("/jax/core/compile/<phase>": jaxpr_trace_duration, jaxpr_to_mlir_module_duration
    (lowering, the Pallas kernels' included), backend_compile_duration)."""

    _EVENTS = {"/jax/compilation_cache/compile_requests_use_cache": "compile_requests",
               "/jax/compilation_cache/cache_hits": "cache_hits",
               "/jax/compilation_cache/cache_misses": "cache_misses"}
    _DURATIONS = {"/jax/core/compile/backend_compile_duration": "backend_compile_s",
                  "/jax/compilation_cache/compile_time_saved_sec": "compile_time_saved_s"}

    def __init__(self):
        self.counts: dict[str, float] = {}
        self.phases: dict[str, float] = {}
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)

    def _on_event(self, name, **kwargs):
        if name in self._EVENTS:
            key = self._EVENTS[name]
            self.counts[key] = self.counts.get(key, 0) + 1

    def _on_duration(self, name, duration, **kwargs):
        if name.startswith("/jax/core/compile/"):
            phase = name.rsplit("/", 1)[-1]
            self.phases[phase] = self.phases.get(phase, 0.0) + float(duration)
        if name in self._DURATIONS:
            key = self._DURATIONS[name]
            self.counts[key] = self.counts.get(key, 0.0) + float(duration)

    def reset(self) -> dict:
        out = {k: self.counts.get(k, 0) for k in (*self._EVENTS.values(), *self._DURATIONS.values())}
        out["phases_s"] = self.phases
        self.counts, self.phases = {}, {}
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
    """The MoE grouped-matmul backend `k3jax.ops.grouped_matmul` picks on this device for
    `implementation=None` ("blocked" on CPU; on GPU "jla" when installed and supported, else
    "xla", which is ~60x slower than a library kernel on the H200 — worth knowing before reading a
    tokens/s number)."""
    from k3jax.ops.grouped_matmul import default_implementation  # noqa: PLC0415
    name = default_implementation()
    if name == "xla" and jax.default_backend() == "gpu":
        print("WARNING: MoE grouped matmul falls back to XLA ragged_dot on this GPU (install "
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


# ----------------------------------------------------------------------------------------------- records

VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_collections", "grain", "tokamax",
             "jax-linear-attention", "fla-core", "flash-linear-attention", "torch", "triton")


def environment(**extra) -> dict:
    """What a result was measured on: UTC date, device kind and count, backend, host, CPU count, python and
    the installed versions of VERSIONED (those not installed are left out), plus `extra`."""
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, device_count=jax.device_count(),
                backend=jax.default_backend(), platform=platform.platform(), cpu_count=os.cpu_count(),
                python=sys.version.split()[0], **package_versions(VERSIONED), **extra)


def environment_line(env: dict) -> str:
    """One markdown line naming date, device and versions of an `environment()` record."""
    skip = {"date", "device", "device_count", "backend", "platform", "cpu_count", "python"}
    versions = ", ".join(f"{k} {v}" for k, v in env.items() if k not in skip and isinstance(v, str))
    count = f" x{env['device_count']}" if env.get("device_count", 1) > 1 else ""
    return (f"{env.get('date', '?')}; {env.get('device', '?')}{count} ({env.get('backend', '?')}, "
            f"{env.get('cpu_count', '?')} CPUs); python {env.get('python', '?')}; {versions}")


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown lines of a table: `header` cells, then one line per row (cells str()-ed; floats as %.3g)."""
    cell = lambda x: f"{x:.3g}" if isinstance(x, float) else str(x)  # noqa: E731
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
            ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows])


def write_results(out: str, data: dict, markdown: str | None = None) -> None:
    """Write `data` to <out>.json (indent 1; non-JSON values str()-ed) and `markdown` to <out>.md, making
    the folder. Raises ValueError for an empty `out`."""
    if not out:
        raise ValueError(f"out must be a path prefix; got {out=}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1, default=str)
    if markdown is not None:
        with open(out + ".md", "w") as f:
            f.write(markdown)


# ----------------------------------------------------------------------------------------------- profiler traces

STEP_NAME = "train"
# Lines a profiler adds to a device plane by deriving them from the kernels (counting them would double it).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Async XLA Ops", "Steps", "Framework Ops", "Framework Name Scope",
                 "TensorFlow Ops", "Source code", "XLA TraceMe", "Launch Stats", "TensorFlow Name Scope")
_KIND_ORDER = ("dot", "convolution", "custom-call", "sort", "scatter", "gather", "all-to-all", "all-reduce",
               "reduce-window", "reduce", "transpose", "dynamic-update-slice", "dynamic-slice", "concatenate",
               "copy", "pad", "while", "conditional")


# ----------------------------------------------------------------------------------------------- HLO text


@dataclasses.dataclass
class HloOp:
    """One instruction of the compiled HLO: its opcode, kind (see `_op_kind`), JAX name stack and source
    frames (innermost first, as (file, function, line))."""
    name: str
    opcode: str
    kind: str
    op_name: str
    frames: list


def _table(text: str, header: str) -> dict[int, str]:
    m = re.search(rf"^{header}\n(.*?)(?:\n\s*\n|\Z)", text, re.S | re.M)
    if not m:
        return {}
    out = {}
    for line in m.group(1).splitlines():
        key, _, rest = line.strip().partition(" ")
        if key.isdigit():
            out[int(key)] = rest
    return out


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*? ([a-z][\w\-]*)\(")
_COMP = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+) .*\{\s*$")


def parse_hlo(text: str) -> dict[str, HloOp]:
    """Index a compiled HLO module's text (`Compiled.as_text()` or an XLA `*after_optimizations.txt` dump):
    instruction name -> `HloOp`. Fusions get the kind of the most telling op they contain (dot first).

    Stack frames come from the module's FileNames / FunctionNames / FileLocations / StackFrames tables; a
    frame's printed `parent_frame_id` is one more than its parent's label (0 and 1: no parent), checked on
    this jax (0.11.2) by the parent line calling the child's function.
    """
    files = {k: v.strip('"') for k, v in _table(text, "FileNames").items()}
    funcs = {k: v.strip('"') for k, v in _table(text, "FunctionNames").items()}
    locs = {k: {a: int(b) for a, b in re.findall(r"(\w+)=(\d+)", v)} for k, v in _table(text, "FileLocations").items()}
    frames = {k: {a: int(b) for a, b in re.findall(r"(\w+)=(\d+)", v)} for k, v in _table(text, "StackFrames").items()}

    def stack(fid: int) -> list:
        out, seen = [], set()
        while fid in frames and fid not in seen and len(out) < 64:
            seen.add(fid)
            loc = locs.get(frames[fid].get("file_location_id", 0), {})
            out.append((files.get(loc.get("file_name_id", 0), "?"), funcs.get(loc.get("function_name_id", 0), "?"),
                        loc.get("line", 0)))
            fid = frames[fid].get("parent_frame_id", 0) - 1
        return out

    comp_ops: dict[str, list] = collections.defaultdict(list)
    raw = []
    comp = None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _COMP.match(line)
            comp = m.group(1) if m else None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, opcode = m.groups()
        if comp is not None:
            comp_ops[comp].append(opcode)
        calls = re.findall(r"(?:calls|to_apply|body)=%?([\w.\-]+)", line)
        target = re.search(r'custom_call_target="([^"]+)"', line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        raw.append((name, opcode, calls, target.group(1) if target else None, op_name.group(1) if op_name else "",
                    int(frame.group(1)) if frame else 0))
    index = {}
    for name, opcode, calls, target, op_name, frame in raw:
        inner = [o for c in calls for o in comp_ops.get(c, ())]
        index[name] = HloOp(name, opcode, _op_kind(opcode, inner, target), op_name, stack(frame))
    return index


def _op_kind(opcode: str, inner: list, target: str | None) -> str:
    if opcode == "custom-call":
        return f"custom-call:{target}" if target else "custom-call"
    if opcode != "fusion":
        return opcode
    present = set(inner)
    for kind in _KIND_ORDER:
        if kind in present:
            return kind
    return "elementwise"


def _short(path: str) -> str:
    for root in ("k3jax/", "pallas_kernels/", "experiments/"):
        i = path.rfind("/" + root)
        if i >= 0:
            return path[i + 1:]
    for pkg in ("optax", "flax", "jax", "tokamax", "jax_linear_attention"):
        i = path.rfind(f"/{pkg}/")
        if i >= 0:
            return path[i + 1:]
    return os.path.basename(path)


def component_of(op: HloOp | None) -> str:
    """Model component of an HLO op: the innermost `k3jax/nn` module method on its stack, else the optimizer
    when optax/flax's optimizer is on it, else the outermost `k3jax/ops` (or pallas_kernels) function, else the
    innermost k3jax function, else its innermost frame; "(no source)" without metadata."""
    if op is None or not op.frames:
        return "(no source)"
    short = [(_short(f), fn, line) for f, fn, line in op.frames]
    for f, fn, _ in short:
        if f.startswith("k3jax/nn/"):
            return f"{f}:{fn}"
    if any(f.startswith("optax/") or f.endswith("nnx/training/optimizer.py") for f, _, _ in short):
        return "optimizer (optax)"
    for f, fn, _ in reversed(short):  # the outermost op (kda_chunked), not the helper it calls
        if f.startswith(("k3jax/ops/", "pallas_kernels/")):
            return f"{f}:{fn}"
    for f, fn, _ in short:
        if f.startswith("k3jax/"):
            return f"{f}:{fn}"
    return f"{short[0][0]}:{short[0][1]}"


def source_of(op: HloOp | None) -> str:
    """The innermost k3jax (or pallas_kernels) source line of an HLO op, else its innermost frame."""
    if op is None or not op.frames:
        return "(no source)"
    for f, fn, line in op.frames:
        s = _short(f)
        if s.startswith(("k3jax/", "pallas_kernels/")):
            return f"{s}:{line} {fn}"
    f, fn, line = op.frames[0]
    return f"{_short(f)}:{line} {fn}"


def phase_of(op: HloOp | None) -> str:
    """"backward" (name stack has `transpose(`), "optimizer", "forward" (under `jvp(`), else "other"."""
    if op is None:
        return "other"
    if "transpose(" in op.op_name:
        return "backward"
    if component_of(op) == "optimizer (optax)":
        return "optimizer"
    if "jvp(" in op.op_name:
        return "forward"
    return "other"


# ----------------------------------------------------------------------------------------------- trace


@dataclasses.dataclass
class OpEvent:
    name: str        # kernel name (GPU) or thunk name (CPU)
    hlo_op: str      # HLO instruction it runs ('' when the trace does not say)
    module: str      # HLO module ('' when the trace does not say)
    start_ns: float
    dur_ns: float
    where: str       # plane / line


def _stats(event) -> dict:
    try:
        return dict(event.stats)
    except Exception:  # noqa: BLE001 -- an event whose stats the binding cannot read
        return {}


def find_xplane(path: str) -> str:
    """The newest `.xplane.pb` under `path` (a file is returned as is). Raises FileNotFoundError."""
    if os.path.isfile(path):
        return path
    files = sorted(glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        raise FileNotFoundError(f"no .xplane.pb under {path=}")
    return files[-1]


def read_trace(path: str) -> dict:
    """Read a profiler trace into op events, step windows and a plane/line inventory.

    Device planes (`/device:*`, not CPU) win: their stream lines hold the kernels (lines in DERIVED_LINES
    are skipped; a plane with only an "XLA Ops" line uses that). Without device events, op events are the
    host events that carry an `hlo_op` stat (XLA:CPU thunks). Steps are the host events named STEP_NAME.
    """
    pd = jax.profiler.ProfileData.from_file(find_xplane(path))
    device, host, steps, host_events, inventory = [], [], [], [], []
    for plane in pd.planes:
        is_device = plane.name.startswith("/device:") and not plane.name.startswith("/device:CPU")
        lines = list(plane.lines)
        names = [ln.name for ln in lines]
        for line in lines:
            derived = line.name in DERIVED_LINES
            use_line = is_device and (not derived or (line.name == "XLA Ops" and
                                                      all(n in DERIVED_LINES for n in names)))
            n = 0
            for ev in line.events:
                n += 1
                if ev.name == STEP_NAME and not is_device:
                    steps.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                    continue
                if use_line:
                    st = _stats(ev)
                    device.append(OpEvent(ev.name, str(st.get("hlo_op", "")), str(st.get("hlo_module", "")),
                                          ev.start_ns, ev.duration_ns, f"{plane.name} | {line.name}"))
                elif not is_device:
                    st = _stats(ev)
                    if "hlo_op" in st:
                        host.append(OpEvent(ev.name, str(st["hlo_op"]), str(st.get("hlo_module", "")),
                                            ev.start_ns, ev.duration_ns, f"{plane.name} | {line.name}"))
                    elif not ev.name.startswith("$") and ev.duration_ns > 0:
                        host_events.append((ev.name, ev.start_ns, ev.duration_ns))
            inventory.append({"plane": plane.name, "line": line.name, "events": n})
    return {"ops": device if device else host, "op_source": "device planes" if device else "host threads (hlo_op)",
            "steps": sorted(steps), "host_events": host_events, "inventory": inventory}


def self_times(ops: list[OpEvent]) -> list[float]:
    """Each event's duration minus that of the events nested inside it on the same line (a control-flow
    thunk around its body's thunks on XLA:CPU); device kernels do not nest, so there it is the duration."""
    out = [0.0] * len(ops)
    by_line: dict[str, list[int]] = collections.defaultdict(list)
    for i, o in enumerate(ops):
        by_line[o.where].append(i)
    for idx in by_line.values():
        idx.sort(key=lambda i: (ops[i].start_ns, -ops[i].dur_ns))
        stack: list[int] = []
        for i in idx:
            o = ops[i]
            while stack and ops[stack[-1]].start_ns + ops[stack[-1]].dur_ns <= o.start_ns:
                stack.pop()
            out[i] += o.dur_ns
            if stack and o.start_ns + o.dur_ns <= ops[stack[-1]].start_ns + ops[stack[-1]].dur_ns:
                out[stack[-1]] -= o.dur_ns
            stack.append(i)
    return out


def _kernel_key(name: str) -> str:
    return re.sub(r"[.\-]", "_", name)


def _union_ns(intervals) -> float:
    total, end = 0.0, -np.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize_trace(trace: dict, *, hlo: dict[str, HloOp] | None = None, top: int = 40,
                    unmarked_steps: int = 1) -> dict:
    """Per-op table, device-busy vs step wall time and groupings from `read_trace`'s output.

    `ops` holds every distinct (kernel, HLO op), longest first; `top` is how many the markdown shows.
    Only op events inside the step windows count (all of them when the trace has no step events: then the
    trace is taken to span `unmarked_steps` steps, e.g. jla's profiler window of train.profile_steps). Times
    are per step (ms): self time (`self_times`) summed over the traced steps / number of steps; `share` =
    of the step wall time; device busy = union of the op intervals.
    """
    steps = trace["steps"]
    ops = trace["ops"]
    windowed = bool(steps)
    if steps:
        lo, hi = steps[0][0], steps[-1][1]
        inside = [o for o in ops if lo <= o.start_ns < hi]
        windowed = bool(inside) or not ops
        ops = inside if windowed else ops  # no op inside the steps: clocks not aligned; count every op
        n_steps = len(steps)
        wall_ns = sum(e - s for s, e in steps)
    else:
        if unmarked_steps < 1:
            raise ValueError(f"unmarked_steps must be >= 1, got {unmarked_steps}")
        n_steps = unmarked_steps
        wall_ns = (max(o.start_ns + o.dur_ns for o in ops) - min(o.start_ns for o in ops)) if ops else 0.0
    hlo = dict(hlo or {})
    for name, op in list(hlo.items()):  # GPU kernels of XLA fusions are named like the fusion, '.' -> '_'
        hlo.setdefault(_kernel_key(name), op)
    per_step = lambda ns: ns / n_steps / 1e6  # noqa: E731  ns over the trace -> ms per step
    wall_ms = per_step(wall_ns)
    busy_ms = per_step(_union_ns([(o.start_ns, o.start_ns + o.dur_ns) for o in ops]))
    selfs = self_times(ops)
    op_ms = per_step(sum(selfs))

    rows: dict[tuple, dict] = {}
    for o, self_ns in zip(ops, selfs):
        key = (o.name, o.hlo_op)
        r = rows.get(key)
        if r is None:
            h = hlo.get(o.hlo_op) or hlo.get(o.name) or hlo.get(_kernel_key(o.name))
            r = rows[key] = {"kernel": o.name, "hlo_op": o.hlo_op, "module": o.module,
                             "kind": h.kind if h else "", "phase": phase_of(h) if h else "",
                             "component": component_of(h) if hlo else "", "source": source_of(h) if hlo else "",
                             "op_name": h.op_name if h else "", "ns": 0.0, "count": 0}
        r["ns"] += self_ns
        r["count"] += 1
    table = sorted(rows.values(), key=lambda r: -r["ns"])
    for r in table:
        r["ms_per_step"] = per_step(r.pop("ns"))
        r["count_per_step"] = r["count"] / n_steps
        r["share_of_step"] = r["ms_per_step"] / wall_ms if wall_ms else 0.0

    def group(key: str) -> list[dict]:
        acc: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        for r in table:
            acc[r[key] or "(unmapped)"][0] += r["ms_per_step"]
            acc[r[key] or "(unmapped)"][1] += r["count_per_step"]
        return [{key: k, "ms_per_step": v[0], "count_per_step": v[1], "share_of_step": v[0] / wall_ms if wall_ms else 0.0}
                for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])]

    host_rows = []
    if steps:
        acc: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        for name, s, d in trace["host_events"]:
            if lo <= s < hi:
                acc[name][0] += d
                acc[name][1] += 1
        host_rows = [{"name": k, "ms_per_step": per_step(v[0]), "count_per_step": v[1] / n_steps}
                     for k, v in sorted(acc.items(), key=lambda kv: -kv[1][0])[:15]]
    mapped = sum(r["ms_per_step"] for r in table if r["kind"])
    return {"op_source": trace["op_source"], "steps": n_steps, "ops_windowed_to_steps": windowed, "step_wall_ms": wall_ms, "device_busy_ms": busy_ms,
            "op_time_ms": op_ms, "idle_ms": wall_ms - busy_ms, "busy_fraction": busy_ms / wall_ms if wall_ms else 0.0,
            "op_events_per_step": len(ops) / n_steps, "hlo_mapped_ms": mapped, "ops": table, "top": top,
            "num_distinct_ops": len(table), "by_kind": group("kind") if hlo else [],
            "by_component": group("component") if hlo else [], "by_phase": group("phase") if hlo else [],
            "by_source": group("source")[:25] if hlo else [], "by_module": group("module"),
            "host_events": host_rows, "inventory": trace["inventory"]}


def parse_trace(path: str, *, hlo_text: str | None = None, top: int = 40, unmarked_steps: int = 1) -> dict:
    """`summarize_trace(read_trace(path), hlo=parse_hlo(hlo_text))`: the profile of a trace folder or file."""
    return summarize_trace(read_trace(path), hlo=parse_hlo(hlo_text) if hlo_text else None, top=top,
                           unmarked_steps=unmarked_steps)


def read_hlo_dump(folder: str, module: str = "train_step", *, keep_only: bool = False) -> str | None:
    """The after-optimizations HLO text XLA dumped for the (largest) module whose name contains `module`.
    `keep_only`: delete the dump's other files (before-optimization HLO, buffer assignment, PTX, LLVM IR),
    keeping the folder small enough to copy back from a device machine."""
    files = glob.glob(os.path.join(folder, f"*{module}*after_optimizations.txt"))
    if not files:
        return None
    chosen = max(files, key=os.path.getsize)
    if keep_only:
        for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
            if os.path.isfile(path) and path != chosen:
                os.remove(path)
    with open(chosen) as f:
        return f.read()

