"""Which device ops take the time in one real train step: a profiler trace of the trainer's own step, parsed.

  python -m experiments.profile_step --config=experiments/configs/k3_small_gpu.py --out=$OUT/k3_small_step_h200 \
      --trace_dir=$OUT/k3_small_step_trace --warmup=0 --timed=2 --steps=2   # one H200, ~3 min with compile
  python -m experiments.profile_step --config=experiments/configs/k3_tiny.py --out=/tmp/k3_tiny_step   # CPU
  python -m experiments.profile_step --from_trace=/tmp/k3_tiny_step_trace --out=/tmp/again   # re-parse only

For a run config (`--config`, overrides as in experiments/train.py) the model, optimizer, data loader and
`k3jax.train.step.train_step` are built the way `k3jax.train.trainer.train` builds them (same corpus, same
grain loader, same jitted step; no checkpoint, eval or metrics writer). Then, in one process:
 1. compile: the first step, timed (wall seconds, and XLA's backend compile seconds from jax.monitoring);
 2. `--warmup` more untimed steps;
 3. `--timed` steps without the profiler, each split as the trainer's loop runs it: next batch + host->device
    (`data_s`, host-side time outside the step), the jitted call returning (`dispatch_s`), `jax.device_get`
    of the metrics (`wait_s`); `step_s` = dispatch + wait is what the trainer times per step;
 4. `--steps` steps under `jax.profiler.trace` (each inside a `StepTraceAnnotation("train")`), written to
    `--trace_dir`, then parsed here (`parse_trace`): every device op event (GPU: kernels and memcpys on the
    device planes' stream lines; CPU: the XLA thunks on the host threads) inside the traced steps, per
    (kernel name, HLO op) its total time, count and share of the step wall time, sorted; device-busy time
    (union of op intervals) against the step wall time (the rest: host-side work or synchronisation); and,
    with the compiled HLO (dumped by XLA during the compile: `--xla_dump_to=<trace_dir>/hlo`, or re-compiled
    with `--hlo=recompile`), each HLO op's kind (dot / custom-call target / sort / scatter / reduce ...), its
    JAX name stack (forward / backward (`transpose(`) / optimizer) and its Python source, so the op time
    is also grouped by model component (the innermost `k3jax/nn` module method, else the optimizer, else the
    outermost `k3jax/ops` function), by phase and by k3jax source line. k3jax has no `jax.named_scope`s; the source frames in
    the HLO metadata stand in for them.
Writes `<out>.json` and `<out>.md` (date, device, versions).
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
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

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


def summarize_trace(trace: dict, *, hlo: dict[str, HloOp] | None = None, top: int = 40) -> dict:
    """Per-op table, device-busy vs step wall time and groupings from `read_trace`'s output.

    `ops` holds every distinct (kernel, HLO op), longest first; `top` is how many the markdown shows.
    Only op events inside the step windows count (all of them when the trace has no step events). Times
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
        n_steps = 1
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


def parse_trace(path: str, *, hlo_text: str | None = None, top: int = 40) -> dict:
    """`summarize_trace(read_trace(path), hlo=parse_hlo(hlo_text))`: the profile of a trace folder or file."""
    return summarize_trace(read_trace(path), hlo=parse_hlo(hlo_text) if hlo_text else None, top=top)


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


# ----------------------------------------------------------------------------------------------- the run


def build(cfg):
    """Model, optimizer and training batch iterator exactly as `k3jax.train.trainer.train` makes them
    (fresh: no checkpoint restored)."""
    from flax import nnx  # noqa: PLC0415
    from k3jax.data.corpus import load_corpus  # noqa: PLC0415
    from k3jax.data.pipeline import make_train_loader  # noqa: PLC0415
    from k3jax.models.lm import LanguageModel  # noqa: PLC0415
    from k3jax.train.optimizer import make_optimizer  # noqa: PLC0415
    train_corpus = load_corpus(cfg.data.source, "train", cache_dir=cfg.data.cache_dir or None)
    model = LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg.train), wrt=nnx.Param)
    data_iter = make_train_loader(train_corpus.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                                  seed=cfg.seed)
    return model, optimizer, data_iter


def _next_batch(data_iter):
    return {k: jnp.asarray(v) for k, v in next(data_iter).items()}  # as the trainer's loop


def profile_run(cfg, *, warmup: int, timed: int, steps: int, trace_dir: str, hlo: str = "dump",
                python_tracer: bool = False, top: int = 40) -> dict:
    """Compile, warm up, time and trace the trainer's step for `cfg` (see the module docstring).

    Args:
      hlo: "dump" (read `<trace_dir>/hlo`, which `main` asks XLA to fill during the compile), "recompile"
        (`train_step.lower(...).compile()` once more after the trace: a second full compile unless the
        persistent cache hits) or "none".
    Raises:
      ValueError: steps < 1, timed < 1, warmup < 0 or an unknown `hlo`.
    """
    from experiments.runtime import CompileCounter  # noqa: PLC0415
    from k3jax.train.step import train_step  # noqa: PLC0415
    if steps < 1 or timed < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1, timed >= 1, warmup >= 0, got {steps=}, {timed=}, {warmup=}")
    if hlo not in ("dump", "recompile", "none"):
        raise ValueError(f"hlo must be 'dump', 'recompile' or 'none', got {hlo=}")
    counter = CompileCounter()
    phases: dict[str, float] = collections.defaultdict(float)  # jax's own compile-phase durations

    def on_duration(name, duration, **kwargs):
        if name.startswith("/jax/core/compile/"):
            phases[name.rsplit("/", 1)[-1]] += float(duration)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    t0 = time.perf_counter()
    model, optimizer, data_iter = build(cfg)
    build_s = time.perf_counter() - t0
    counter.reset()
    batch = _next_batch(data_iter)
    phases.clear()
    t0 = time.perf_counter()
    jax.device_get(train_step(model, optimizer, batch))
    first_step_s = time.perf_counter() - t0
    compile_stats = counter.reset()
    compile_stats["phases_s"] = dict(phases)
    for _ in range(warmup):
        jax.device_get(train_step(model, optimizer, _next_batch(data_iter)))
    rows = []
    for _ in range(timed):
        t0 = time.perf_counter()
        batch = _next_batch(data_iter)
        t1 = time.perf_counter()
        metrics = train_step(model, optimizer, batch)
        t2 = time.perf_counter()
        metrics = jax.device_get(metrics)
        t3 = time.perf_counter()
        rows.append({"data_s": t1 - t0, "dispatch_s": t2 - t1, "wait_s": t3 - t2, "step_s": t3 - t1})
    timing = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python_tracer else 0
    os.makedirs(trace_dir, exist_ok=True)
    traced = []
    with jax.profiler.trace(trace_dir, profiler_options=options):
        for i in range(steps):
            batch = _next_batch(data_iter)
            t0 = time.perf_counter()
            with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=i):
                jax.device_get(train_step(model, optimizer, batch))
            traced.append(time.perf_counter() - t0)
    recompiled = {}
    if hlo == "dump":
        hlo_text = read_hlo_dump(os.path.join(trace_dir, "hlo"), keep_only=True)
    elif hlo == "recompile":
        counter.reset()
        hlo_text = train_step.lower(model, optimizer, _next_batch(data_iter)).compile().as_text()
        recompiled = counter.reset()
    else:
        hlo_text = None
    profile = parse_trace(trace_dir, hlo_text=hlo_text, top=top)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    return {"build_s": build_s, "first_step_s": first_step_s, "compile": compile_stats, "timing_median": timing,
            "timing_steps": rows, "tokens_per_step": B * T, "tokens_per_s": B * T / timing["step_s"],
            "traced_step_s": traced, "trace_dir": trace_dir, "hlo": hlo, "hlo_found": hlo_text is not None,
            "hlo_recompile": recompiled, "profile": profile}


def environment(cfg) -> dict:
    import flax  # noqa: PLC0415
    import jaxlib  # noqa: PLC0415
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": f"{jax.devices()[0].device_kind} x{jax.device_count()} ({platform.node()})",
            "backend": jax.default_backend(), "python": sys.version.split()[0], "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg}


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def render(result: dict) -> str:
    """The markdown report of `profile_run` (or a re-parse: {"env", "profile"})."""
    env, p = result["env"], result["profile"]
    lines = [f"# One train step, op by op ({env['date']}, {env['device']})", "",
             f"jax {env['jax']}, jaxlib {env['jaxlib']}, flax {env['flax']}; `experiments/profile_step.py`."]
    if "timing_median" in result:
        t = result["timing_median"]
        ph = ", ".join(f"{k} {v:.1f} s" for k, v in result["compile"].get("phases_s", {}).items())
        lines += ["", f"{result['tokens_per_step']:,} tokens per step. Compile: first step {result['first_step_s']:.1f} s "
                  f"(XLA backend compile {result['compile'].get('backend_compile_s', 0.0):.1f} s; jax phases: {ph}); "
                  f"build (corpus, model, optimizer) {result['build_s']:.1f} s.", "",
                  f"Untraced steps (median of {len(result['timing_steps'])}): step {t['step_s'] * 1e3:.1f} ms "
                  f"(= jitted call returns {t['dispatch_s'] * 1e3:.1f} ms + device_get of the metrics "
                  f"{t['wait_s'] * 1e3:.1f} ms), {result['tokens_per_s']:,.0f} tokens/s; host-side outside the step "
                  f"(next batch + host->device) {t['data_s'] * 1e3:.1f} ms. Traced steps: "
                  + ", ".join(f"{s * 1e3:.1f}" for s in result["traced_step_s"]) + " ms."]
    lines += ["", f"Trace ({p['steps']} steps, ops from {p['op_source']}): step wall {_ms(p['step_wall_ms'])} ms, "
              f"device busy {_ms(p['device_busy_ms'])} ms ({p['busy_fraction']:.1%}), idle/gaps "
              f"{_ms(p['idle_ms'])} ms (host-side work or synchronisation), summed op time {_ms(p['op_time_ms'])} ms "
              f"(> busy when ops overlap), {p['op_events_per_step']:.0f} op events and {p['num_distinct_ops']} "
              f"distinct ops per step; HLO-mapped op time {_ms(p['hlo_mapped_ms'])} ms. Times are ms per step; "
              "share = of the step wall time."]
    for title, key in (("By component (innermost k3jax/nn module method, else optimizer, else outermost k3jax/ops function)",
                        "component"), ("By phase", "phase"), ("By HLO op kind", "kind"),
                       ("By k3jax source line (top 25)", "source"), ("By HLO module", "module")):
        rows = p.get(f"by_{key}") or []
        if not rows:
            continue
        lines += ["", f"## {title}", "", f"| {key} | ms/step | ops/step | share |", "|---|---|---|---|"]
        lines += [f"| `{r[key]}` | {_ms(r['ms_per_step'])} | {r['count_per_step']:.0f} | {r['share_of_step']:.1%} |"
                  for r in rows]
    top_ops = p["ops"][:p.get("top", 40)]
    lines += ["", f"## Top {len(top_ops)} of {p['num_distinct_ops']} ops (all of them in the .json)", "",
              "| # | kernel / op | HLO op | kind | phase | component | source | ms/step | count/step | share |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(top_ops, 1):
        kernel = r["kernel"] if len(r["kernel"]) <= 60 else r["kernel"][:57] + "..."
        lines.append(f"| {i} | `{kernel}` | `{r['hlo_op']}` | {r['kind']} | {r['phase']} | {r['component']} | "
                     f"{r['source']} | {_ms(r['ms_per_step'])} | {r['count_per_step']:.0f} | {r['share_of_step']:.1%} |")
    if p["host_events"]:
        lines += ["", "## Host events inside the traced steps (top 15, nested events overlap)", "",
                  "| event | ms/step | count/step |", "|---|---|---|"]
        lines += [f"| `{r['name'][:80]}` | {_ms(r['ms_per_step'])} | {r['count_per_step']:.0f} |"
                  for r in p["host_events"]]
    lines += ["", "Planes/lines in the trace: " + "; ".join(
        f"{x['plane']} / {x['line']} ({x['events']})" for x in p["inventory"][:40])]
    return "\n".join(lines) + "\n"


def write(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(out + ".md", "w") as f:
        f.write(render(result))


# ----------------------------------------------------------------------------------------------- main


def _define_flags():
    """Command-line flags, defined only when run as a script (tests import experiment modules together)."""
    global _CONFIG, _OUT, _TRACE_DIR, _WARMUP, _TIMED, _STEPS, _HLO, _PYTHON_TRACER, _TOP, _FROM_TRACE, _HLO_DIR
    from absl import flags  # noqa: PLC0415
    from ml_collections import config_flags  # noqa: PLC0415
    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/k3_tiny.py", "Run config.")
    _OUT = flags.DEFINE_string("out", "/tmp/profile_step", "Output prefix (<out>.json, <out>.md).")
    _TRACE_DIR = flags.DEFINE_string("trace_dir", "", "Profiler trace folder ('' = <out>_trace).")
    _WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed steps after the compiling first step.")
    _TIMED = flags.DEFINE_integer("timed", 3, "Steps timed without the profiler (medians reported).")
    _STEPS = flags.DEFINE_integer("steps", 2, "Steps captured by the profiler.")
    _HLO = flags.DEFINE_enum("hlo", "dump", ["dump", "recompile", "none"],
                             "Where the compiled HLO (op kinds, name stacks, sources) comes from: XLA's dump during "
                             "the compile (free), a second compile, or nowhere.")
    _PYTHON_TRACER = flags.DEFINE_bool("python_tracer", False, "Trace Python calls too (slows the host side).")
    _TOP = flags.DEFINE_integer("top", 40, "Rows of the per-op table.")
    _FROM_TRACE = flags.DEFINE_string("from_trace", "", "Only re-parse this trace folder/.xplane.pb and write "
                                      "<out>.json/.md (HLO from --hlo_dir).")
    _HLO_DIR = flags.DEFINE_string("hlo_dir", "", "With --from_trace: folder of XLA's HLO dump ('' = "
                                   "<from_trace>/hlo).")


def main(argv):
    del argv
    from k3jax.train.config import run_config_from_dict  # noqa: PLC0415
    if _FROM_TRACE.value:
        hlo_dir = _HLO_DIR.value or os.path.join(_FROM_TRACE.value, "hlo")
        hlo_text = read_hlo_dump(hlo_dir) if os.path.isdir(hlo_dir) else None
        import flax  # noqa: PLC0415
        import jaxlib  # noqa: PLC0415
        env = {"date": "re-parse " + datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "device": find_xplane(_FROM_TRACE.value), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
               "flax": flax.__version__}
        result = {"env": env, "profile": parse_trace(_FROM_TRACE.value, hlo_text=hlo_text, top=_TOP.value)}
    else:
        cfg = run_config_from_dict(_CONFIG.value.to_dict())
        trace_dir = _TRACE_DIR.value or _OUT.value + "_trace"
        if _HLO.value == "dump":  # before the backend starts: XLA reads XLA_FLAGS once
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={trace_dir}/hlo "
                                       "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*").strip()
        result = profile_run(cfg, warmup=_WARMUP.value, timed=_TIMED.value, steps=_STEPS.value, trace_dir=trace_dir,
                             hlo=_HLO.value, python_tracer=_PYTHON_TRACER.value, top=_TOP.value)
        result["env"] = environment(cfg)
    write(result, _OUT.value)
    print(render(result))
    print(f"wrote {_OUT.value}.json/.md", flush=True)


if __name__ == "__main__":
    _define_flags()
    from absl import app
    app.run(main)
