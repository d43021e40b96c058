"""Time KDA implementations, forward and forward+backward, on whatever backend runs this.

Method (DESIGN.md "Performance method"): each implementation is jitted once per shape; after warm-up
calls, every timed call gets FRESH random inputs (generated before the clock starts, never zeros),
is synchronised with `block_until_ready`, and the median of >= 20 calls is reported ("median ms": host
wall time per call, dispatch and synchronisation included). Next to it, "back-to-back ms" (DESIGN.md's
"around many calls"): --stream_calls calls on one fresh input set dispatched without waiting, one
`block_until_ready` after the last, the time divided by the calls; median over --stream_reps such
groups (on by default on a GPU only). With the device busy the host's dispatch overlaps the
previous call, so it is the device time per call, close to fla's triton do_bench (CUDA events around
each call; do_bench also clears the L2 cache before each call, the groups reuse one input set whose
~0.3-1 GB at the H200 shapes do not fit the 50 MB L2 anyway). Inputs follow
the ANCHORS.md recipe: q ~ N(0,1), k L2-normalised, v ~ N(0,1), g = -5 sigmoid(N(0,1)),
beta = sigmoid(N(0,1)); lower_bound = -5 is declared to the op (--declared_lower_bound=none times the
exact unbounded-gate paths of chunked / pallas on the same inputs; rows record it). fwd+bwd = value_and_grad of
sum(o * do) w.r.t. q, k, v, g, beta.

Implementations: "recurrent" (fp32 oracle), "chunked" (XLA chunk form), "pallas" (when
pallas_kernels.kda imports and covers the call; interpret mode off GPU), and the peers "jla"
(jax-linear-attention's Mosaic GPU KDA, on a GPU when importable) and fla (`--fla`: chunk_kda in a torch
subprocess, triton do_bench medians, rows also appended to `<out>_fla.jsonl`). Accuracy: every
implementation but "recurrent" against the fp32 recurrent oracle on the first min(T, --check_max_t)
tokens (RMS ratios of o and of the five gradients). With a peer, side-by-side tables (per-call wall
times; back-to-back times where the rows have them) add the ratios to the best peer, chunked / pallas
and, on an H200, the floor (FLOOR_RATES).

Profile (--profile): which kernels take the time, so a gap to a peer can be pinned to a stage. Each
(implementation, mode) is jitted, compiled and warmed up, then --iters calls run under
`jax.profiler.trace`, each in a step annotation, parsed by harness.parse_trace (the GPU kernels on the
device planes' stream lines, per call); fla runs first under torch.profiler (self device time per kernel
/ --iters). "busy" is the union of kernel intervals per call, "wall" the step window (JAX) or CUDA-event
time (fla); profilers add a little per kernel, so compare kernels within one table and walls with the
timing mode's medians.
  python -m experiments.bench_kda --profile --shapes=8x4096x16x128 --implementations=pallas,jla --iters=10 \
      --warmup=3 --fla --out=$OUT/kda_peers_h200

Run: python -m experiments.bench_kda --shapes=1x4096x4x128 --implementations=recurrent,chunked
     [--dtype=bfloat16 --iters=20] --out=experiments/results/kda_cpu
Writes <out>.json and <out>.md (default --out is under /tmp, never over the committed results).
Merge runs of several processes (no timing): --from_json=a.json,b.json,c_fla.jsonl --out=... (a .json
of a --fla run holds its fla rows already: pass its _fla.jsonl only for a run whose .json is lost);
two timing rows of the same implementation, mode, shape, dtype and --docs_per_row in the inputs, or
rows of different --docs_per_row, raise ValueError.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from typing import Callable

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import (cu_seqlens, environment, find_xplane, make_kda_inputs as make_inputs,
                                 packed_segment_ids, packed_segment_ids_np, parse_kda_shape,
                                 parse_trace,  # noqa: F401
                                 rms_ratio, time_call, write_results, STEP_NAME)
from k3jax.ops.kda import kda

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["1x4096x4x128"], "BxTxHxK shapes (V = K) or names of harness.KDA_SHAPES "
                  "(8x4096x16, 2x16384x16, 1x65536x16, 16x2048x32: K = 128; tiny)")
flags.DEFINE_list("implementations", ["recurrent", "chunked"], "recurrent, chunked, pallas, jla (jla: on a GPU "
                  "with jax-linear-attention installed; one that cannot run here is skipped with a message)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "dtype of q, k, v, beta")
flags.DEFINE_list("modes", ["fwd", "fwd+bwd"], "fwd and/or fwd+bwd")
flags.DEFINE_integer("iters", 20, "timed calls (median reported)")
flags.DEFINE_integer("warmup", 2, "untimed calls after compilation")
flags.DEFINE_integer("stream_calls", None, "back-to-back timing: calls per group, one sync after the last "
                     "(0 = off; default 10 on a GPU, 0 elsewhere)")
flags.DEFINE_integer("stream_reps", 20, "back-to-back timing: groups, each on fresh inputs (median reported)")
flags.DEFINE_integer("docs_per_row", 1, "packed documents per row (segment_ids, harness.packed_segment_ids: "
                     "exponential lengths of mean T / N, >= 64 tokens) for every implementation (fla: the same "
                     "documents as cu_seqlens, B = 1) and --profile; 1 = dense rows")
flags.DEFINE_integer("chunk_size", 64, "chunk size of the chunked/pallas implementations")
flags.DEFINE_string("out", "/tmp/k3jax_bench_kda/kda", "output path without extension ('' = no files); the "
                    "committed CPU table is --out=experiments/results/kda_cpu")
flags.DEFINE_list("from_json", [], "re-render the tables from earlier runs' files (no timing): .json files of "
                  "this script and/or the <out>_fla.jsonl rows of a --fla run (e.g. from another GPU process)")
flags.DEFINE_bool("from_json_later_wins", False, "with --from_json: a row a later file repeats replaces the "
                  "earlier one (e.g. a kernel re-run merged with peers timed before it)")
flags.DEFINE_integer("check_max_t", 2048, "accuracy check: the first min(T, this) tokens of batch row 0, every "
                     "implementation vs the fp32 recurrent oracle on the same (upcast) inputs (0 = no check)")
flags.DEFINE_bool("fla", False, "also time fla's chunk_kda(safe_gate=True, lower_bound=-5) in a torch "
                  "subprocess of this call (needs torch + CUDA + flash-linear-attention)")

flags.DEFINE_bool("profile", False, "per-kernel device time instead of wall times: --iters calls of each "
                  "implementation and mode under jax.profiler.trace (fla under torch.profiler with --fla), parsed into "
                  "kernel tables; <out>.json has every kernel, <out>.md the largest --top (the committed page: "
                  "--profile --implementations=pallas,jla --iters=10 --warmup=3 --fla --out=.../kda_peers_h200)")
flags.DEFINE_integer("top", 14, "with --profile: kernels per table in the markdown")
flags.DEFINE_string("declared_lower_bound", "-5", "lower_bound declared to the chunked and pallas ops: a "
                    "number in [-5, 0) or 'none' (the exact path for unbounded gates; the inputs are the same "
                    "g = -5 sigmoid(N(0,1)), which any path must get right). Peers always run their own way.")


def declared_lower_bound() -> float | None:
    """--declared_lower_bound as the ops take it (None = unbounded gates)."""
    v = FLAGS.declared_lower_bound.strip().lower()
    if v == "none":
        return None
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"--declared_lower_bound must be a number in [-5, 0) or 'none'; got {v!r}") from None
    if not -5.0 <= x < 0.0:
        raise ValueError(f"--declared_lower_bound must be a number in [-5, 0) or 'none'; got {x}")
    return x


def stream_calls() -> int:
    """--stream_calls as timed: its default (None) is 10 on a GPU and 0 (no back-to-back rows) elsewhere."""
    if FLAGS.stream_calls is not None:
        return FLAGS.stream_calls
    return 10 if jax.default_backend() == "gpu" else 0


def implementations(chunk_size: int, segment_ids=None) -> dict[str, Callable]:
    """name -> op(q, k, v, g, beta) -> o, for the names that can run here (packed rows with `segment_ids`)."""
    interpret = jax.default_backend() != "gpu"
    seg = segment_ids
    out = {
        "recurrent": lambda q, k, v, g, beta: kda(q, k, v, g, beta, implementation="recurrent", segment_ids=seg)[0],
        "chunked": lambda q, k, v, g, beta: kda(q, k, v, g, beta, implementation="chunked", segment_ids=seg,
                                                lower_bound=declared_lower_bound(), chunk_size=chunk_size)[0],
    }
    if jax.default_backend() == "gpu":
        try:  # peer: jax-linear-attention's Mosaic GPU KDA (its own gate/beta conventions as in ANCHORS)
            from jla import ops as jla_ops
            out["jla"] = lambda q, k, v, g, beta: jla_ops.linear_attention(
                "kda", q, k, v, g=g, beta=beta, impl="mosaic_gpu", segment_ids=seg)[0]
        except ImportError:
            pass
    try:
        import pallas_kernels.kda  # noqa: F401
        out["pallas"] = lambda q, k, v, g, beta: kda(q, k, v, g, beta, implementation="pallas", segment_ids=seg,
                                                     lower_bound=declared_lower_bound(), chunk_size=chunk_size,
                                                     interpret=interpret)[0]
    except ImportError:
        pass
    return out


def jitted(op: Callable, mode: str) -> Callable:
    """fwd: jit(op)(q, k, v, g, beta, do) -> o; fwd+bwd: value and grads of sum(o * do)."""
    if mode == "fwd":
        return jax.jit(lambda q, k, v, g, beta, do: op(q, k, v, g, beta))

    def loss(q, k, v, g, beta, do):
        return jnp.sum(op(q, k, v, g, beta).astype(jnp.float32) * do.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


# fla's inputs in torch, make_inputs' recipe, and chunk_kda's keywords (B, T, H, K and cu, the
# cu_seqlens of packed rows or None, defined before; also --profile's).
FLA_INPUTS = """\
torch.manual_seed(0)
q = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16()
v = torch.randn(B, T, H, K, device="cuda", dtype=torch.bfloat16)
g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, device="cuda"))
beta = torch.sigmoid(torch.randn(B, T, H, device="cuda")).bfloat16()
kw = dict(safe_gate=True, lower_bound=-5.0)
if cu:  # packed rows as fla takes them: one flattened sequence, documents by cu_seqlens
    q, k, v, g, beta = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta))
    kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.long, device="cuda")
"""

# The torch subprocesses' imports and the versions their rows record (timing and --profile).
FLA_PRELUDE = r"""
import json, sys, torch
import fla
from fla.ops.kda import chunk_kda
versions = dict(fla=getattr(fla, "__version__", "?"), torch=torch.__version__,
                triton=__import__("triton").__version__)
"""

FLA_SCRIPT = FLA_PRELUDE + r"""from triton.testing import do_bench
rows = []
cus = json.loads(sys.argv[2])
for shape in sys.argv[1].split(","):
    B, T, H, K = (int(x) for x in shape.lower().split("x"))
    cu = cus.get(shape)
""" + textwrap.indent(FLA_INPUTS, "    ") + r"""    fwd = do_bench(lambda: chunk_kda(q, k, v, g, beta, **kw), warmup=50, rep=200, return_mode="median")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
    do = torch.randn(*v.shape, device="cuda", dtype=torch.bfloat16)
    def fb():
        for t in leaves:          # fresh gradients each call (no accumulation into .grad)
            t.grad = None
        o, _ = chunk_kda(*leaves, **kw)
        o.backward(do)
    fwdbwd = do_bench(fb, warmup=50, rep=200, return_mode="median")
    for mode, ms in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
        rows.append(dict(implementation="fla", mode=mode, B=B, T=T, H=H, K=K, V=K, dtype="bfloat16",
                         chunk_size=64, median_ms=ms, min_ms=None, max_ms=None, docs_per_row=int(sys.argv[3]),
                         iters="do_bench", compile_s=None, versions=versions))
    print("ROW" + json.dumps(rows[-2]) + "\nROW" + json.dumps(rows[-1]), flush=True)
"""


def fla_cu_seqlens(shapes, docs: int) -> dict:
    """{shape: cu_seqlens} of the packed rows every implementation gets (harness.packed_segment_ids in
    numpy: no JAX backend touched), {} for dense rows (docs == 1)."""
    if docs == 1:
        return {}
    return {s: cu_seqlens(packed_segment_ids_np(*parse_kda_shape(s)[:2], docs)) for s in shapes}


def documents_per_row(segment_ids) -> float:
    """Mean number of documents a row of segment_ids [B, T] holds (1.0 for None: dense rows)."""
    if segment_ids is None:
        return 1.0
    ids = np.asarray(segment_ids)
    return float(np.mean([len(np.unique(row)) for row in ids]))


def run_fla(shapes, docs: int = 1) -> list[dict]:
    """fla chunk_kda timings from a torch subprocess (run before JAX touches the GPU); with docs > 1 the
    same packed documents as the JAX rows, through chunk_kda's cu_seqlens (B = 1, rows flattened).

    The subprocess's rows are read as it prints them and, with --out, appended to `<out>_fla.jsonl`
    at once: fla's Triton autotuning can take minutes per shape, and a run cut short keeps the
    shapes it finished.
    """
    rows = []
    if FLAGS.out:
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    sink = open(FLAGS.out + "_fla.jsonl", "a") if FLAGS.out else None
    try:
        proc = subprocess.Popen([sys.executable, "-c", FLA_SCRIPT, ",".join(shapes),
                                 json.dumps(fla_cu_seqlens(shapes, docs)), str(docs)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        for line in proc.stdout:
            if line.startswith("ROW"):
                rows.append(json.loads(line[3:]))
                print(line.rstrip(), flush=True)
                if sink:
                    sink.write(line[3:])
                    sink.flush()
        if proc.wait():
            err = proc.stderr.read()
            missing = [line for line in err.splitlines() if "ModuleNotFoundError" in line]
            print(f"fla skipped: {missing[-1]} (needs torch + CUDA + flash-linear-attention)" if missing
                  else f"fla failed: {err[-800:]}", flush=True)
    except Exception as e:  # noqa: BLE001 -- a missing peer must not stop our own timings
        print("fla failed:", repr(e)[:300], flush=True)
    finally:
        if sink:
            sink.close()
    return rows


def counts(B, T, H, K, V, chunk_size):
    """Forward FLOPs and the fewest HBM bytes of chunked KDA (q, k, v bf16, g fp32, beta bf16 read once;
    o bf16 written once). FLOPs per token-head: Aqk, L (2·2CK), A·(βK e^G), A·(βV) (2CK + 2CV),
    state terms W S, Q S, Kᵀ V' (6KV), Aqk V' (2CV)."""
    C = chunk_size
    tokens = B * T * H
    flops = tokens * (4 * C * K + 2 * C * K + 4 * C * V + 6 * K * V)
    bytes_ = tokens * (2 * K * 2 + 4 * K + 2 * V + 2 + 2 * V)
    return flops, bytes_


def check_errors(op: Callable, B, T, H, K, dtype, segment_ids=None) -> dict:
    """RMS ratios of op's o and of the gradients of sum(o * do) w.r.t. q, k, v, g, beta, on the first
    batch row of fresh inputs with T tokens, against the fp32 recurrent oracle on the same inputs upcast
    to fp32 (the reference the tests use; fla's tolerances are o 5e-3, dq/dk/dv 8e-3, dg/dbeta 2e-2);
    `segment_ids` [1, T]: the same packed documents for both."""
    del B
    args = make_inputs(jax.random.PRNGKey(7), 1, T, H, K, dtype)
    ref_op = lambda q, k, v, g, beta: kda(q, k, v, g, beta, implementation="recurrent",  # noqa: E731
                                          segment_ids=segment_ids)[0]
    ref = jitted(ref_op, "fwd+bwd")(*(a.astype(jnp.float32) for a in args))
    got = jitted(op, "fwd+bwd")(*args)
    o_ref = jitted(ref_op, "fwd")(*(a.astype(jnp.float32) for a in args))
    o_got = jitted(op, "fwd")(*args)
    return {"o": rms_ratio(o_got, o_ref), **{f"d{n}": rms_ratio(a, b) for n, a, b in
                                            zip(("q", "k", "v", "g", "beta"), got[1], ref[1])}}


def load_rows(paths, later_wins: bool = False) -> tuple[dict, list[dict]]:
    """Rows (and an environment) of earlier runs: this script's .json files and --fla .jsonl rows.

    With `later_wins`, a row (timing: implementation, mode, B, T, H, K, dtype; check: implementation
    and shape) that a LATER path repeats replaces the earlier one (a re-run after a kernel change
    next to peers timed before it), and the environment is the last .json file's (else the first's);
    each kept row names its file in "source". Files of several devices: the environment's "device"
    names them all, joined by " / " (the header says so; the tables print no floor).

    Raises:
      ValueError: no .json file among `paths`; without `later_wins`, two timing rows with the same
        implementation, mode, B, T, H, K and dtype (the side-by-side table would silently keep one).
    """
    env, rows, devices = None, [], set()
    for path in paths:
        with open(path) as f:
            if path.endswith(".jsonl"):
                new = [json.loads(line) for line in f if line.strip()]
            else:
                saved = json.load(f)
                env = saved["environment"] if (later_wins or env is None) else env
                devices.add(saved["environment"].get("device", ""))
                new = saved["rows"]
        for r in new:
            r["source"] = os.path.basename(path)
        if later_wins:
            keys = {_row_key(r) for r in new}
            rows = [r for r in rows if _row_key(r) not in keys]
        rows += new
    if env is None:
        raise ValueError(f"from_json={paths!r} names no .json file with an environment")
    if len(devices) > 1:                 # runs of several cards: the header says so, and no floor
        env = dict(env, device=" / ".join(sorted(devices)))
    docs = sorted({r.get("docs_per_row", 1) for r in rows})
    if len(docs) > 1:
        raise ValueError(f"from_json={paths!r}: rows of different --docs_per_row ({docs}); the side-by-side "
                         "tables compare one packing at a time: merge dense and packed runs separately")
    seen = set()
    for r in rows:
        if r["mode"] == "check":
            continue
        key = _row_key(r)
        if key in seen:
            raise ValueError(f"from_json={paths!r}: two timing rows for {key} (implementation, mode, B, T, H, K, "
                             "dtype); keep one (each --fla run appends to <out>_fla.jsonl) or pass "
                             "--from_json_later_wins")
        seen.add(key)
    return env, rows


def _row_key(r: dict) -> tuple:
    """What makes two rows the same measurement (check rows: implementation and shape)."""
    if r["mode"] == "check":
        return (r["implementation"], "check", r.get("shape"), r.get("B"), r.get("T"), r.get("H"), r.get("K"),
                r.get("lower_bound", -5.0), r.get("docs_per_row", 1))
    return (r["implementation"], r["mode"], r["B"], r["T"], r["H"], r["K"], r.get("dtype", "bfloat16"),
            r.get("lower_bound", -5.0), r.get("docs_per_row", 1))


def _ms(x) -> str:
    """A table cell for milliseconds: '—' for a value not measured (None or NaN, e.g. fla's do_bench rows)."""
    return "—" if x is None or x != x else f"{x:.2f}"


KNOWN_IMPLEMENTATIONS = ("recurrent", "chunked", "pallas", "jla")
MODES = ("fwd", "fwd+bwd")


def check_flags():
    """Typos fail before any timing: --modes, --implementations, --shapes (BxTxHxK, positive ints).

    Raises:
      ValueError: naming the flag and the accepted values.
    """
    declared_lower_bound()
    for name, value, low in (("iters", FLAGS.iters, 1), ("stream_calls", stream_calls(), 0),
                             ("stream_reps", FLAGS.stream_reps, 0)):
        if value < low:
            raise ValueError(f"--{name}: must be >= {low}; got {value}")
    if not FLAGS.modes or set(FLAGS.modes) - set(MODES):
        raise ValueError(f"--modes: choose from {MODES}; got {FLAGS.modes}")
    unknown = sorted(set(FLAGS.implementations) - set(KNOWN_IMPLEMENTATIONS))
    if unknown:
        raise ValueError(f"--implementations: unknown {unknown}; choose from {KNOWN_IMPLEMENTATIONS}")
    try:
        FLAGS.shapes = ["x".join(map(str, parse_kda_shape(shape))) for shape in FLAGS.shapes]
    except ValueError as e:
        raise ValueError(f"--shapes: {e}") from None
    for shape in FLAGS.shapes:     # documents of >= 64 tokens: at most T / 64 of them a row
        T = parse_kda_shape(shape)[1]
        if not 1 <= FLAGS.docs_per_row <= max(1, T // 64):
            raise ValueError(f"--docs_per_row must be in [1, T / 64 = {max(1, T // 64)}] for shape {shape} "
                             f"(documents of at least 64 tokens); got {FLAGS.docs_per_row}")


def time_all():
    """Time every requested implementation, shape and mode; returns (environment, rows)."""
    env = environment()
    dtype = jnp.dtype(FLAGS.dtype)
    docs = FLAGS.docs_per_row
    rows = run_fla(FLAGS.shapes, docs) if FLAGS.fla else []
    for shape in FLAGS.shapes:
        B, T, H, K = (int(x) for x in shape.lower().split("x"))
        seg = packed_segment_ids(B, T, docs) if docs > 1 else None
        docs_mean = documents_per_row(seg)
        ops = implementations(FLAGS.chunk_size, seg)
        check_T = min(T, FLAGS.check_max_t)
        check_ops = implementations(FLAGS.chunk_size, None if seg is None else seg[:1, :check_T])
        for name in FLAGS.implementations:
            if name not in ops:
                print(f"skip {name}: not importable here", flush=True)
                continue
            if FLAGS.check_max_t and name != "recurrent":
                errs = check_errors(check_ops[name], B, check_T, H, K, dtype,
                                    None if seg is None else seg[:1, :check_T])
                print(json.dumps(dict(implementation=name, shape=shape, rms_ratio_vs_fp32_recurrent=errs)), flush=True)
                rows.append(dict(implementation=name, mode="check", B=B, T=T, H=H, K=K,
                                 check_T=check_T, rms_ratio_vs_fp32_recurrent=errs,
                                 lower_bound=declared_lower_bound(), docs_per_row=docs, docs_mean=docs_mean))
            for mode in FLAGS.modes:
                fn = jitted(ops[name], mode)
                r = time_call(fn, lambda i: make_inputs(jax.random.PRNGKey(i), B, T, H, K, dtype),
                              iters=FLAGS.iters, warmup=FLAGS.warmup, stream_calls=stream_calls(),
                              stream_reps=FLAGS.stream_reps)
                row = dict(implementation=name, mode=mode, B=B, T=T, H=H, K=K, V=K, dtype=FLAGS.dtype,
                           chunk_size=FLAGS.chunk_size, warmup=FLAGS.warmup,
                           lower_bound=declared_lower_bound(), docs_per_row=docs, docs_mean=docs_mean, **r)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if FLAGS.out:  # keep partial results if the run is cut short
                    write_results(FLAGS.out, dict(environment=env, rows=rows))
    return env, rows


PEERS = ("jla", "fla")


def packed_note(rows) -> str:
    """' Packed rows: ...' for rows timed with --docs_per_row > 1 ('' for dense rows)."""
    docs = {r.get("docs_per_row", 1) for r in rows}
    if docs <= {1}:
        return ""
    means = sorted({round(r["docs_mean"], 2) for r in rows if r.get("docs_mean")})
    return (f" Packed rows: --docs_per_row={'/'.join(map(str, sorted(docs)))} (segment_ids; documents of "
            "exponential length of mean T / docs_per_row, at least 64 tokens" +
            (f"; {' / '.join(map(str, means))} documents a row on average" if means else "") +
            "; fla: the same documents as cu_seqlens).")


# The floor's rates (bf16 FLOP/s, HBM bytes/s), measured on these machines' H200s; other devices get no floor.
FLOOR_RATES = {"H200": (790e12, 4.3e12)}


def floor_rates(device: str):
    """(FLOP/s, bytes/s) of the floor for a device name (environment()["device"]; "H200" as a word,
    so not GH200), or None; for several devices (" / "-joined by load_rows) None."""
    found = {next((rates for name, rates in FLOOR_RATES.items() if re.search(rf"\b{name}\b", d)), None)
             for d in device.split(" / ")}
    return found.pop() if len(found) == 1 else None


def side_by_side(rows: list[dict], key: str, title: str, device: str = "") -> list[str]:
    """Markdown lines comparing pallas / chunked with the peers per shape and mode, by the rows' `key`
    ("median_ms" or "stream_ms"; fla's rows, do_bench device times, always by "median_ms"). A peer
    whose row lacks `key` leaves the ratios "—" (never a ratio to the other peer alone). The floor
    columns need `device`'s rates (FLOOR_RATES), else they read "—"."""
    docs = sorted({r.get("docs_per_row", 1) for r in rows if r.get("mode") != "check"}) or [1]
    if docs != [1]:
        title += f"; packed rows, {'/'.join(map(str, docs))} documents per row (segment_ids)"
    rates = floor_rates(device)
    floor_text = (f"floor = max(FLOPs / {rates[0] / 1e12:.0f} TFLOP/s, bytes / {rates[1] / 1e12:.1f} TB/s), the "
                  "H200 rates measured on these machines" if rates else
                  f"no floor: no measured rates for {device or 'this device'}")
    lines = ["", f"{title}; ratio = k3jax / best peer, < 1 is faster; {floor_text}):", "",
             "| B×T×H | mode | k3jax pallas | k3jax chunked | jla | fla | pallas / best peer | "
             "chunked / best peer | chunked / pallas | floor ms | pallas % of floor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in FLAGS.shapes:
        B, T, H, K = (int(x) for x in shape.lower().split("x"))
        flops, nbytes = counts(B, T, H, K, K, FLAGS.chunk_size)
        for mode in FLAGS.modes:
            mult = 1 if mode == "fwd" else 3
            floor = max(mult * flops / rates[0], mult * nbytes / rates[1]) * 1e3 if rates else None
            t = {r["implementation"]: r.get("median_ms" if r["implementation"] == "fla" else key) for r in rows
                 if r["mode"] == mode and (r["B"], r["T"], r["H"], r["K"]) == (B, T, H, K)}
            peer_missing = any(t.get(p, 0.0) is None for p in PEERS)
            t = {n: ms for n, ms in t.items() if ms is not None}
            peers = [t[p] for p in PEERS if p in t]
            best = min(peers) if peers and not peer_missing else None
            cell = lambda n: f"{t[n]:.2f}" if n in t else "—"  # noqa: E731
            ratio = lambda n: f"{t[n] / best:.2f}" if n in t and best else "—"  # noqa: E731
            pct = f"{100 * floor / t['pallas']:.1f}%" if "pallas" in t and floor else "—"
            speedup = f"{t['chunked'] / t['pallas']:.2f}×" if {"chunked", "pallas"} <= set(t) else "—"
            lines.append(f"| {B}×{T}×{H} | {mode} | {cell('pallas')} | {cell('chunked')} | {cell('jla')} | "
                         f"{cell('fla')} | {ratio('pallas')} | {ratio('chunked')} | {speedup} | "
                         f"{f'{floor:.3f}' if floor else '—'} | "
                         f"{pct} |")
    return lines


FLA_PROFILE_SCRIPT = FLA_PRELUDE + r"""from torch.profiler import profile, ProfilerActivity
B, T, H, K = (int(x) for x in sys.argv[1].lower().split("x"))
iters, warmup, modes = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
cu = json.loads(sys.argv[5])
""" + FLA_INPUTS + r"""do = torch.randn(*v.shape, device="cuda", dtype=torch.bfloat16)
leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g, beta)]
def fwd():
    with torch.no_grad():
        chunk_kda(q, k, v, g, beta, **kw)
def fb():
    for t in leaves:              # fresh gradients each call (no accumulation into .grad)
        t.grad = None
    o, _ = chunk_kda(*leaves, **kw)
    o.backward(do)
for mode in modes:
    fn = fwd if mode == "fwd" else fb
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / iters
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us and e.count:
            kernels.append(dict(kernel=e.key, ms=us / 1e3 / iters, calls=e.count / iters))
    kernels.sort(key=lambda r: -r["ms"])
    print("ROW" + json.dumps(dict(implementation="fla", mode=mode, wall_ms=wall, busy_ms=None,
                                  kernels=kernels, versions=versions)), flush=True)
"""


def profile_fla(shape: str) -> list[dict]:
    """fla's rows from a torch subprocess (run before JAX touches the GPU); [] when fla is missing.
    With --docs_per_row > 1: the JAX rows' packed documents as cu_seqlens."""
    cu = fla_cu_seqlens([shape], FLAGS.docs_per_row).get(shape)
    proc = subprocess.run([sys.executable, "-c", FLA_PROFILE_SCRIPT, shape, str(FLAGS.iters), str(FLAGS.warmup),
                           ",".join(FLAGS.modes), json.dumps(cu)], capture_output=True, text=True)
    rows = [json.loads(line[3:]) for line in proc.stdout.splitlines() if line.startswith("ROW")]
    if proc.returncode:
        print("fla failed:", proc.stderr[-800:], flush=True)
    return rows


def profile_jax(name: str, op, mode: str, args) -> dict:
    """One (implementation, mode): compile, warm up, --iters calls traced; kernels per call."""
    fn = jitted(op, mode)
    for _ in range(1 + FLAGS.warmup):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for i in range(FLAGS.iters):
                with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                    jax.block_until_ready(fn(*args))
        summary = parse_trace(trace_dir)
    kernels = [dict(kernel=r["kernel"], ms=r["ms_per_step"], calls=r["count_per_step"]) for r in summary["ops"]]
    return dict(implementation=name, mode=mode, wall_ms=summary["step_wall_ms"], busy_ms=summary["device_busy_ms"],
                kernels=kernels)


def write_profile_markdown(result: dict, path: str) -> None:
    """The per-kernel tables of a --profile run (the largest --top kernels per implementation and mode)."""
    env = result["environment"]
    lb = result.get("lower_bound", -5.0)
    lines = [f"# KDA per-kernel GPU time (B×T×H×K, V = K; {result.get('dtype', 'bfloat16')}, lower_bound = "
             f"{'none' if lb is None else lb})", "",
             f"{result['date']}; {env.get('device', '?')}; "
             + ", ".join(f"{k} {v}" for k, v in env.items() if k not in ("device", "date"))
             + f"; {result['iters']} profiled calls each. Made by `experiments/bench_kda.py --profile`.", "",
             "ms per call; busy = union of kernel intervals, wall = step window (JAX) or CUDA events (fla).", ""]
    for r in result["rows"]:
        total = sum(k["ms"] for k in r["kernels"])
        busy = f"{r['busy_ms']:.3f}" if r.get("busy_ms") is not None else "—"
        docs = r.get("docs_per_row", 1)
        mean = f" ({r['docs_mean']:.1f} documents a row)" if r.get("docs_mean") else ""
        packed = f", --docs_per_row={docs}{mean}" if docs > 1 else ""
        lines += [f"## {r['shape']}{packed} {r['implementation']} {r['mode']}: wall {r['wall_ms']:.3f}, busy {busy}, "
                  f"kernels {total:.3f} ms ({len(r['kernels'])} distinct)", "",
                  "| kernel | ms | calls | share of kernel time |", "|---|---:|---:|---:|"]
        for k in r["kernels"][:FLAGS.top]:
            lines.append(f"| `{k['kernel'][:90]}` | {k['ms']:.3f} | {k['calls']:g} | {k['ms'] / total:.1%} |")
        rest = r["kernels"][FLAGS.top:]
        if rest:
            lines.append(f"| ({len(rest)} others) | {sum(k['ms'] for k in rest):.3f} | | |")
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def save_profile(rows: list[dict]) -> None:
    """Write <out>.json and <out>.md with the rows so far (a run cut by a time limit keeps them)."""
    fla_versions = next((r["versions"] for r in rows if "versions" in r), {})
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  iters=FLAGS.iters, dtype=FLAGS.dtype, lower_bound=declared_lower_bound(),
                  environment={**environment(), **fla_versions},
                  rows=[{k: v for k, v in r.items() if k != "versions"} for r in rows])
    write_results(FLAGS.out, result)
    write_profile_markdown(result, FLAGS.out + ".md")


def profile_main() -> None:
    """--profile: per-kernel GPU time of each implementation, mode and shape (module docstring)."""
    if not FLAGS.out:
        raise ValueError("--out must be a path prefix with --profile (the .json and .md are written there)")
    if FLAGS.from_json:
        if len(FLAGS.from_json) != 1:
            raise ValueError(f"--from_json with --profile takes one JSON of a --profile run; got {FLAGS.from_json}")
        with open(FLAGS.from_json[0]) as f:
            result = json.load(f)
        os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
        write_profile_markdown(result, FLAGS.out + ".md")
        return
    check_flags()
    if FLAGS.warmup < 0:
        raise ValueError(f"--warmup must be >= 0; got {FLAGS.warmup}")
    rows = []
    if FLAGS.fla:            # every shape before JAX touches the GPU (save_profile would: it asks for the device)
        for shape in FLAGS.shapes:
            rows += [dict(r, shape=shape, docs_per_row=FLAGS.docs_per_row) for r in profile_fla(shape)]
    docs = FLAGS.docs_per_row
    for shape in FLAGS.shapes:
        B, T, H, K = parse_kda_shape(shape)
        seg = packed_segment_ids(B, T, docs) if docs > 1 else None
        ops = implementations(FLAGS.chunk_size, seg)
        args = jax.block_until_ready(make_inputs(jax.random.key(0), B, T, H, K, jnp.dtype(FLAGS.dtype)))
        for name in FLAGS.implementations:
            if name not in ops:
                print(f"{name}: not available here, skipped", flush=True)
                continue
            for mode in FLAGS.modes:
                rows.append(dict(profile_jax(name, ops[name], mode, args), shape=shape, docs_per_row=docs,
                                 docs_mean=documents_per_row(seg)))
                r = rows[-1]
                save_profile(rows)
                print(f"{shape} {name} {mode}: wall {r['wall_ms']:.3f} ms, busy {r['busy_ms']:.3f} ms", flush=True)
        del args
    save_profile(rows)
    print("wrote", FLAGS.out + ".json", FLAGS.out + ".md", flush=True)


def main(argv):
    del argv
    if FLAGS.profile:
        profile_main()
        return
    if FLAGS.from_json:
        env, rows = load_rows(FLAGS.from_json, later_wins=FLAGS.from_json_later_wins)
        shapes = list(dict.fromkeys(f"{r['B']}x{r['T']}x{r['H']}x{r['K']}" for r in rows))
        FLAGS.shapes = shapes
    else:
        check_flags()
        env, rows = time_all()
    timed = [r for r in rows if r["mode"] != "check" and r["implementation"] not in ("fla",)]
    if FLAGS.from_json:  # describe the rows, not this call's flags
        def join(key):
            return "/".join(dict.fromkeys(str(r[key]) for r in timed if key in r)) or "?"
        dtype, iters, warmup = join("dtype"), join("iters"), join("warmup")
        stream = (join("stream_reps"), join("stream_calls"))
        merged = " Merged (`--from_json`) from " + ", ".join(f"`{os.path.basename(p)}`" for p in FLAGS.from_json) + "."
    else:
        dtype, iters, warmup, merged = FLAGS.dtype, FLAGS.iters, FLAGS.warmup, ""
        stream = (FLAGS.stream_reps, stream_calls())
    stream_note = ("" if not any("stream_ms" in r for r in timed) else
                   f"; back-to-back ms: median of {stream[0]} groups of {stream[1]} calls dispatched without "
                   "waiting (one sync a group), per call")
    declared = "/".join(dict.fromkeys(str(r.get("lower_bound", -5.0)) for r in timed)) or "-5.0"
    fla_versions = sorted({", ".join(f"{k} {v}" for k, v in r["versions"].items())
                           for r in rows if r["implementation"] == "fla" and r.get("versions")})
    fla_note = (" (fla rows: triton do_bench medians" + (f"; {' / '.join(fla_versions)}" if fla_versions else "")
                + ")") if any(r["implementation"] == "fla" for r in rows) else ""
    lines = [f"# KDA timings ({env['date']})", "",
             f"Backend {env['backend']} ({env['device']}), {env['platform']}, {env['cpu_count']} CPUs; python "
             f"{env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}. {dtype} q/k/v/beta, fp32 g = "
             f"-5 sigmoid(N(0,1)), lower_bound {declared} declared to chunked / pallas; median of {iters} calls with fresh inputs "
             f"after {warmup if warmup != '?' else 'some'} warm-up calls{stream_note}{fla_note}.{merged}"
             + packed_note([r for r in rows if r["mode"] != "check"]), "",
             "| B×T×H×K | implementation | mode | median ms | min ms | max ms | back-to-back ms | vs recurrent |",
             "|---|---|---|---|---|---|---|---|"]
    for r in [r for r in rows if r["mode"] == "check"]:
        if "rms_ratio_vs_fp32_recurrent" in r:
            what, errs = f"RMS ratio vs fp32 recurrent (1×{r['check_T']}×{r['H']})", r["rms_ratio_vs_fp32_recurrent"]
        else:  # runs before 2026-12-01 compared with the bf16 chunked op at the timed shape
            what, errs = "RMS ratio vs chunked", r["rms_ratio_vs_chunked"]
        lines.append(f"| {r['B']}×{r['T']}×{r['H']}×{r['K']} | {r['implementation']} | {what} | " +
                     ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + " | | | | |")
    for r in [r for r in rows if r["mode"] != "check"]:
        ref = [x for x in rows if x["implementation"] == "recurrent" and x["mode"] == r["mode"]
               and (x["B"], x["T"], x["H"], x["K"]) == (r["B"], r["T"], r["H"], r["K"])]
        speed = f"{ref[0]['median_ms'] / r['median_ms']:.1f}×" if ref else "—"
        lines.append(f"| {r['B']}×{r['T']}×{r['H']}×{r['K']} | {r['implementation']} | {r['mode']} | "
                     f"{r['median_ms']:.2f} | {_ms(r.get('min_ms'))} | {_ms(r.get('max_ms'))} | "
                     f"{_ms(r.get('stream_ms'))} | {speed} |")
    if any(r["implementation"] in PEERS for r in rows):
        lines += side_by_side(rows, "median_ms", "Side by side (median ms per call, host wall time; fla's rows are "
                              "do_bench device times", env.get("device", ""))
        if any("stream_ms" in r for r in rows):
            lines += side_by_side(rows, "stream_ms", "Side by side, device-bound (back-to-back ms per call for the "
                                  "JAX rows, do_bench for fla; close to like for like", env.get("device", ""))
    md = "\n".join(lines) + "\n"
    print(md)
    if FLAGS.out:
        write_results(FLAGS.out, dict(environment=env, rows=rows), md)


if __name__ == "__main__":
    app.run(main)
