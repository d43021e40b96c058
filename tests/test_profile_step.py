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


_GPU_XSPACE = """
planes {
  id: 1 name: "/host:CPU"
  lines { id: 1 name: "main" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 0 duration_ps: 10000000 }
    events { metadata_id: 1 offset_ps: 20000000 duration_ps: 10000000 }
  }
  event_metadata { key: 1 value { id: 1 name: "train" } }
}
planes {
  id: 2 name: "/device:GPU:0"
  lines { id: 1 name: "Stream #13(Kernel)" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 1000000 duration_ps: 4000000 stats { metadata_id: 1 str_value: "fusion.1" } }
    events { metadata_id: 2 offset_ps: 3000000 duration_ps: 4000000 stats { metadata_id: 1 str_value: "custom-call.3" } }
    events { metadata_id: 3 offset_ps: 21000000 duration_ps: 1000000 }
    events { metadata_id: 1 offset_ps: 50000000 duration_ps: 2000000 stats { metadata_id: 1 str_value: "fusion.1" } }
  }
  lines { id: 2 name: "XLA Ops" timestamp_ns: 1000
    events { metadata_id: 1 offset_ps: 1000000 duration_ps: 4000000 stats { metadata_id: 1 str_value: "fusion.1" } }
  }
  event_metadata { key: 1 value { id: 1 name: "loop_exponential_fusion" } }
  event_metadata { key: 2 value { id: 2 name: "sm90_xmma_gemm_bf16" } }
  event_metadata { key: 3 value { id: 3 name: "input_reduce_fusion_2" } }
  stat_metadata { key: 1 value { id: 1 name: "hlo_op" } }
}
"""

_HLO = """HloModule jit_f, is_scheduled=true

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  ROOT %exponential.0 = f32[4]{0} exponential(%param_0), metadata={op_name="jit(f)/transpose(jvp())/exp"}
}

%fused_computation.2 (param_0.1: f32[4]) -> f32[] {
  %param_0.1 = f32[4]{0} parameter(0)
  %constant.0 = f32[] constant(0)
  ROOT %reduce.0 = f32[] reduce(%param_0.1, %constant.0), dimensions={0}, to_apply=%add
}

ENTRY %main.9 (a: f32[4], b: bf16[8,8]) -> f32[] {
  %a = f32[4]{0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  %fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, metadata={op_name="jit(f)/transpose(jvp())/exp"}
  %custom-call.3 = bf16[8,8]{1,0} custom-call(%b, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/jvp()/dot_general"}
  ROOT %input_reduce_fusion.2 = f32[] fusion(%fusion.1), kind=kInput, calls=%fused_computation.2, metadata={op_name="jit(f)/jvp()/reduce_sum"}
}
"""


def test_gpu_trace_kernels_on_streams_inside_steps_mapped_to_hlo(tmp_path):
    """A GPU-shaped XSpace: kernels on a stream line count, the derived "XLA Ops" line does not, a kernel
    after the last step is outside the window, and a kernel without an hlo_op stat maps by its name."""
    path = tmp_path / "gpu.xplane.pb"
    path.write_bytes(jax.profiler.ProfileData.text_proto_to_serialized_xspace(_GPU_XSPACE))
    p = profile_step.parse_trace(str(path), hlo_text=_HLO)
    assert p["op_source"] == "device planes" and p["steps"] == 2 and p["ops_windowed_to_steps"]
    rows = {r["kernel"]: r for r in p["ops"]}
    assert set(rows) == {"loop_exponential_fusion", "sm90_xmma_gemm_bf16", "input_reduce_fusion_2"}
    assert rows["loop_exponential_fusion"]["count_per_step"] == 0.5  # the one at 50 us is after the steps
    assert rows["loop_exponential_fusion"]["ms_per_step"] == 0.002  # 4 us over 2 steps
    assert (rows["loop_exponential_fusion"]["kind"], rows["loop_exponential_fusion"]["phase"]) == ("elementwise",
                                                                                                    "backward")
    assert rows["sm90_xmma_gemm_bf16"]["kind"] == "custom-call:__cublas$gemm"
    assert rows["sm90_xmma_gemm_bf16"]["phase"] == "forward"
    assert rows["input_reduce_fusion_2"]["kind"] == "reduce"
    assert p["step_wall_ms"] == 0.01  # two 10 us steps, per step
    assert abs(p["device_busy_ms"] - 0.0035) < 1e-12  # [1, 7) us and [21, 22) us, union over 2 steps
    assert abs(p["op_time_ms"] - 0.0045) < 1e-12
