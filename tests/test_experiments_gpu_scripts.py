"""Model FLOPs per token, the GPU configs and the GPU experiment scripts (CPU smoke runs at tiny sizes)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from flax import nnx

from k3jax.models.config import ModelConfig
from k3jax.models.flops import matmul_params_per_token, model_flops_per_token
from k3jax.models.lm import LanguageModel
from k3jax.train.config import run_config_from_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_HYBRID = ModelConfig(d_model=8, num_layers=2, num_heads=2, head_dim=4, mixer_pattern="KA", ffn="moe",
                          moe_num_experts=4, moe_top_k=2, moe_d_ff=6)


def test_flops_hand_count():
    # KDA layer: q,k,v,o 4*8*8 = 256; decay gate 8*4 + 4*8 = 64; output gate 64; beta 8*2 = 16 -> 400.
    # attention layer: qkv + o = 4*8*8 = 256. MoE layer: router 8*4 + top-2 * 3*8*6 = 32 + 288 = 320.
    # head: 8 * 320 (vocab 259 padded to 320).
    params = matmul_params_per_token(TINY_HYBRID)
    assert params == {"attention": 256, "kda": 400, "ffn": 640, "head": 2560, "total": 3856}
    flops = model_flops_per_token(TINY_HYBRID, 32)
    assert flops["matmul"] == 6 * 3856
    assert flops["attention"] == 12 * 1 * 2 * 4 * 32              # 12 L H Q T
    assert flops["kda"] == 3 * 1 * 2 * (32 * (6 * 4 + 4 * 4) + 6 * 4 * 4)   # chunk = min(64, T) = 32
    assert flops["total"] == 6 * 3856 + 3072 + 8256


@pytest.mark.parametrize("cfg", [
    ModelConfig(d_model=16, num_layers=2, num_heads=2, head_dim=8, mixer_pattern="A", d_ff=24),
    ModelConfig(d_model=16, num_layers=2, num_heads=2, head_dim=8, mixer_pattern="KA", ffn="moe",
                moe_num_experts=4, moe_top_k=2, moe_d_ff=12, moe_num_shared_experts=1),
], ids=["dense", "hybrid_moe"])
def test_flops_params_match_the_model(cfg):
    """Active matmul params from the formula == the instantiated model's matmul weights (routed experts
    scaled by top_k / E), so the formula tracks the modules."""
    model = nnx.eval_shape(lambda: LanguageModel(cfg, rngs=nnx.Rngs(0)))
    total = 0.0
    for names, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        p = variable.get_value()  # a ShapeDtypeStruct: no parameters are materialised
        if names[-1] == "kernel" and "embed" not in names:
            total += int(np.prod(p.shape))
        elif names[-1] in ("router", "shared_gate", "shared_up", "shared_down"):
            total += int(np.prod(p.shape))
        elif names[-1] in ("w_gate", "w_up", "w_down"):
            total += int(np.prod(p.shape)) * cfg.moe_top_k / cfg.moe_num_experts
    assert total == matmul_params_per_token(cfg)["total"]


def test_flops_rejects_bad_seq_len():
    with pytest.raises(ValueError, match="seq_len"):
        model_flops_per_token(TINY_HYBRID, 0)


def test_gpu_configs_are_matched():
    from experiments.configs import k3_small_gpu, moe_balance_gpu, transformer_small_gpu
    k3 = run_config_from_dict(k3_small_gpu.get_config())
    base = run_config_from_dict(transformer_small_gpu.get_config())
    run_config_from_dict(moe_balance_gpu.get_config())
    assert k3.model.layer_mixers.count("K") == 3 * k3.model.layer_mixers.count("A")
    assert (k3.model.ffn, k3.model.moe_balancing, k3.model.residual, k3.model.dtype) == (
        "moe", "quantile", "block_attnres", "bfloat16")
    assert base.model.layer_mixers == ("A",) * base.model.num_layers and base.model.ffn == "mlp"
    for field in ("d_model", "num_layers", "num_heads", "head_dim", "dtype"):
        assert getattr(k3.model, field) == getattr(base.model, field), field
    assert k3.data == base.data and k3.train == base.train
    n_k3 = matmul_params_per_token(k3.model)["total"]
    n_base = matmul_params_per_token(base.model)["total"]
    assert abs(n_k3 - n_base) / n_k3 < 0.005, (n_k3, n_base)
    tokens = k3.data.batch_size * k3.data.seq_len
    assert 64 * 1024 <= tokens <= 256 * 1024


_MOE_BALANCE_CHECKS = """
import json, os, sys
from experiments import moe_balance
assert moe_balance.run_order(["a", "b"], [0, 1], "seed_major") == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
assert moe_balance.run_order(["a", "b"], [0, 1], "method_major") == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
walls = {"a": [30.0, 5.0], "b": [40.0]}
assert moe_balance.expected_run_seconds("a", walls) == 5.0       # cached executables
assert moe_balance.expected_run_seconds("c", walls) == 40.0      # a first run compiles
assert moe_balance.expected_run_seconds("c", {}) == 0.0
run = {"curve_steps": [10, 20], "max_vio_curve": [1.0, 0.1], "val_loss": 2.5, "max_vio_after_warmup": 0.1,
       "max_vio_global": 0.05, "cv_after_warmup": 0.2, "dropped_fraction_after_warmup": 0.0,
       "dead_experts_after_warmup": 0.0, "diverted_fraction_after_warmup": 0.0, "tokens_per_s": 1000.0,
       "compile": {"backend_compile_s": 12.5}}
meta = {"date": "d", "device": "cpu", "num_experts": 4, "top_k": 2, "steps": 20, "seeds": ["0", "1"],
        "warmup_frac": 0.25, "skipped": [("b", 1)], "time_budget_s": 100.0}
stem = sys.argv[1]
moe_balance._write({"a": [run, dict(run, val_loss=2.7, compile={"backend_compile_s": 0.5})]}, meta, stem)
md = open(stem + ".md").read()
assert "| a | 2 | 2.6000 \u00b1 0.1000 | 0.100 \u00b1 0.000 |" in md and "12.5 / 0.5" in md, md
assert "b seed 1" in md
assert json.load(open(stem + ".json"))["results"]["a"][1]["val_loss"] == 2.7
assert os.path.getsize(stem + ".png") > 0
"""


def test_moe_balance_run_order_budget_and_outputs(tmp_path):
    """Run order, budget estimate and the md/json/png of moe_balance, in a subprocess: experiment scripts
    define absl flags at import (moe_balance and depth_residuals both define --seeds), so importing both
    into one pytest worker raises DuplicateFlagError."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _MOE_BALANCE_CHECKS, str(tmp_path / "mb")], capture_output=True,
                          text=True, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_compile_counter_sees_persistent_cache_hit(tmp_path):
    """Two separately traced functions with the same HLO: the second loads the first's executable."""
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from experiments.runtime import CompileCounter, enable_compilation_cache
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
    from experiments.runtime import measure_matmul_rate
    r = measure_matmul_rate(64, 3)
    assert len(r["all_s"]) == 3 and r["median_s"] == float(np.median(r["all_s"]))
    assert r["flops_per_s"] == pytest.approx(2 * 64 ** 3 / r["median_s"])
    with pytest.raises(ValueError, match="n="):
        measure_matmul_rate(0, 3)


def test_k3_small_gpu_script_smoke(tmp_path):
    """The whole script at a tiny size (attention-only mixers: KDA compiles are slow on CPU and the KDA
    path is tested elsewhere; what is tested is the script); K3 stops on its wall-clock budget after one step, and the
    transformer then trains exactly as many steps (equal tokens), both evaluated at that step."""
    cmd = [sys.executable, "-m", "experiments.k3_small_gpu", "--tiny", f"--out={tmp_path}/out",
           f"--workdir_root={tmp_path}/runs", f"--compilation_cache_dir={tmp_path}/cache", "--steps=3",
           "--matmul_size=64", "--matmul_reps=2", "--k3_time_budget_s=0.001", "--baseline_time_budget_s=0",
           "--k3_config.model.num_layers=2", "--k3_config.model.mixer_pattern=A",
           "--baseline_config.model.num_layers=2"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.load(open(tmp_path / "out" / "k3_small_h200.json"))
    k3, base = res["models"]["k3_small"], res["models"]["transformer"]
    assert k3["steps"] == 1 and base["steps"] == 1 and k3["stopped_early"] and base["stopped_early"]
    assert set(k3["val"]) == set(base["val"]) == {"1"}
    assert np.isfinite(k3["val"]["1"]["val_bpb"]) and np.isfinite(base["val"]["1"]["val_bpb"])
    assert k3["tokens"] == base["tokens"] == 2 * 128
    k3_model = ModelConfig(**{k: v for k, v in k3["config"].items() if k not in ("seq_len", "batch_size")})
    assert k3["flops_per_token"] == model_flops_per_token(k3_model, 128)
    assert k3["mfu"] == k3["flops_per_token"]["total"] * k3["tokens_per_s"] / res["matmul"]["flops_per_s"]
    md = open(tmp_path / "out" / "k3_small_h200.md").read()
    assert "At equal tokens (step 1" in md
    assert os.path.getsize(tmp_path / "out" / "k3_small_h200_loss.png") > 0
