"""Smoke test of experiments/depth_residuals.py at a tiny setting (in-process, one seed, 1-layer models)."""
import json
import math
import os

from experiments import depth_residuals as dr


def test_tiny_sweep_writes_one_finite_row_per_variant(tmp_path):
    settings = dr.Settings(d_model=16, num_heads=2, head_dim=8, d_ff=32, seq_len=16, batch_size=2, steps=2,
                           warmup_steps=1, eval_every=1, eval_batches=1, residual_blocks=8)
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
