"""Which device ops take the time in one real train step: a profiler trace of the trainer's own step, parsed.

  python -m experiments.profile_step --config=experiments/configs/k3_small_gpu.py --out=$OUT/k3_small_step_h200 \
      --trace_dir=$OUT/k3_small_step_trace --warmup=0 --timed=2 --steps=2   # one H200, ~3 min with compile
  python -m experiments.profile_step --config=experiments/configs/k3_tiny.py --out=/tmp/k3_tiny_step   # CPU
  python -m experiments.profile_step --from_trace=/tmp/k3_tiny_step_trace --out=/tmp/again   # re-parse only
  python -m experiments.profile_step --from_trace=<jla output_dir>/profile --hlo_dir=<its XLA dump> --trace_steps=2 \
      --out=$OUT/jla_1b_step   # a peer's trace: jla's profiler window (train.profile_steps=2), no step markers
  python -m experiments.profile_step --layers --config=experiments/configs/k3_small_gpu.py --timed=10 --warmup=2 \
      --out=$OUT/k3_small_layers_h200   # per-sublayer fwd+bwd time (shares of the whole model's loss + grads)

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

import dataclasses
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.harness import (CompileCounter, STEP_NAME, environment as _environment, find_xplane,  # noqa: F401
                                 median_ms, parse_trace, read_hlo_dump, write_results)


# ----------------------------------------------------------------------------------------------- the run


def build(cfg, doc_len: int = 0):
    """Model, optimizer and training batch iterator exactly as `k3jax.train.trainer.train` makes them
    (fresh: no checkpoint restored). `doc_len` > 0: instead of the config's corpus, bench_train's synthetic
    Markov batches with documents of `doc_len` tokens (what bench_train and jla's trainer run)."""
    import itertools  # noqa: PLC0415
    from flax import nnx  # noqa: PLC0415
    from k3jax.data.corpus import load_corpus  # noqa: PLC0415
    from k3jax.data.pipeline import make_train_loader  # noqa: PLC0415
    from k3jax.models.lm import LanguageModel  # noqa: PLC0415
    from k3jax.train.optimizer import make_optimizer  # noqa: PLC0415
    model = LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    optimizer = nnx.Optimizer(model, make_optimizer(cfg.train), wrt=nnx.Param)
    if doc_len > 0:
        from experiments.bench_train import markov_batches  # noqa: PLC0415
        data_iter = itertools.cycle(markov_batches(8, cfg.data.batch_size, cfg.data.seq_len, doc_len,
                                                   cfg.model.vocab_size, seed=cfg.seed))
    else:
        train_corpus = load_corpus(cfg.data.source, "train", cache_dir=cfg.data.cache_dir or None)
        data_iter = make_train_loader(train_corpus.tokens, batch_size=cfg.data.batch_size,
                                      seq_len=cfg.data.seq_len, seed=cfg.seed)
    return model, optimizer, data_iter


def _next_batch(data_iter):
    return {k: jnp.asarray(v) for k, v in next(data_iter).items()}  # as the trainer's loop


def profile_run(cfg, *, warmup: int, timed: int, steps: int, trace_dir: str, hlo: str = "dump",
                python_tracer: bool = False, top: int = 40, doc_len: int = 0) -> dict:
    """Compile, warm up, time and trace the trainer's step for `cfg` (see the module docstring).

    Args:
      hlo: "dump" (read `<trace_dir>/hlo`, which `main` asks XLA to fill during the compile), "recompile"
        (`train_step.lower(...).compile()` once more after the trace: a second full compile unless the
        persistent cache hits) or "none".
      doc_len: see `build` (0: the config's corpus).
    Raises:
      ValueError: steps < 1, timed < 1, warmup < 0, doc_len < 0 or an unknown `hlo`.
    """
    from experiments.harness import CompileCounter  # noqa: PLC0415
    from k3jax.train.step import bind_train_step, train_step  # noqa: PLC0415
    if steps < 1 or timed < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1, timed >= 1, warmup >= 0, got {steps=}, {timed=}, {warmup=}")
    if hlo not in ("dump", "recompile", "none"):
        raise ValueError(f"hlo must be 'dump', 'recompile' or 'none', got {hlo=}")
    if doc_len < 0:
        raise ValueError(f"doc_len must be >= 0 (0: the config's corpus), got {doc_len=}")
    counter = CompileCounter()
    t0 = time.perf_counter()
    model, optimizer, data_iter = build(cfg, doc_len)
    build_s = time.perf_counter() - t0
    from k3jax.train.trainer import loss_chunk_size  # noqa: PLC0415
    chunk = loss_chunk_size(cfg)
    step = bind_train_step(model, optimizer, loss_chunk_size=chunk)  # the trainer's step
    batch = _next_batch(data_iter)
    counter.reset()
    t0 = time.perf_counter()
    jax.device_get(step(batch))
    first_step_s = time.perf_counter() - t0
    compile_stats = counter.reset()
    for _ in range(warmup):
        jax.device_get(step(_next_batch(data_iter)))
    rows = []
    for _ in range(timed):
        t0 = time.perf_counter()
        batch = _next_batch(data_iter)
        t1 = time.perf_counter()
        metrics = step(batch)
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
                jax.device_get(step(batch))
            traced.append(time.perf_counter() - t0)
    recompiled = {}
    if hlo == "dump":
        hlo_text = read_hlo_dump(os.path.join(trace_dir, "hlo"), keep_only=True)
    elif hlo == "recompile":
        counter.reset()
        hlo_text = train_step.lower(model, optimizer, _next_batch(data_iter), loss_chunk_size=chunk).compile().as_text()
        recompiled = counter.reset()
    else:
        hlo_text = None
    profile = parse_trace(trace_dir, hlo_text=hlo_text, top=top)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    data = (f"synthetic Markov tokens, documents of {doc_len} tokens (bench_train's)" if doc_len
            else f"the config's corpus ({cfg.data.source})")
    return {"data": data, "build_s": build_s, "first_step_s": first_step_s, "compile": compile_stats,
            "timing_median": timing, "timing_steps": rows, "tokens_per_step": B * T, "tokens_per_s": B * T / timing["step_s"],
            "traced_step_s": traced, "trace_dir": trace_dir, "hlo": hlo, "hlo_found": hlo_text is not None,
            "hlo_recompile": recompiled, "profile": profile}


def environment(cfg) -> dict:
    """harness.environment plus the run config."""
    return _environment(config=dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg)


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
        lines += ["", f"{result['tokens_per_step']:,} tokens per step ({result.get('data', 'the corpus')}). "
                  f"Compile: first step {result['first_step_s']:.1f} s "
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
    """<out>.json (everything) and <out>.md (`render`)."""
    write_results(out, result, render(result))


# ----------------------------------------------------------------------------------------------- --layers


def _median_ms(fn, *args, iters: int, warmup: int) -> tuple[float, float]:
    """(median ms of `iters` calls after `warmup`, seconds of the first call: compilation + one run)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    return median_ms(fn, *args, iters=iters, warmup=warmup), compile_s


def _time_module(module, x, call, *, iters: int, warmup: int):
    """Median ms of value_and_grad of sum(call(module, x) * cot) w.r.t. (params, x)."""
    from flax import nnx  # noqa: PLC0415
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    cot = jax.random.normal(jax.random.PRNGKey(1), x.shape, jnp.float32).astype(x.dtype)

    def loss(params, x):
        m = nnx.merge(graphdef, params, rest)
        y = call(m, x)
        return jnp.sum(y.astype(jnp.float32) * cot.astype(jnp.float32))

    return _median_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x, iters=iters, warmup=warmup)


def profile_layers(cfg, *, iters: int, warmup: int) -> tuple[dict, list[dict]]:
    """--layers: forward+backward time of each distinct sublayer (built as `LanguageModel` builds it) and of
    the whole LM loss at the config's batch x seq_len; rows with ms each, ms/step (x count) and share of
    the whole-model time. Returns (environment, rows)."""
    from flax import nnx  # noqa: PLC0415
    from experiments.harness import median_ms  # noqa: PLC0415
    from k3jax.models import lm as lm_lib  # noqa: PLC0415
    from k3jax.train import step as step_lib  # noqa: PLC0415
    timing = dict(iters=iters, warmup=warmup)
    m = cfg.model
    B, T = cfg.data.batch_size, cfg.data.seq_len
    dtype = lm_lib._dtype(m.dtype)  # noqa: SLF001 -- same dtype rule as the model
    x = (jax.random.normal(jax.random.PRNGKey(0), (B, T, m.d_model)) * 0.5).astype(dtype)
    segment_ids = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    pattern = (m.mixer_pattern * m.num_layers)[: m.num_layers]
    rows = []
    for letter in sorted(set(pattern)):
        mixer = lm_lib._make_mixer(m, letter, nnx.Rngs(0))  # noqa: SLF001
        ms, c = _time_module(mixer, x, lambda mod, x: mod(x, segment_ids=segment_ids, positions=positions), **timing)
        rows.append(dict(sublayer=f"mixer {letter} ({type(mixer).__name__})", count=pattern.count(letter),
                         ms=ms, compile_s=c))
        print(json.dumps(rows[-1]), flush=True)
    ffn = lm_lib._make_ffn(m, nnx.Rngs(0))  # noqa: SLF001
    if m.ffn == "mlp":
        call = lambda mod, x: mod(x)  # noqa: E731
    else:
        call = lambda mod, x: mod(x, segment_ids=segment_ids, train=True)[0]  # noqa: E731
    ms, c = _time_module(ffn, x, call, **timing)
    rows.append(dict(sublayer=f"ffn ({type(ffn).__name__})", count=m.num_layers, ms=ms, compile_s=c))
    print(json.dumps(rows[-1]), flush=True)

    model = lm_lib.LanguageModel(m, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T + 1), 0, m.vocab_size, jnp.int32)
    batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], segment_ids=segment_ids, positions=positions,
                 loss_mask=jnp.ones((B, T), bool))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def lm_loss(params):  # the train step's loss: cross-entropy + balancing loss terms
        return step_lib._forward_loss(nnx.merge(graphdef, params, rest), batch, True)[0]  # noqa: SLF001

    ms, c = _median_ms(jax.jit(jax.value_and_grad(lm_loss)), params, **timing)
    whole = dict(sublayer="whole model (loss + grads)", count=1, ms=ms, compile_s=c)
    print(json.dumps(whole), flush=True)
    for r in rows:
        r["ms_per_step"] = r["ms"] * r["count"]
        r["share"] = r["ms_per_step"] / ms
    rows.append(dict(whole, ms_per_step=ms, share=1.0))
    env = _environment(tokens_per_step=B * T, model=dataclasses.asdict(m) if dataclasses.is_dataclass(m) else str(m))
    return env, rows


def render_layers(env: dict, rows: list[dict]) -> str:
    """The markdown table of `profile_layers`."""
    lines = [f"# Step-time breakdown ({env['date']}, {env['device']})", "",
             f"jax {env['jax']}, flax {env['flax']}; `experiments/profile_step.py --layers`; {env['tokens_per_step']:,} tokens per call; forward+backward "
             f"medians. ms/step = ms x sublayers of that type; share = of the whole model's time.", "",
             "| sublayer | count | ms each | ms/step | share | compile s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sublayer']} | {r['count']} | {r['ms']:.2f} | {r['ms_per_step']:.2f} | "
                     f"{100 * r['share']:.0f}% | {r['compile_s']:.1f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- main


def _define_flags():
    """Command-line flags, defined only when run as a script (tests import experiment modules together)."""
    global _LAYERS, _CONFIG, _OUT, _TRACE_DIR, _WARMUP, _TIMED, _STEPS, _HLO, _PYTHON_TRACER, _TOP, _FROM_TRACE, _HLO_DIR
    global _TRACE_STEPS, _DOC_LEN
    from absl import flags  # noqa: PLC0415
    from experiments.configs.common import define_config_file  # noqa: PLC0415
    _CONFIG = define_config_file("config", "experiments/configs/k3_tiny.py", "Run config.")
    _LAYERS = flags.DEFINE_bool("layers", False, "Instead of the trace: forward+backward time of each sublayer type "
                                "and of the whole LM loss (median of --timed calls after --warmup).")
    _OUT = flags.DEFINE_string("out", "/tmp/k3jax_profile_step/profile", "Output prefix (<out>.json, <out>.md).")
    _TRACE_DIR = flags.DEFINE_string("trace_dir", "", "Profiler trace folder ('' = <out>_trace).")
    _WARMUP = flags.DEFINE_integer("warmup", 1, "Untimed steps after the compiling first step.")
    _TIMED = flags.DEFINE_integer("timed", 3, "Steps timed without the profiler (medians reported).")
    _STEPS = flags.DEFINE_integer("steps", 2, "Steps captured by the profiler.")
    _HLO = flags.DEFINE_enum("hlo", "dump", ["dump", "recompile", "none"],
                             "Where the compiled HLO (op kinds, name stacks, sources) comes from: XLA's dump during "
                             "the compile (free), a second compile, or nowhere.")
    _PYTHON_TRACER = flags.DEFINE_bool("python_tracer", False, "Trace Python calls too (slows the host side).")
    _TOP = flags.DEFINE_integer("top", 40, "Rows of the per-op table.")
    _DOC_LEN = flags.DEFINE_integer("doc_len", 0, "Instead of the config's corpus: bench_train's synthetic Markov "
                                    "batches with documents of this many tokens (1000: as bench_train and jla's "
                                    "trainer), so that the profile compares with theirs. 0: the corpus.")
    _FROM_TRACE = flags.DEFINE_string("from_trace", "", "Only re-parse this trace folder/.xplane.pb and write "
                                      "<out>.json/.md (HLO from --hlo_dir).")
    _HLO_DIR = flags.DEFINE_string("hlo_dir", "", "With --from_trace: folder of XLA's HLO dump ('' = "
                                   "<from_trace>/hlo).")
    _TRACE_STEPS = flags.DEFINE_integer("trace_steps", 1, "With --from_trace: how many steps a trace without "
                                        "'train' step markers spans (jla's profiler window: train.profile_steps).")


def main(argv):
    del argv
    from k3jax.train.config import run_config_from_dict  # noqa: PLC0415
    if _LAYERS.value:
        env, rows = profile_layers(run_config_from_dict(_CONFIG.value.to_dict()), iters=_TIMED.value,
                                   warmup=_WARMUP.value)
        write_results(_OUT.value, dict(environment=env, rows=rows), render_layers(env, rows))
        print(render_layers(env, rows))
        return
    if _FROM_TRACE.value:
        hlo_dir = _HLO_DIR.value or os.path.join(_FROM_TRACE.value, "hlo")
        hlo_text = read_hlo_dump(hlo_dir) if os.path.isdir(hlo_dir) else None
        import flax  # noqa: PLC0415
        import jaxlib  # noqa: PLC0415
        env = {"date": "re-parse " + datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "device": find_xplane(_FROM_TRACE.value), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
               "flax": flax.__version__}
        result = {"env": env, "profile": parse_trace(_FROM_TRACE.value, hlo_text=hlo_text, top=_TOP.value,
                                                      unmarked_steps=_TRACE_STEPS.value)}
    else:
        cfg = run_config_from_dict(_CONFIG.value.to_dict())
        trace_dir = _TRACE_DIR.value or _OUT.value + "_trace"
        if _HLO.value == "dump":  # before the backend starts: XLA reads XLA_FLAGS once
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={trace_dir}/hlo "
                                       "--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*").strip()
            jax.config.update("jax_enable_compilation_cache", False)  # a persistent-cache hit would dump nothing
        result = profile_run(cfg, warmup=_WARMUP.value, timed=_TIMED.value, steps=_STEPS.value, trace_dir=trace_dir,
                             hlo=_HLO.value, python_tracer=_PYTHON_TRACER.value, top=_TOP.value,
                             doc_len=_DOC_LEN.value)
        result["env"] = environment(cfg)
    write(result, _OUT.value)
    print(render(result))
    print(f"wrote {_OUT.value}.json/.md", flush=True)


if __name__ == "__main__":
    _define_flags()
    from absl import app
    app.run(main)
