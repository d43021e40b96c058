"""experiments/profile_step.py: the trace of the trainer's real step is parsed into a per-op table."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp

from experiments import profile_step
from experiments.configs import k3_tiny
from k3jax.train.config import run_config_from_dict


def _matmul_and_add(a, b, c):
    return a @ b, c + 1.0  # a 512^3 GEMM next to an 8-element add


def test_parse_trace_finds_the_dominant_matmul_and_its_source(tmp_path):
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (512, 512), jnp.float32)
    b = jax.random.normal(kb, (512, 512), jnp.float32)
    c = jnp.arange(8, dtype=jnp.float32)
    fn = jax.jit(_matmul_and_add)
    hlo_text = fn.lower(a, b, c).compile().as_text()
    jax.block_until_ready(fn(a, b, c))
    with jax.profiler.trace(str(tmp_path)):
        jax.block_until_ready(fn(a, b, c))  # outside the step windows: must not be counted
        for i in range(3):
            with jax.profiler.StepTraceAnnotation(profile_step.STEP_NAME, step_num=i):
                jax.block_until_ready(fn(a, b, c))
    p = profile_step.parse_trace(str(tmp_path), hlo_text=hlo_text)
    assert p["steps"] == 3
    top = p["ops"][0]
    assert top["kind"] == "dot", p["ops"][:3]
    assert top["count_per_step"] == 1.0
    assert "test_profile_step.py" in top["source"] and "_matmul_and_add" in top["source"]
    adds = [r for r in p["ops"] if r["kind"] == "elementwise"]
    assert adds and top["ms_per_step"] > 5 * max(r["ms_per_step"] for r in adds)
    assert all(r["ms_per_step"] > 0 for r in p["ops"])
    assert 0 < p["device_busy_ms"] <= p["step_wall_ms"]
    assert p["by_kind"][0]["kind"] == "dot"


def test_self_times_subtract_nested_events_on_the_same_line_only():
    ev = profile_step.OpEvent
    ops = [ev("while", "while", "m", 0, 100, "t0"), ev("body", "f.1", "m", 10, 30, "t0"),
           ev("body2", "f.2", "m", 50, 20, "t0"), ev("other", "f.3", "m", 20, 50, "t1")]
    assert profile_step.self_times(ops) == [50, 30, 20, 50]
    assert profile_step._union_ns([(0, 100), (20, 170), (200, 210)]) == 180  # noqa: SLF001


def test_tiny_config_profile_writes_table_json_and_md(tmp_path):
    d = k3_tiny.get_config().to_dict()
    d["model"].update(d_model=32, num_layers=2, mixer_pattern="KA", num_heads=2, head_dim=16, d_ff=64,
                      moe_num_experts=4, moe_d_ff=32, residual_blocks=2)
    d["data"].update(seq_len=64, batch_size=2)
    cfg = run_config_from_dict(d)
    result = profile_step.profile_run(cfg, warmup=0, timed=1, steps=2, trace_dir=str(tmp_path / "trace"),
                                      hlo="recompile")
    result["env"] = profile_step.environment(cfg)
    p = result["profile"]
    assert result["hlo_found"] and p["steps"] == 2
    assert p["ops"] and all(r["ms_per_step"] > 0 and r["count_per_step"] > 0 for r in p["ops"])
    names = " ".join(r["kernel"] for r in p["ops"])
    assert "dot" in names or "fusion" in names, names
    kinds = {r["kind"] for r in p["by_kind"]}
    assert {"dot", "sort"} <= kinds, kinds  # the matmuls and QB's exact quantile
    components = " ".join(r["component"] for r in p["by_component"])
    for module in ("nn/kda.py", "nn/moe.py", "nn/attention.py"):
        assert module in components, components
    phases = {r["phase"] for r in p["by_phase"]}
    assert {"forward", "backward", "optimizer"} <= phases, phases
    assert 0 < p["device_busy_ms"] <= p["step_wall_ms"]
    assert result["timing_median"]["step_s"] > 0 and result["compile"]["backend_compile_s"] > 0
    out = str(tmp_path / "tiny")
    profile_step.write(result, out)
    with open(out + ".json") as f:
        saved = json.load(f)
    assert saved["profile"]["ops"][0]["kernel"] == p["ops"][0]["kernel"]
    with open(out + ".md") as f:
        md = f.read()
    assert "## Top" in md and p["ops"][0]["kernel"] in md and "device busy" in md


def test_import_defines_no_flags():
    code = ("from absl import flags\nimport experiments.profile_step\n"
            "assert not {'out', 'trace_dir', 'steps', 'hlo'} & set(flags.FLAGS), 'flags at import'")
    subprocess.run([sys.executable, "-c", code], check=True)
