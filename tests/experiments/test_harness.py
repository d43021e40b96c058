"""experiments/harness.py: time_call's call pattern, the input recipe and metric, records and writers,
trace and HLO parsing, compile counters."""
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import harness

from tests.repo import REPO


def test_time_call_back_to_back_groups_reuse_one_input_set_each():
    """Compile + warm-up + timed calls each with fresh inputs, then stream_reps groups of stream_calls
    calls, one fresh input set a group; without groups no stream_ms."""
    calls, made = [], []

    def fn(x):
        calls.append(x)
        return x + 1

    def make_args(i):
        made.append(i)
        return (jnp.full((4,), float(i)),)

    r = harness.time_call(fn, make_args, iters=3, warmup=2, stream_calls=4, stream_reps=5)
    assert len(calls) == 1 + 2 + 3 + 4 * 5, len(calls)
    assert made == [0, 1, 2, 1000, 1001, 1002] + list(range(2000, 2005)), made
    assert all(calls[6 + 4 * g + j] is calls[6 + 4 * g] for g in range(5) for j in range(4))
    assert r["stream_ms"] > 0 and (r["stream_calls"], r["stream_reps"], r["iters"]) == (4, 5, 3), r
    assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    assert "stream_ms" not in harness.time_call(fn, make_args, iters=1, warmup=0, stream_calls=0, stream_reps=5)
    with pytest.raises(ValueError, match="iters"):
        harness.time_call(fn, make_args, iters=0, warmup=0)


def test_kda_inputs_follow_the_anchors_recipe():
    q, k, v, g, beta, do = harness.make_kda_inputs(jax.random.key(0), 2, 64, 3, 16, jnp.bfloat16, V=8)
    assert (q.shape, k.shape, g.shape, v.shape, do.shape, beta.shape) == (
        (2, 64, 3, 16), (2, 64, 3, 16), (2, 64, 3, 16), (2, 64, 3, 8), (2, 64, 3, 8), (2, 64, 3))
    assert g.dtype == jnp.float32 and q.dtype == k.dtype == v.dtype == beta.dtype == jnp.bfloat16
    np.testing.assert_allclose(jnp.linalg.norm(k.astype(jnp.float32), axis=-1), 1.0, atol=1e-2)
    assert -5.0 < float(g.min()) and float(g.max()) < 0.0 and 0.0 < float(beta.min()) and float(beta.max()) < 1.0
    assert abs(float(jnp.std(q.astype(jnp.float32))) - 1.0) < 0.05


def test_named_shapes_parse_and_bad_shapes_raise():
    assert harness.parse_kda_shape("8x4096x16") == (8, 4096, 16, 128)
    assert harness.parse_kda_shape("1x64x1x16") == (1, 64, 1, 16)
    assert harness.KDA_GPU_SHAPES[0] == "8x4096x16x128" and len(harness.KDA_GPU_SHAPES) == 4
    for bad in ("1x64x1", "1x0x1x16", "axbxcxd"):
        with pytest.raises(ValueError, match="shape"):
            harness.parse_kda_shape(bad)


def test_packed_documents_as_fla_cu_seqlens():
    ids = harness.packed_segment_ids_np(3, 1024, 16, seed=1)
    np.testing.assert_array_equal(np.asarray(harness.packed_segment_ids(3, 1024, 16, seed=1)), ids)
    cu = harness.cu_seqlens(ids)
    assert cu[0] == 0 and cu[-1] == ids.size and all(b > a for a, b in zip(cu, cu[1:]))
    assert {1024, 2048} <= set(cu)                      # every row starts a document
    flat = ids.reshape(-1)
    for a, b in zip(cu, cu[1:]):                        # each span is one whole document
        assert len(set(flat[a:b])) == 1 and (b == flat.size or b % 1024 == 0 or flat[b] != flat[b - 1])
    assert len(cu) - 1 == sum(len(set(row)) for row in ids)
    # equal ids across a row boundary are still two documents; a change of id mid-row starts one
    assert harness.cu_seqlens(np.array([[1, 1, 2], [2, 2, 2]])) == [0, 2, 3, 6]
    with pytest.raises(ValueError, match="segment_ids"):
        harness.cu_seqlens(np.zeros((4,), np.int32))
    with pytest.raises(ValueError, match="docs_per_row"):
        harness.packed_segment_ids_np(1, 64, 0)


def test_bench_kda_fla_scripts_compile_dense_and_packed():
    # in a subprocess: the script defines absl flags at import
    code = textwrap.dedent("""
        from experiments import bench_kda, harness
        for script in (bench_kda.FLA_SCRIPT, bench_kda.FLA_PROFILE_SCRIPT):
            compile(script, "<fla>", "exec")
        assert bench_kda.fla_cu_seqlens(["2x256x1x16"], 1) == {}
        cu = bench_kda.fla_cu_seqlens(["2x256x1x16"], 4)["2x256x1x16"]
        assert cu == harness.cu_seqlens(harness.packed_segment_ids_np(2, 256, 4)) and 256 in cu
        assert "cu_seqlens" in bench_kda.FLA_INPUTS and "B * T" in bench_kda.FLA_INPUTS
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_rms_ratio_is_relative_and_flags_non_finite_outputs():
    ref = np.array([3.0, 4.0])
    assert harness.rms_ratio(ref, ref) == 0.0
    assert harness.rms_ratio(ref * 1.1, ref) == pytest.approx(0.1)
    assert harness.rms_ratio(jnp.asarray(ref, jnp.bfloat16), ref) == 0.0
    assert np.isnan(harness.rms_ratio(np.array([np.inf, 0.0]), ref))
    with pytest.raises(ValueError, match="shapes"):
        harness.rms_ratio(ref, ref[:1])


def test_package_versions_records_installed_distributions_only():
    assert harness.package_versions(("jax", "no-such-distribution-k3jax")) == {"jax": jax.__version__}


def test_environment_record_and_writers(tmp_path):
    env = harness.environment(run="x")
    assert env["jax"] == jax.__version__ and env["backend"] == "cpu" and env["run"] == "x" and "date" in env
    line = harness.environment_line(env)
    assert env["date"] in line and f"jax {jax.__version__}" in line
    table = harness.markdown_table(["a", "b"], [[1, 0.12345], ["x", "y"]])
    assert table == ["| a | b |", "|---|---|", "| 1 | 0.123 |", "| x | y |"]
    out = str(tmp_path / "sub" / "r")
    harness.write_results(out, {"environment": env, "rows": [1]}, "# r\n")
    assert json.load(open(out + ".json"))["rows"] == [1] and open(out + ".md").read() == "# r\n"
    with pytest.raises(ValueError, match="out"):
        harness.write_results("", {})


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
            with jax.profiler.StepTraceAnnotation(harness.STEP_NAME, step_num=i):
                jax.block_until_ready(fn(a, b, c))
    p = harness.parse_trace(str(tmp_path), hlo_text=hlo_text)
    assert p["steps"] == 3
    top = p["ops"][0]
    assert top["kind"] == "dot", p["ops"][:3]
    assert top["count_per_step"] == 1.0
    assert "test_harness.py" in top["source"] and "_matmul_and_add" in top["source"]
    adds = [r for r in p["ops"] if r["kind"] == "elementwise"]
    assert adds and top["ms_per_step"] > 5 * max(r["ms_per_step"] for r in adds)
    assert all(r["ms_per_step"] > 0 for r in p["ops"])
    assert 0 < p["device_busy_ms"] <= p["step_wall_ms"]
    assert p["by_kind"][0]["kind"] == "dot"


def test_self_times_subtract_nested_events_on_the_same_line_only():
    ev = harness.OpEvent
    ops = [ev("while", "while", "m", 0, 100, "t0"), ev("body", "f.1", "m", 10, 30, "t0"),
           ev("body2", "f.2", "m", 50, 20, "t0"), ev("other", "f.3", "m", 20, 50, "t1")]
    assert harness.self_times(ops) == [50, 30, 20, 50]
    assert harness._union_ns([(0, 100), (20, 170), (200, 210)]) == 180  # noqa: SLF001


def test_compile_counter_sees_persistent_cache_hit(tmp_path):
    """Two separately traced functions with the same HLO: the second loads the first's executable."""
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from experiments.harness import CompileCounter, enable_compilation_cache
        enable_compilation_cache({str(tmp_path)!r})
        counter = CompileCounter()
        def make():
            def f(x):
                return jnp.tanh(x @ x.T).sum()
            return jax.jit(f)
        x = jnp.ones((16, 16))
        make()(x).block_until_ready()
        first = counter.reset()
        make()(x).block_until_ready()
        second = counter.reset()
        assert first["cache_misses"] >= 1 and first["cache_hits"] == 0, first
        assert second["cache_hits"] == 1 and second["cache_misses"] == 0, second
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_measure_matmul_rate():
    from experiments.harness import measure_matmul_rate
    r = measure_matmul_rate(64, 3)
    assert len(r["all_s"]) == 3 and r["median_s"] == float(np.median(r["all_s"]))
    assert r["flops_per_s"] == pytest.approx(2 * 64 ** 3 / r["median_s"])
    with pytest.raises(ValueError, match="n="):
        measure_matmul_rate(0, 3)


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
    p = harness.parse_trace(str(path), hlo_text=_HLO)
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
