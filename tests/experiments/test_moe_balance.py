"""experiments/moe_balance.py machinery: executable reuse across seeds, merging result files."""
import os
import subprocess
import sys

import jax
import pytest

from experiments import moe_balance
from experiments.configs.common import section
from k3jax.models.config import AttentionConfig, ModelConfig, MoEConfig, ResidualConfig
from k3jax.train import trainer as trainer_lib
from k3jax.train.config import DataConfig, TrainConfig
from k3jax.train.optimizer import make_optimizer
from tests.repo import REPO

_BACKEND_COMPILES = []


def _on_duration(name, duration, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
        _BACKEND_COMPILES.append(duration)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _tiny_base() -> dict:
    model = ModelConfig(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64, mixer_pattern="A",
                        attention=AttentionConfig(rope=True), ffn="moe",
                        moe=MoEConfig(num_experts=4, top_k=2, d_ff=32), residual=ResidualConfig(kind="prenorm"),
                        dtype="float32")
    data = DataConfig(source="python-stdlib", seq_len=32, batch_size=2)
    train = TrainConfig(steps=2, learning_rate=1e-3, warmup_steps=1, eval_every=2, eval_batches=1,
                        checkpoint_every=2, log_every=1, sample_tokens=0)
    return {"workdir": "unused", "seed": 0, "model": section(model).to_dict(), "data": section(data).to_dict(),
            "train": section(train).to_dict()}


def _backend_compiles_of_run(cfg) -> int:
    before = len(_BACKEND_COMPILES)
    trainer_lib.train(cfg, show_progress=False)
    return len(_BACKEND_COMPILES) - before


def test_second_seed_reuses_the_first_seeds_executables(tmp_path):
    base = _tiny_base()
    kw = dict(num_experts=4, top_k=2, steps=2, workdir_root=str(tmp_path))
    compiles = []
    for seed in (0, 1):  # as in main(): one train() call per run
        compiles.append(_backend_compiles_of_run(moe_balance.run_config(base, "quantile_exact", seed, **kw)))
    first, second = compiles
    assert first >= 2  # train step + eval step (the counter sees compiles)
    assert second == 0
    # Without the shared optax object (make_optimizer's cache cleared) the optimizer's graph definition
    # differs and the train step re-traces and compiles again (the cause the cache fixes; persistent
    # cache off so a hit cannot hide it).
    make_optimizer.cache_clear()
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        third = _backend_compiles_of_run(moe_balance.run_config(base, "quantile_exact", 2, **kw))
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert third >= 1


def test_run_config_rejects_unknown_method(tmp_path):
    with pytest.raises(ValueError, match="method"):
        moe_balance.run_config(_tiny_base(), "quantile_bogus", 0, num_experts=4, top_k=2, steps=2,
                               workdir_root=str(tmp_path))


def _row(seed: int, val_loss: float) -> dict:
    return {"seed": seed, "val_loss": val_loss, "val_bpb": 1.0, "max_vio_after_warmup": 0.1 * (seed + 1),
            "max_vio_global": 0.2, "cv_after_warmup": 0.3, "dropped_fraction_after_warmup": 0.0,
            "dead_experts_after_warmup": 0.0, "diverted_fraction_after_warmup": 0.0, "entropy_after_warmup": 0.9,
            "tokens_per_s": 1000.0, "wall_s": 1.0, "curve_steps": [1, 2], "max_vio_curve": [1.0, 0.5],
            "compile": {"backend_compile_s": 2.0 if seed == 0 else 0.0}}


def _meta(device: str, visible: str, methods: list[str], skipped: list, elapsed: float) -> dict:
    return {"date": "2026-12-01", "device": device, "jax": jax.__version__, "steps": 2, "num_experts": 4,
            "top_k": 2, "seeds": ["0", "1"], "warmup_frac": 0.25, "time_budget_s": 500.0, "skipped": skipped,
            "methods": methods, "pid": 11 if visible == "0" else 12, "cuda_visible_devices": visible,
            "elapsed_s": elapsed, "grouped_matmul": "jla"}


def test_merge_concatenates_rows_and_lists_every_process(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    moe_balance.write_results({"none": [_row(0, 3.0), _row(1, 3.2)], "quantile_exact": [_row(0, 2.5)]},
                              _meta("NVIDIA H200 x1 (h)", "0", ["none", "quantile_exact"],
                                    [["quantile_exact", 1]], 400.0), a)
    moe_balance.write_results({"aux_loss": [_row(1, 2.9), _row(0, 2.7)]},
                              _meta("NVIDIA H200 x1 (h)", "1", ["aux_loss"], [], 300.0), b)
    results, meta = moe_balance.merge_results([a + ".json", b + ".json"])
    assert list(results) == ["none", "quantile_exact", "aux_loss"]
    assert [r["seed"] for r in results["aux_loss"]] == [0, 1]  # sorted by seed
    assert [r["val_loss"] for r in results["none"]] == [3.0, 3.2]
    assert meta["elapsed_s"] == 400.0 and meta["device"] == "NVIDIA H200 x1 (h)"
    assert meta["skipped"] == [["quantile_exact", 1]]
    assert [p["cuda_visible_devices"] for p in meta["processes"]] == ["0", "1"]
    out = str(tmp_path / "merged")
    moe_balance.write_results(results, meta, out)
    md = open(out + ".md").read()
    assert "Merged from 2 processes" in md
    assert "CUDA_VISIBLE_DEVICES=0, pid 11, methods none,quantile_exact, 400 s" in md
    assert "CUDA_VISIBLE_DEVICES=1, pid 12, methods aux_loss, 300 s" in md
    assert "| aux_loss | 2 | 2.8000 ± 0.1000 |" in md
    assert "| none | 2 | 3.1000 ± 0.1000 |" in md
    # A merge of merges keeps the original process list.
    c = str(tmp_path / "c")
    moe_balance.write_results({"loss_free": [_row(0, 2.0)]}, _meta("NVIDIA H200 x1 (g)", "0", ["loss_free"], [], 10.0), c)
    _, meta2 = moe_balance.merge_results([out + ".json", c + ".json"])
    assert [p["pid"] for p in meta2["processes"]] == [11, 12, 11]
    assert meta2["device"] == "NVIDIA H200 x1 (h) + NVIDIA H200 x1 (g)"


def test_merge_rejects_duplicates_and_mismatched_runs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    moe_balance.write_results({"none": [_row(0, 3.0)]}, _meta("d", "0", ["none"], [], 1.0), a)
    moe_balance.write_results({"none": [_row(0, 3.1)]}, _meta("d", "1", ["none"], [], 1.0), b)
    with pytest.raises(ValueError, match="none seed 0"):
        moe_balance.merge_results([a + ".json", b + ".json"])
    # a re-run (e.g. after a fix) replaces the earlier row only when asked
    results, meta = moe_balance.merge_results([a + ".json", b + ".json"], later_wins=True)
    assert [r["val_loss"] for r in results["none"]] == [3.1]
    assert meta["replaced"] == [["none", 0, b + ".json"]]
    moe_balance.write_results(results, meta, a + "_merged")
    assert "Rows replaced by a later file (--merge_later_wins): none seed 0 by b.json." in open(a + "_merged.md").read()
    other = _meta("d", "1", ["aux_loss"], [], 1.0)
    other["steps"] = 3
    moe_balance.write_results({"aux_loss": [_row(0, 3.1)]}, other, b)
    with pytest.raises(ValueError, match="steps"):
        moe_balance.merge_results([a + ".json", b + ".json"])
    with pytest.raises(ValueError, match="at least 2"):
        moe_balance.merge_results([a + ".json"])


def test_methods_table_rows_build_valid_configs(tmp_path):
    base = _tiny_base()
    assert len(moe_balance.METHODS) == 13
    for method in moe_balance.METHODS:
        cfg = moe_balance.run_config(base, method, 1, num_experts=4, top_k=2, steps=2, workdir_root=str(tmp_path))
        assert cfg.seed == 1 and cfg.model.ffn == "moe" and cfg.workdir.endswith(f"{method}/seed1")
    two = moe_balance.run_config(base, "quantile_histogram_2pass", 0, num_experts=4, top_k=2, steps=2,
                                 workdir_root=str(tmp_path)).model.moe.balancing
    assert (two.method, two.quantile_estimator, two.histogram_passes) == ("quantile", "histogram", 2)
    ema = moe_balance.run_config(base, "quantile_exact_ema0.9", 0, num_experts=4, top_k=2, steps=2,
                                 workdir_root=str(tmp_path)).model.moe.balancing
    assert (ema.method, ema.quantile_estimator, ema.ema) == ("quantile", "exact", 0.9)
    it4 = moe_balance.run_config(base, "quantile_exact_iter4", 0, num_experts=4, top_k=2, steps=2,
                                 workdir_root=str(tmp_path)).model.moe.balancing
    assert (it4.method, it4.quantile_estimator, it4.quantile_iterations) == ("quantile", "exact", 4)
    lf = moe_balance.run_config(base, "loss_free_1e-2", 0, num_experts=4, top_k=2, steps=2,
                                workdir_root=str(tmp_path)).model.moe.balancing
    assert (lf.method, lf.gamma) == ("loss_free", 1e-2)


def test_sampling_floor_is_the_binomial_maxvio_of_the_batch():
    base = {"data": {"batch_size": 4, "seq_len": 256}}
    floor = moe_balance.sampling_floor(base, 16, 2)
    assert floor["tokens_per_batch"] == 1024
    # 2048 slots over 16 experts: mean 128, std ~11; E[max] of 16 such cells is ~1.8 std above the mean
    assert 0.1 < floor["max_vio"] < 0.25
    assert moe_balance.sampling_floor({"data": {"batch_size": 64, "seq_len": 256}}, 16, 2)["max_vio"] < floor["max_vio"] / 3


def test_import_defines_no_flags_and_budget_estimate_drops_compile_time():
    # in a fresh interpreter: under xdist another test module may define same-named flags in this one
    code = ("from absl import flags\nimport experiments.moe_balance\n"
            "assert not {'merge', 'compilation_cache_dir', 'time_budget_s'} & set(flags.FLAGS), 'flags at import'")
    repo = REPO
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]
    walls = {"a": [52.0], "b": [60.0]}
    repeat = {"a": [52.0 - 22.0]}
    assert moe_balance.expected_run_seconds("a", walls, repeat) == 30.0  # seed 1 reuses the executables
    assert moe_balance.expected_run_seconds("b", walls, repeat) == 60.0  # no compile-free record yet
    assert moe_balance.expected_run_seconds("c", walls, repeat) == 60.0  # a first run compiles
