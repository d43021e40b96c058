"""Experiment scripts whose logic goes past a smoke run: the GPU configs' matching, profile_step's op
table on the tiny config, depth_residuals' sweep rows, qb_convergence's fixed point, k3_small_gpu's
equal-token comparison and MFU."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from experiments import depth_residuals as dr
from experiments import profile_step
from experiments import qb_convergence as Q
from experiments.configs import k3_tiny
from k3jax.models.config import model_config_from_dict
from k3jax.models.flops import matmul_params_per_token, model_flops_per_token
from k3jax.train.config import run_config_from_dict

from tests.repo import REPO


def test_gpu_configs_are_matched():
    from experiments.configs import k3_small_gpu, moe_balance_gpu, moe_balance_k3_small_gpu, transformer_small_gpu
    k3 = run_config_from_dict(k3_small_gpu.get_config())
    base = run_config_from_dict(transformer_small_gpu.get_config())
    run_config_from_dict(moe_balance_gpu.get_config())
    balance = run_config_from_dict(moe_balance_k3_small_gpu.get_config()).model
    for field in ("d_model", "num_heads", "head_dim", "dtype"):  # the balancing study's MoE is K3-small's
        assert getattr(balance, field) == getattr(k3.model, field), field
    assert (balance.moe.num_experts, balance.moe.top_k, balance.moe.d_ff) == (
        k3.model.moe.num_experts, k3.model.moe.top_k, k3.model.moe.d_ff)
    assert k3.model.layer_mixers.count("K") == 3 * k3.model.layer_mixers.count("A")
    assert (k3.model.ffn, k3.model.moe.balancing.method, k3.model.residual.kind, k3.model.dtype) == (
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


def test_tiny_config_profile_writes_table_json_and_md(tmp_path):
    d = k3_tiny.get_config().to_dict()
    d["model"].update(d_model=32, num_layers=2, mixer_pattern="KA", num_heads=2, head_dim=16, d_ff=64)
    d["model"]["moe"].update(num_experts=4, d_ff=32)
    d["model"]["residual"].update(blocks=2)
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


def test_profile_step_synthetic_documents_are_the_corpus_loaders_batches():
    """--doc_len feeds bench_train's batches: the keys, shapes and dtypes of the corpus loader's, with a new
    document (segment id, position 0) every doc_len tokens."""
    d = k3_tiny.get_config().to_dict()
    d["data"].update(seq_len=64, batch_size=2)
    cfg = run_config_from_dict(d)
    _, _, corpus_iter = profile_step.build(cfg)
    _, _, synthetic_iter = profile_step.build(cfg, doc_len=40)
    a, b = next(corpus_iter), next(synthetic_iter)
    assert {k: (np.shape(v), np.asarray(v).dtype) for k, v in a.items()} == \
        {k: (np.shape(v), np.asarray(v).dtype) for k, v in b.items()}
    np.testing.assert_array_equal(b["segment_ids"][0, 38:42], [1, 1, 2, 2])
    np.testing.assert_array_equal(b["positions"][0, 38:42], [38, 39, 0, 1])
    with pytest.raises(ValueError, match="doc_len"):
        profile_step.profile_run(cfg, warmup=0, timed=1, steps=1, trace_dir="/tmp/unused", doc_len=-1)


def test_tiny_sweep_writes_one_finite_row_per_variant(tmp_path):
    settings = dr.Settings(d_model=16, num_heads=2, head_dim=8, d_ff=32, seq_len=16, batch_size=2, steps=2,
                           warmup_steps=1, eval_every=1, eval_batches=1, residual_blocks=8,
                           scan_layers=True)  # scanned but article_block: both model paths, with diagnostics
    groups = dr.run_sweep(settings, list(dr.VARIANTS), [1], [0], workdir=str(tmp_path / "runs"), isolate=False)
    out = str(tmp_path / "results" / "depth_residuals")
    doc = dr.write_outputs(groups, out)

    rows = doc["rows"]
    assert [r["variant"] for r in rows] == list(dr.VARIANTS)
    for r in rows:
        for key in ("val_loss", "val_bpb", "tokens_per_s", "peak_memory_mib"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["variant"], key, r[key])
        # an untrained byte model is near log(vocab) nats; 2 steps cannot move it far
        assert 3.0 < r["val_loss"] < 7.0, r
    by_variant = {r["variant"]: r for r in rows}
    assert by_variant["block_attnres"]["residual_blocks"] == 2  # 8 requested, capped at 1 layer x 2 sublayers
    assert by_variant["article_block"]["residual_blocks"] == 1  # capped at 1 layer
    assert by_variant["prenorm"]["delta_vs_prenorm"] == 0.0

    for g in groups:
        run = g["runs"][0]
        assert [p["step"] for p in run["val_curve"]] == [1, 2]
        assert len(run["diagnostics"]["hidden_rms"]) == 2 and len(run["diagnostics"]["cosine"]) == 1
        if g["variant"] in ("block_attnres", "full_attnres"):
            weights = run["diagnostics"]["depth_weights"]
            assert len(weights) == 3  # 2 sublayers + the final mix
            assert all(abs(sum(row) - 1.0) < 1e-4 for row in weights)
        else:
            assert "depth_weights" not in run["diagnostics"]

    with open(out + ".json") as f:
        saved = json.load(f)
    assert saved["machine"]["cpu_count"] == os.cpu_count() and saved["machine"]["versions"]["jax"]
    table = open(out + ".md").read()
    assert sum(line.startswith(f"| {v} |") for v in dr.VARIANTS for line in table.splitlines()) == 4
    for suffix in ("val_loss", "cosine", "hidden_rms", "depth_weights"):
        assert os.path.getsize(f"{out}_{suffix}.png") > 0
    # the header says only what holds for every row: one process ran all configs (isolate=False), one seed
    assert "1 seed per cell" in table and "running maximum" in table
    assert "Settings differ" not in table and "workers shared" not in table
    groups[1]["settings"] = {**groups[1]["settings"], "scan_layers": False}
    groups[2]["workers_sharing_device"] = 4
    dr.write_outputs(groups, out)
    table = open(out + ".md").read()
    assert "**Settings differ between rows** in scan_layers " in table and "Up to 4 workers shared" in table


def test_qb_fixed_point_and_stationary_stream():
    E, k, d, n = 32, 4, 64, 4096
    key = jax.random.PRNGKey(0)
    router = Q.Router(jax.random.fold_in(key, 0), d, E, scale=1.5, popularity=1.0)
    fp = Q.fixed_point(router, jax.random.fold_in(key, 2), n, k, iters=8, resolution=False)
    exact, hist = fp["exact/zero"], fp["histogram/zero"]
    assert exact[0] > 3.0                      # the unbiased router is strongly imbalanced
    assert 0.2 < exact[1] < 0.5 * exact[0]     # one step helps a lot but is not exact
    assert exact[-1] < 0.1                     # the fixed-point iteration converges on the batch
    assert min(hist[4:]) > 2.0 * exact[-1]     # the 1000-bin histogram stalls above the exact quantile
    assert fp["per_expert_margins/zero"][-1] < exact[-1]  # per-expert cutoffs converge faster
    lo, hi = fp["admitted_at_fixed_cutoffs_min_max"]
    assert hi == fp["q"] and lo < fp["q"]      # tie group of (k+1)-th experts at r = b_j = 0 straddles q
    floor = Q.binomial_floor(n, E, k, trials=2000)
    st = Q.stream(router, jax.random.fold_in(key, 3), n, k, steps=24, warmup=8)
    assert floor < st["next_batch_max_vio"] < 0.5
    np.testing.assert_allclose(floor, 0.092, atol=0.01)


@pytest.mark.parametrize("values", [["0"], ["64", "-1"], ["1e3"], []])
def test_qb_stationary_tokens_must_be_positive_integers(values):
    assert Q._stationary_tokens(["64", "1024"]) == [64, 1024]  # noqa: SLF001
    with pytest.raises(ValueError, match="--stationary_tokens"):
        Q._stationary_tokens(values)  # noqa: SLF001


def test_k3_small_gpu_script_smoke(tmp_path):
    """The whole script at a tiny size (attention-only mixers: KDA compiles are slow on CPU and the KDA
    path is tested elsewhere; what is tested is the script); K3 stops on its wall-clock budget (counted
    from the end of its first step) after one step, and the transformer then trains exactly as many steps (equal tokens), both evaluated at that step."""
    cmd = [sys.executable, "-m", "experiments.k3_small_gpu", "--tiny", f"--out={tmp_path}/out",
           f"--workdir_root={tmp_path}/runs", f"--compilation_cache_dir={tmp_path}/cache", "--steps=3",
           "--matmul_size=64", "--matmul_reps=2", "--k3_time_budget_s=1e-6", "--baseline_time_budget_s=0",
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
    k3_model = model_config_from_dict({k: v for k, v in k3["config"].items() if k not in ("seq_len", "batch_size")})
    assert k3["flops_per_token"] == model_flops_per_token(k3_model, 128)
    assert k3["mfu"] == k3["flops_per_token"]["total"] * k3["tokens_per_s"] / res["matmul"]["flops_per_s"]
    md = open(tmp_path / "out" / "k3_small_h200.md").read()
    assert "At equal tokens (step 1" in md
    assert os.path.getsize(tmp_path / "out" / "k3_small_h200_loss.png") > 0


def test_bench_train_parses_jla_log_lines_and_builds_like_for_like_rows():
    from experiments import bench_train
    log = "\n".join(
        ["2026 INFO jla.training.trainer: compiled train step in 107.2s (device memory 17.70 GiB)"] +
        [f"2026 INFO jla.training.trainer: step {s}/40 | loss {6 - s / 10:.4f} | lr 1.000e-03 | grad 0.500 | "
         f"{tok:,} tok/s | MFU 30.0% HFU 40.0% MBU 5.0% | {ms} ms/step | skipped 0"
         for s, tok, ms in ((5, 100_000, 655), (10, 490_000, 134), (15, 480_000, 136), (20, 500_000, 131))])
    parsed = bench_train.parse_jla_log(log, warmup=5)
    assert parsed["logged_steps"] == [5, 10, 15, 20]
    assert parsed["step_ms_median"] == 134.0 and parsed["tokens_per_s"] == 490_000.0  # the window at step 5 left out
    assert parsed["compile_s"] == 107.2 and parsed["compiled_memory_gib"] == 17.7 and parsed["final_loss"] == 4.0
    lfl = bench_train.model_config("k3_small", "like_for_like", scan_layers=True, remat="full")
    k3 = bench_train.model_config("k3_small", "k3_default", scan_layers=False, remat="full")
    assert (lfl.residual.kind, lfl.moe.balancing.method, lfl.moe.balancing.alpha, lfl.remat) == (
        "prenorm", "aux_loss", 0.01, "full")
    assert (k3.residual.kind, k3.moe.balancing.method, k3.remat, k3.kda.implementation) == (
        "block_attnres", "quantile", "none", None)
    assert (lfl.d_model, lfl.num_layers, lfl.mixer_pattern, lfl.moe.num_experts, lfl.moe.d_ff) == (
        768, 8, "KKKA", 16, 1024)
    batch = bench_train.markov_batches(1, 2, 2048, 1000, 259)[0]
    np.testing.assert_array_equal(batch["segment_ids"][0, [0, 999, 1000, 2047]], [1, 1, 2, 3])
    np.testing.assert_array_equal(batch["positions"][0, [999, 1000]], [999, 0])
    assert not batch["loss_mask"][0, 999] and batch["loss_mask"][0, 1000]
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])


@pytest.mark.parametrize("shape", ["k3_small", "1b"])
def test_bench_train_jla_config_has_the_shape_of_the_k3jax_rows(shape):
    # jla's row must train the same model shape and tokens per step as the k3jax rows it is compared with.
    import tomllib
    from experiments import bench_train
    s = bench_train.SHAPES[shape]
    cfg = bench_train.model_config(shape, "like_for_like", scan_layers=False, remat="none")
    with open(s["jla_config"], "rb") as f:
        jla = tomllib.load(f)
    m = jla["model"]
    kinds = {"K": "kda", "A": "attention"}
    assert m["layer_types"] == [kinds[c] for c in cfg.mixer_pattern * (cfg.num_layers // len(cfg.mixer_pattern))]
    assert m["mlp_types"] == ["moe"] * cfg.num_layers
    assert (m["vocab_size"], m["d_model"], m["n_layers"]) == (cfg.vocab_size, cfg.d_model, cfg.num_layers)
    assert (m["attention"]["num_heads"], m["attention"]["head_dim"], m["attention"]["use_rope"]) == (
        cfg.num_heads, cfg.head_dim, cfg.attention.rope)
    la = m["linear_attention"]
    assert (la["num_k_heads"], la["head_k_dim"], la["head_v_dim"]) == (cfg.num_heads, cfg.head_dim, cfg.head_dim)
    assert (m["moe"]["num_experts"], m["moe"]["top_k"], m["moe"]["d_ff_expert"]) == (
        cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.d_ff)
    t, d = jla["train"], jla["data"]
    assert (t["seq_len"], t["micro_batch_per_replica"], d["synthetic_doc_length"]) == (
        s["seq_len"], s["batch_size"], s["doc_len"])


def _group(variant, seed_losses, m=1.0, settings=None):
    return {"variant": variant, "num_layers": 4, "token_multiplier": m, "residual_blocks": 1,
            "settings": settings or {"steps": 10}, "seeds": [s for s, _ in seed_losses], "group_wall_seconds": 1.0,
            "rss_baseline_mib": 1.0, "rss_peak_mib": 2.0, "device_peak_bytes": None,
            "runs": [{"seed": s, "val_loss": v, "val_bpb": v, "tokens_per_s": 1.0, "wall_seconds": 1.0,
                      "num_params": 10} for s, v in seed_losses]}


def test_compute_equivalent_reads_the_prenorm_multiplier_off_its_log_fit():
    a, b = 2.0, -0.2  # PreNorm: val_loss = a + b ln(m), exactly, for seed 0
    groups = [_group("prenorm", [(0, a)]), _group("prenorm", [(0, a + b * math.log(1.25))], 1.25),
              _group("prenorm", [(0, a + b * math.log(1.5))], 1.5),
              _group("block_attnres", [(0, a + b * math.log(1.4))])]
    m, extrapolated = dr.compute_equivalent(groups, 4, 0, a + b * math.log(1.4))
    assert m == pytest.approx(1.4) and not extrapolated
    m, extrapolated = dr.compute_equivalent(groups, 4, 0, a + b * math.log(2.0))
    assert m == pytest.approx(2.0) and extrapolated
    assert math.isnan(dr.compute_equivalent(groups, 4, 1, 1.9)[0])        # no PreNorm runs of seed 1
    assert math.isnan(dr.compute_equivalent(groups[:1] + groups[3:], 4, 0, 1.9)[0])  # one multiplier only
    rows = {r["label"]: r for r in dr.summary_rows(groups, [{"variant": "prenorm", "num_layers": 4, "tokens_per_s": 110.0},
                                                          {"variant": "block_attnres", "num_layers": 4,
                                                           "tokens_per_s": 100.0}])}
    assert rows["block_attnres"]["compute_equivalent"] == pytest.approx(1.4)
    assert rows["block_attnres"]["step_time_overhead"] == pytest.approx(0.1)
    assert math.isnan(rows["prenorm ×1.5 tokens"]["compute_equivalent"])
    assert rows["prenorm ×1.5 tokens"]["delta_vs_prenorm"] == pytest.approx(b * math.log(1.5))
    table = dr.markdown_table(list(rows.values()))
    assert "| block_attnres | 4 (8) |" in table and "1.40× ± 0.00" in table and "+10.0%" in table


def test_depth_sweep_scan_layers_applies_where_the_variant_has_a_scanned_form(tmp_path):
    settings = dr.Settings(scan_layers=True)
    scanned = {v: dr.run_config(settings, v, 4, 0, str(tmp_path)).model.scan_layers for v in dr.VARIANTS}
    assert scanned == {"prenorm": True, "block_attnres": True, "full_attnres": True, "article_block": False}
    assert not any(dr.run_config(dr.Settings(), v, 4, 0, str(tmp_path)).model.scan_layers for v in dr.VARIANTS)
    remat = {v: dr.run_config(dr.Settings(scan_layers=True, remat="full"), v, 4, 0, str(tmp_path)).model.remat
             for v in dr.VARIANTS}  # the unrolled article_block cannot take a remat policy (ModelConfig refuses it)
    assert remat == {"prenorm": "full", "block_attnres": "full", "full_attnres": "full", "article_block": "none"}
    # result files written before the flag existed still merge with (and are reused by) unscanned sweeps
    old = {k: v for k, v in dataclasses.asdict(dr.Settings()).items() if k not in ("scan_layers", "remat")}
    new = dataclasses.asdict(dr.Settings())
    merged = dr.merge_groups([_group("prenorm", [(0, 2.0)], settings=old), _group("prenorm", [(1, 2.1)], settings=new)])
    assert [r["seed"] for r in merged[0]["runs"]] == [0, 1]
    with pytest.raises(ValueError, match="different settings"):
        dr.merge_groups([_group("prenorm", [(0, 2.0)], settings=old),
                         _group("prenorm", [(1, 2.1)], settings=dataclasses.asdict(dr.Settings(scan_layers=True)))])


def test_merge_groups_joins_seeds_and_refuses_conflicts():
    merged = dr.merge_groups([_group("prenorm", [(1, 2.0)]), _group("block_attnres", [(0, 1.0)]),
                              _group("prenorm", [(0, 2.1)])])
    assert [g["variant"] for g in merged] == ["prenorm", "block_attnres"]
    assert merged[0]["seeds"] == [0, 1] and [r["val_loss"] for r in merged[0]["runs"]] == [2.1, 2.0]
    with pytest.raises(ValueError, match="more than one group"):
        dr.merge_groups([_group("prenorm", [(0, 2.0)]), _group("prenorm", [(0, 2.1)])])
    with pytest.raises(ValueError, match="different settings"):
        dr.merge_groups([_group("prenorm", [(0, 2.0)]), _group("prenorm", [(1, 2.1)], settings={"steps": 11})])
    assert dr.scaled_settings(dr.Settings(steps=600), 1.25).steps == 750
    with pytest.raises(ValueError, match="token_multiplier"):
        dr.scaled_settings(dr.Settings(), 0.0)


def test_merge_docs_keeps_every_sweeps_timing_and_refuses_other_machines():
    """The merge depth_gpu.sh runs for a row added later (Full AttnRes alone): both sweeps' timing rows, the
    union of seeds and variants; sweeps from different device kinds are refused."""
    def doc(groups, timing, devices=("cuda:0",), seeds=(0, 1, 2), parallel=1):
        return {"groups": groups, "timing": timing, "machine": {"devices": list(devices)},
                "sweep": {"variants": sorted({g["variant"] for g in groups}), "depths": [4], "seeds": list(seeds),
                          "parallel": parallel}}
    first = doc([_group("prenorm", [(0, 2.0)]), _group("block_attnres", [(0, 1.9)])],
                [{"variant": "prenorm", "num_layers": 4, "tokens_per_s": 100.0},
                 {"variant": "block_attnres", "num_layers": 4, "tokens_per_s": 80.0}], seeds=(0,), parallel=4)
    later = doc([_group("full_attnres", [(0, 1.95)]), _group("prenorm", [(1, 2.1)])],
                [{"variant": "full_attnres", "num_layers": 4, "tokens_per_s": 50.0},
                 {"variant": "prenorm", "num_layers": 4, "tokens_per_s": 999.0}], seeds=(0, 1), parallel=2)
    groups, timing, sweep = dr.merge_docs([first, later], ["a.json", "b.json"])
    assert [(t["variant"], t["tokens_per_s"]) for t in timing] == [("prenorm", 100.0), ("block_attnres", 80.0),
                                                                    ("full_attnres", 50.0)]
    assert sweep["seeds"] == [0, 1] and sweep["parallel"] == 4 and sweep["merged_from"] == ["a.json", "b.json"]
    assert sorted(sweep["variants"]) == ["block_attnres", "full_attnres", "prenorm"]
    assert [g["variant"] for g in groups] == ["prenorm", "block_attnres", "full_attnres"]
    rows = {r["variant"]: r for r in dr.summary_rows(groups, timing)}
    assert rows["full_attnres"]["solo_tokens_per_s"] == 50.0
    assert rows["full_attnres"]["step_time_overhead"] == pytest.approx(100.0 / 50.0 - 1.0)
    with pytest.raises(ValueError, match="one kind of machine"):
        dr.merge_docs([first, doc([_group("prenorm", [(2, 2.0)])], [], devices=("cpu:0",))], ["a", "c"])
    with pytest.raises(ValueError, match=r"--merge takes this script's result JSONs; hand.json has no \['machine'"):
        dr.merge_docs([first, {"rows": [], "groups": []}], ["a.json", "hand.json"])  # a hand-assembled page's JSON


@pytest.mark.parametrize("flag, error", [("--seeds=a", "--seeds takes int values, got 'a'"),
                                         ("--depths=0", "--depths values must be >= 1"),
                                         ("--token_multipliers=abc", "--token_multipliers takes float values"),
                                         ("--steps=0", "flag --steps=0: 0 is not a positive integer"),
                                         ("--timing_steps=-1", "flag --timing_steps=-1: -1 is not a non-negative")])
def test_depth_sweep_flags_fail_fast_naming_the_flag(tmp_path, flag, error):
    result = subprocess.run([sys.executable, "-m", "experiments.depth_residuals", flag,
                             f"--workdir={tmp_path}/w", f"--out={tmp_path}/o"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and error in result.stderr, result.stderr[-2000:]
    assert not os.path.exists(f"{tmp_path}/w"), "the sweep must not start"


def test_compare_profiles_groups_ops_by_kind_of_work(tmp_path):
    """Rows go to the first matching category; the table has one line per category and system; a trace
    without step markers is divided by unmarked_steps."""
    from experiments import compare_profiles as C
    from experiments.harness import OpEvent, summarize_trace

    def profile(rows, wall):
        return {"profile": {"ops": [dict(kernel=k, kind=kind, source=src, component="", ms_per_step=ms)
                                    for k, kind, src, ms in rows], "step_wall_ms": wall, "device_busy_ms": wall},
                "env": {"date": "d"}}
    ours = profile([("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "", "", 10.0),
                    ("body_mosaic_gpu_kernel", "", "", 4.0), ("kda_intra_fwd_mgpu_mosaic_gpu_kernel", "", "", 3.0),
                    ("input_reduce_fusion", "reduce",
                     "k3jax/models/lm.py:183 LanguageModel._scan_stack.<locals>.sublayer", 2.0),
                    ("loop_select_fusion", "gather", "k3jax/ops/token_dispatch.py:108 permute", 1.0),
                    ("loop_add_fusion", "elementwise", "k3jax/nn/kda.py:114 KimiDeltaAttention._split_qkv", 5.0)], 30.0)
    peer = profile([("kernel_dkv_mosaic_gpu_kernel", "", "", 2.0), ("vg_intra_mosaic_gpu_kernel", "", "", 3.0),
                    ("input_add_reduce_fusion", "reduce", "norm.py:28 rms_norm", 2.0),
                    ("loop_multiply_select_fusion", "dynamic-slice", "linear_attention.py:86 _mamba_gate", 1.5)], 9.0)
    paths = []
    for name, p in (("ours", ours), ("peer", peer)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(p, f)
    result = C.compare(paths, ["k3jax", "jla"])
    ours_c, peer_c = (s["categories"] for s in result["systems"])
    assert ours_c == {"softmax attention": 10.0, "MoE grouped GEMM": 4.0, "KDA kernels (chunked scan)": 3.0,
                      "norms": 2.0, "MoE routing, permute, combine": 1.0, C.OTHER: 5.0}
    assert peer_c == {"softmax attention": 2.0, "KDA kernels (chunked scan)": 3.0, "norms": 2.0, C.OTHER: 1.5}
    md = C.render(result)
    assert "| softmax attention | 10.0 | 2.0 | -8.0 |" in md and "| step wall | 30.0 | 9.0 | -21.0 |" in md
    with pytest.raises(ValueError, match="one name each"):
        C.compare(paths, ["k3jax"])

    events = [OpEvent("k", "op", "m", 0.0, 1e6, "line"), OpEvent("k", "op", "m", 3e6, 1e6, "line")]
    trace = {"ops": events, "op_source": "device planes", "steps": [], "host_events": [], "inventory": []}
    two = summarize_trace(trace, unmarked_steps=2)
    assert two["steps"] == 2 and two["step_wall_ms"] == pytest.approx(2.0)
    assert two["ops"][0]["ms_per_step"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="unmarked_steps"):
        summarize_trace(trace, unmarked_steps=0)


def test_scan_equivalence_configs_and_verdict():
    """run_config gives each layout the same model but its scan / remat, and summarize's verdict is
    |scanned − unrolled| at the same seed against the unrolled runs' seed spread."""
    from experiments import scan_equivalence as S
    kw = dict(steps=10, num_layers=8, batch_size=2, seq_len=64, dtype="bfloat16", workdir="/tmp/x")
    unrolled, scanned = (S.run_config("k3_default", lay, 3, **kw) for lay in ("unrolled", "scanned"))
    assert (unrolled.model.scan_layers, unrolled.model.remat) == (False, "none")
    assert (scanned.model.scan_layers, scanned.model.remat) == (True, "full")
    assert unrolled.model.residual.kind == "block_attnres" and unrolled.seed == scanned.seed == 3
    assert S.run_config("like_for_like", "scanned", 0, **kw).model.residual.kind == "prenorm"
    assert unrolled.workdir != scanned.workdir
    with pytest.raises(ValueError, match="layout"):
        S.run_config("k3_default", "remat", 0, **kw)
    def runs(shift):
        return [dict(row="r", layout=lay, seed=seed, val_loss=v + (shift if lay == "scanned" else 0.0), train_loss=v)
                for seed, v in enumerate([2.0, 2.2, 2.4]) for lay in ("unrolled", "scanned")]
    val, train = S.summarize(runs(0.01))
    assert val["within_noise"] and val["unrolled_std"] == pytest.approx(0.2) == val["seed_noise"]
    assert val["paired_diffs"] == pytest.approx([0.01] * 3) and val["mean_diff"] == pytest.approx(0.01)
    assert train["mean_diff"] == 0.0 and train["within_noise"]
    val, _ = S.summarize(runs(-0.5))
    assert not val["within_noise"] and val["mean_diff"] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="seeds"):
        S.summarize(runs(0.0)[:2])
    page = S.render(dict(environment=dict(date="d", device="cpu"), shape=dict(steps=10, num_layers=8, batch_size=2,
                                                                              seq_len=64),
                         dtype="bfloat16", seeds=[0, 1, 2], tiny=False, rows=S.summarize(runs(-0.5))))
    assert ("| r | val_loss | 3 | 2.2000 ± 0.2000 | 1.7000 ± 0.2000 | -0.5000, -0.5000, -0.5000 | -0.5000 ± 0.0000 | "
            "0.2000 | **no** |") in page
    # the seed noise pools both layouts' spreads: a small spread in one layout alone does not decide
    lopsided = [dict(r, val_loss=2.2 + 0.001 * r["seed"]) if r["layout"] == "unrolled" else r for r in runs(0.0)]
    val, _ = S.summarize(lopsided)
    assert val["unrolled_std"] == pytest.approx(0.001) and val["within_noise"]
    assert val["seed_noise"] == pytest.approx(((0.001 ** 2 + 0.2 ** 2) / 2) ** 0.5)


def test_bench_train_tiny_row_records_compile_phases_and_renders():
    """A k3jax row at the tiny shape: finite step times and loss, jax's compile phases recorded (trace,
    lowering, backend compile, which together do not exceed the first step), and the page shows them."""
    from experiments import bench_train
    row = bench_train.run_k3jax("tiny", "k3_default", steps=2, warmup=1, scan_layers=True, remat="full")
    assert row["steps_timed"] == 2 and all(np.isfinite(row["step_ms"])) and np.isfinite(row["final_loss"])
    phases = row["compile_phases_s"]
    assert {"jaxpr_trace_duration", "jaxpr_to_mlir_module_duration", "backend_compile_duration"} <= set(phases)
    assert 0 < sum(phases.values()) <= row["compile_s"]
    page = bench_train.render({"rows": [row], "env": {"date": "d", "device": "cpu"},
                               "flags": dict(shape="tiny", warmup=1, steps=2, scan_layers=True, remat="full")})
    jax_s = phases["jaxpr_trace_duration"] + phases["jaxpr_to_mlir_module_duration"]
    assert f"{row['compile_s']:.1f} ({jax_s:.1f}, {phases['backend_compile_duration']:.1f})" in page
