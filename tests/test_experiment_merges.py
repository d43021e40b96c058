"""Merging result files of separate processes: moe_balance --merge refuses runs of different base
configs; bench_kda --from_json describes the merged rows (not its own flags) and refuses duplicates."""
import json
import subprocess
import sys

import jax
import pytest

from experiments import moe_balance


def _row(seed: int, val_loss: float) -> dict:
    return {"seed": seed, "val_loss": val_loss, "max_vio_after_warmup": 0.5, "max_vio_global": 0.4,
            "cv_after_warmup": 0.2, "dropped_fraction_after_warmup": 0.0, "dead_experts_after_warmup": 0.0,
            "diverted_fraction_after_warmup": 0.0, "tokens_per_s": 1000.0, "wall_s": 1.0, "curve_steps": [1, 2],
            "max_vio_curve": [1.0, 0.5], "compile": {"backend_compile_s": 1.0}}


def _meta(device: str, visible: str, methods: list[str], skipped: list, elapsed: float) -> dict:
    return {"date": "2026-12-01", "device": device, "jax": jax.__version__, "steps": 2, "num_experts": 4,
            "top_k": 2, "seeds": ["0"], "warmup_frac": 0.25, "time_budget_s": 0.0, "skipped": skipped,
            "methods": methods, "pid": 1, "cuda_visible_devices": visible, "elapsed_s": elapsed,
            "grouped_matmul": "blocked"}


def test_moe_balance_merge_rejects_different_base_configs(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    meta_a = dict(_meta("d", "0", ["none"], [], 1.0), base_config={"model": {"d_model": 32, "ffn": "moe"}})
    meta_b = dict(_meta("d", "1", ["aux_loss"], [], 1.0), base_config={"model": {"d_model": 64, "ffn": "moe"}})
    moe_balance.write_results({"none": [_row(0, 3.0)]}, meta_a, a)
    moe_balance.write_results({"aux_loss": [_row(0, 3.1)]}, meta_b, b)
    with pytest.raises(ValueError, match=r"base_config differs .* at model\.d_model"):
        moe_balance.merge_results([a + ".json", b + ".json"])
    # A field the older file lacks (added to the config later) matches only at its default.
    meta_b["base_config"] = {"model": {"d_model": 32, "ffn": "moe", "moe_quantile_iterations": 4}}
    moe_balance.write_results({"aux_loss": [_row(0, 3.1)]}, meta_b, b)
    with pytest.raises(ValueError, match=r"at model\.moe_quantile_iterations"):
        moe_balance.merge_results([a + ".json", b + ".json"])
    meta_b["base_config"] = {"model": {"d_model": 32, "ffn": "moe", "moe_quantile_iterations": 1}}
    moe_balance.write_results({"aux_loss": [_row(0, 3.1)]}, meta_b, b)
    results, meta = moe_balance.merge_results([a + ".json", b + ".json"])
    assert list(results) == ["none", "aux_loss"]
    out = str(tmp_path / "merged")
    moe_balance.write_results(results, meta, out)
    title = open(out + ".md").read().splitlines()[0]
    assert "2 processes on d, CUDA_VISIBLE_DEVICES 0 / 1" in title, title


def _bench_kda(*args, cwd):
    return subprocess.run([sys.executable, "-m", "experiments.bench_kda", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_bench_kda_from_json_header_and_duplicates(tmp_path):
    repo = __file__.rsplit("/tests/", 1)[0]
    env = dict(date="2026-12-01T00:00:00+00:00", platform="p", cpu_count=2, backend="cpu", device="cpu",
               python="3.12", jax="0.11.2", jaxlib="0.11.2", numpy="2")
    row = dict(implementation="chunked", mode="fwd", B=1, T=64, H=1, K=16, V=16, dtype="float32", chunk_size=64,
               median_ms=1.0, min_ms=0.9, max_ms=1.1, iters=5, warmup=1, compile_s=0.1)
    (tmp_path / "a.json").write_text(json.dumps(dict(environment=env, rows=[row])))
    fla = dict(row, implementation="fla", median_ms=0.5, min_ms=float("nan"), max_ms=float("nan"), iters="do_bench")
    (tmp_path / "a_fla.jsonl").write_text(json.dumps(fla) + "\n")
    r = _bench_kda(f"--from_json={tmp_path / 'a.json'},{tmp_path / 'a_fla.jsonl'}", f"--out={tmp_path / 'm'}",
                   cwd=repo)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "m.md").read_text()
    assert "float32 q/k/v/beta" in md and "median of 5 calls" in md and "after 1 warm-up calls" in md, md
    assert "Merged (`--from_json`) from `a.json`, `a_fla.jsonl`" in md
    assert "| 1×64×1×16 | fla | fwd | 0.50 | — | — |" in md            # do_bench rows have no min/max
    assert "device-bound" not in md and "back-to-back ms: median" not in md   # no row has back-to-back times
    # A jla row with a back-to-back time next to one without: the device-bound table shows no ratio
    # (never one to the other peer alone).
    jla = dict(row, implementation="jla", median_ms=2.0)
    (tmp_path / "c.json").write_text(json.dumps(dict(environment=env, rows=[
        dict(row, implementation="pallas", stream_ms=0.8), jla])))
    r = _bench_kda(f"--from_json={tmp_path / 'c.json'},{tmp_path / 'a_fla.jsonl'}", f"--out={tmp_path / 'c'}",
                   cwd=repo)
    assert r.returncode == 0, r.stderr[-2000:]
    wall, device = [line for line in (tmp_path / "c.md").read_text().splitlines()
                    if line.startswith("| 1×64×1 | fwd |")]
    assert wall.split("|")[7].strip() == "2.00" and device.split("|")[7].strip() == "—", (wall, device)
    r = _bench_kda(f"--from_json={tmp_path / 'a.json'},{tmp_path / 'a.json'}", "--out=", cwd=repo)
    assert r.returncode != 0 and "two timing rows" in r.stderr, r.stderr[-2000:]
    # A re-run merged after the first: its row replaces the first file's, other rows stay.
    (tmp_path / "b.json").write_text(json.dumps(dict(environment=dict(env, date="2026-12-02T00:00:00+00:00"),
                                                     rows=[dict(row, median_ms=0.25)])))
    r = _bench_kda(f"--from_json={tmp_path / 'a.json'},{tmp_path / 'a_fla.jsonl'},{tmp_path / 'b.json'}",
                   "--from_json_later_wins", f"--out={tmp_path / 'w'}", cwd=repo)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "w.md").read_text()
    assert "| 1×64×1×16 | chunked | fwd | 0.25 |" in md and "| chunked | fwd | 1.00 |" not in md, md
    assert "| 1×64×1×16 | fla | fwd | 0.50 |" in md and md.startswith("# KDA timings (2026-12-02"), md
    sources = {r["implementation"]: r["source"] for r in json.loads((tmp_path / "w.json").read_text())["rows"]}
    assert sources == {"chunked": "b.json", "fla": "a_fla.jsonl"}


def test_moe_balance_finds_used_run_directories(tmp_path):
    plan = moe_balance.run_order(["none", "aux_loss"], [0, 1], "seed_major")
    assert moe_balance.used_workdirs(str(tmp_path), plan) == []
    (tmp_path / "aux_loss" / "seed1").mkdir(parents=True)
    assert moe_balance.used_workdirs(str(tmp_path), plan) == []          # empty directory: a fresh run
    (tmp_path / "aux_loss" / "seed1" / "metrics.jsonl").write_text("{}\n")
    assert moe_balance.used_workdirs(str(tmp_path), plan) == [str(tmp_path / "aux_loss" / "seed1")]


def test_bench_kda_rejects_flag_typos_before_timing(tmp_path):
    repo = __file__.rsplit("/tests/", 1)[0]
    for flag, message in (("--modes=fwd,bwd", "--modes"), ("--implementations=chunkd", "--implementations"),
                          ("--shapes=1x64x1", "--shapes"), ("--declared_lower_bound=-7", "--declared_lower_bound"),
                          ("--declared_lower_bound=unbounded", "--declared_lower_bound"),
                          ("--stream_calls=-1", "--stream_calls"), ("--iters=0", "--iters")):
        r = _bench_kda(flag, "--out=", cwd=repo)
        assert r.returncode != 0 and message in r.stderr, (flag, r.stderr[-1000:])
