"""Results logic of the scripts: bench_kda's accuracy rows, --from_json merges (header from the rows,
duplicates refused, later wins), flag checks and --profile tables; moe_balance's merge, run order and
outputs. Scripts define absl flags at import, so bench_kda runs in subprocesses."""
import json
import os
import subprocess
import sys

import jax
import pytest

from experiments import moe_balance

from tests.repo import REPO


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
    meta_b["base_config"] = {"model": {"d_model": 32, "ffn": "moe", "moe": {"balancing": {"quantile_iterations": 4}}}}
    moe_balance.write_results({"aux_loss": [_row(0, 3.1)]}, meta_b, b)
    with pytest.raises(ValueError, match=r"at model\.moe\.balancing\.quantile_iterations"):
        moe_balance.merge_results([a + ".json", b + ".json"])
    meta_b["base_config"] = {"model": {"d_model": 32, "ffn": "moe", "moe": {"balancing": {"quantile_iterations": 1}}}}
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
    repo = REPO
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
    # dense and packed rows: never one side-by-side table
    (tmp_path / "p.json").write_text(json.dumps(dict(environment=env, rows=[
        dict(row, implementation="pallas", docs_per_row=2, docs_mean=2.0)])))
    r = _bench_kda(f"--from_json={tmp_path / 'a.json'},{tmp_path / 'p.json'}", "--out=", cwd=repo)
    assert r.returncode != 0 and "different --docs_per_row" in r.stderr, r.stderr[-2000:]
    r = _bench_kda(f"--from_json={tmp_path / 'p.json'}", f"--out={tmp_path / 'p'}", cwd=repo)
    assert r.returncode == 0 and "Packed rows: --docs_per_row=2" in (tmp_path / "p.md").read_text(), r.stderr[-2000:]
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


def test_bench_kda_floor_only_with_measured_rates(tmp_path):
    # The floor columns use the H200's measured rates: an H100 run (the device machines often lend
    # one) gets "—", not a floor from another card's rates.
    row = dict(implementation="pallas", mode="fwd", B=1, T=64, H=1, K=16, V=16, dtype="bfloat16", chunk_size=64,
               median_ms=1.0, min_ms=0.9, max_ms=1.1, iters=5, warmup=1, compile_s=0.1)
    tables = {}
    for card in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA GH200 480GB"):
        env = dict(date="2026-12-06T00:00:00+00:00", platform="p", cpu_count=2, backend="gpu", device=card,
                   python="3.12", jax="0.11.2", jaxlib="0.11.2", numpy="2")
        (tmp_path / f"{card[7:11]}.json").write_text(json.dumps(dict(environment=env, rows=[
            dict(row, B=2 if "H100" in card else 1), dict(row, implementation="jla", B=2 if "H100" in card else 1)])))
    for name, files, shapes in [("H200", ["H200"], "1x64x1x16"), ("H100", ["H100"], "2x64x1x16"),
                                ("GH200", ["GH20"], "1x64x1x16"),       # another card: no H200 rates
                                ("mixed", ["H200", "H100"], "1x64x1x16,2x64x1x16")]:   # an H200 and an H100 run
        r = _bench_kda("--from_json=" + ",".join(str(tmp_path / f"{f}.json") for f in files), f"--shapes={shapes}",
                       "--modes=fwd", f"--out={tmp_path / 'f'}", cwd=REPO)
        assert r.returncode == 0, r.stderr[-2000:]
        md = (tmp_path / "f.md").read_text()
        tables[name] = [line.split("|")[10:12] for line in md.splitlines() if "×64×1 | fwd |" in line]
        assert len(tables[name]) == len(files), md
    floor, pct = (c.strip() for c in tables["H200"][0])
    assert float(floor) >= 0 and pct.endswith("%"), tables
    for name in ("H100", "GH200", "mixed"):
        assert all([c.strip() for c in cells] == ["—", "—"] for cells in tables[name]), (name, tables)


def test_gate_stability_page_keeps_every_run(tmp_path):
    # The committed page holds two runs (1024 tokens and 2^20): re-rendering one (here the tagged
    # run, from its JSON) keeps the other's section instead of overwriting the page with one run.
    src = os.path.join(REPO, "experiments", "results")
    for name in os.listdir(src):
        if name.startswith("gate_stability") and name.endswith(".json"):
            (tmp_path / name).write_text(open(os.path.join(src, name)).read())
    r = subprocess.run([sys.executable, "-m", "experiments.gate_stability", f"--out_dir={tmp_path}", "--tag=_2p20",
                        f"--from_json={tmp_path / 'gate_stability_2p20.json'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "gate_stability.md").read_text()
    assert page.count("## KDA gate stability (") == 2 and "| 131072 |" in page and "| 1048576 |" in page, page
    assert page == open(os.path.join(src, "gate_stability.md")).read()        # the committed page, re-rendered
    # the 2^20 run's JSON without its --tag would replace the 1024-token run: refused, nothing written
    before = (tmp_path / "gate_stability.json").read_bytes()
    r = subprocess.run([sys.executable, "-m", "experiments.gate_stability", f"--out_dir={tmp_path}",
                        f"--from_json={tmp_path / 'gate_stability_2p20.json'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0 and "its own --tag" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "gate_stability.json").read_bytes() == before
    # a file of another kind named like a run is left out of the page, with a message
    (tmp_path / "gate_stability_summary.json").write_text(json.dumps({"rows": []}))
    r = subprocess.run([sys.executable, "-m", "experiments.gate_stability", f"--out_dir={tmp_path}", "--tag=_2p20",
                        f"--from_json={tmp_path / 'gate_stability_2p20.json'}"], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "gate_stability_summary.json" in r.stdout, r.stderr[-2000:]
    assert (tmp_path / "gate_stability.md").read_text() == page


def test_depth_residuals_page_keeps_its_notes(tmp_path):
    # The committed page's notes (What happened, the extra sweeps) live in depth_residuals_notes.md:
    # re-rendering into that folder without --notes_file keeps them (it used to drop them).
    src = os.path.join(REPO, "experiments", "results")
    for name in ("depth_residuals.json", "depth_residuals_notes.md"):
        (tmp_path / name).write_text(open(os.path.join(src, name)).read())
    r = subprocess.run([sys.executable, "-m", "experiments.depth_residuals",
                        f"--report_from={tmp_path / 'depth_residuals.json'}", f"--out={tmp_path / 'depth_residuals'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    page = (tmp_path / "depth_residuals.md").read_text()
    assert "## What happened" in page and "## Extra sweeps" in page, page[:2000]
    assert page == open(os.path.join(src, "depth_residuals.md")).read()      # the committed page, re-rendered


def test_moe_balance_finds_used_run_directories(tmp_path):
    plan = moe_balance.run_order(["none", "aux_loss"], [0, 1], "seed_major")
    assert moe_balance.used_workdirs(str(tmp_path), plan) == []
    (tmp_path / "aux_loss" / "seed1").mkdir(parents=True)
    assert moe_balance.used_workdirs(str(tmp_path), plan) == []          # empty directory: a fresh run
    (tmp_path / "aux_loss" / "seed1" / "metrics.jsonl").write_text("{}\n")
    assert moe_balance.used_workdirs(str(tmp_path), plan) == [str(tmp_path / "aux_loss" / "seed1")]


def test_bench_kda_rejects_flag_typos_before_timing(tmp_path):
    repo = REPO
    for flag, message in (("--modes=fwd,bwd", "--modes"), ("--implementations=chunkd", "--implementations"),
                          ("--shapes=1x64x1", "--shapes"), ("--declared_lower_bound=-7", "--declared_lower_bound"),
                          ("--declared_lower_bound=unbounded", "--declared_lower_bound"),
                          ("--stream_calls=-1", "--stream_calls"), ("--iters=0", "--iters"),
                          ("--docs_per_row=0", "--docs_per_row"), ("--docs_per_row=-3", "--docs_per_row"),
                          ("--docs_per_row=3", "T / 64 = 2")):     # 128 tokens hold 2 documents of >= 64
        r = _bench_kda("--shapes=1x128x1x16", flag, "--out=", cwd=repo)     # the flag last: it wins
        assert r.returncode != 0 and message in r.stderr, (flag, r.stderr[-1000:])
    r = _bench_kda("--profile", "--docs_per_row=0", "--out=/tmp/unused", cwd=repo)
    assert r.returncode != 0 and "--docs_per_row" in r.stderr, r.stderr[-1000:]


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "experiments.bench_kda", *args], cwd=cwd, capture_output=True,
                          text=True, check=True, timeout=600)


def test_check_rows_and_merge_with_fla_rows(tmp_path):
    repo = REPO
    out = tmp_path / "kda"
    _run("--shapes=1x64x1x16", "--implementations=chunked", "--iters=1", "--warmup=0", "--check_max_t=32",
         "--stream_calls=3", "--stream_reps=2", f"--out={out}", cwd=repo)
    saved = json.loads((tmp_path / "kda.json").read_text())
    check = [r for r in saved["rows"] if r["mode"] == "check"]
    assert len(check) == 1 and check[0]["check_T"] == 32
    errs = check[0]["rms_ratio_vs_fp32_recurrent"]
    assert set(errs) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert all(0.0 < e < 1e-2 for e in errs.values()), errs      # bf16 inputs vs the fp32 oracle: nonzero, small
    fla_row = dict(implementation="fla", mode="fwd", B=1, T=64, H=1, K=16, V=16, median_ms=2.0 * min(
        r["median_ms"] for r in saved["rows"] if r["mode"] == "fwd"))
    (tmp_path / "kda_fla.jsonl").write_text(json.dumps(fla_row) + "\n")
    _run(f"--from_json={tmp_path / 'kda.json'},{tmp_path / 'kda_fla.jsonl'}", f"--out={tmp_path / 'merged'}",
         cwd=repo)
    md = (tmp_path / "merged.md").read_text()
    timed = {r["mode"]: r for r in saved["rows"] if r["mode"] != "check"}
    assert all(r["stream_ms"] > 0 and (r["stream_calls"], r["stream_reps"]) == (3, 2) for r in timed.values())
    fwd = [line for line in md.splitlines() if line.startswith("| 1×64×1 | fwd |")]
    assert len(fwd) == 2                                        # wall-time and back-to-back tables
    wall, device = ([c.strip() for c in line.strip("|").split("|")] for line in fwd)
    assert wall[5] == device[5] == f"{fla_row['median_ms']:.2f}"   # the fla column comes from the .jsonl
    assert wall[7] == "0.50"                                    # chunked / best peer
    assert device[3] == f"{timed['fwd']['stream_ms']:.2f}"      # the JAX rows by their back-to-back times
    assert device[7] == f"{timed['fwd']['stream_ms'] / fla_row['median_ms']:.2f}"


def test_bench_kda_profile_tables_from_a_cpu_trace(tmp_path):
    """bench_kda --profile end to end on CPU (the chunked op, XLA:CPU thunks as the "kernels"):
    one row per mode with nonzero kernel times and a device-busy time within the traced wall time, the
    markdown re-written from the JSON, and bad flags refused."""
    repo = REPO
    run = lambda *a, check=True: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "experiments.bench_kda", "--profile", *a], cwd=repo, capture_output=True, text=True,
        check=check, timeout=600)
    out = tmp_path / "peers"
    run("--shapes=1x128x1x16", "--implementations=chunked", "--iters=2", "--warmup=0", f"--out={out}")
    saved = json.loads((tmp_path / "peers.json").read_text())
    assert [(r["implementation"], r["mode"]) for r in saved["rows"]] == [("chunked", "fwd"), ("chunked", "fwd+bwd")]
    for r in saved["rows"]:
        assert r["kernels"] and sum(k["ms"] for k in r["kernels"]) > 0.0, r
        assert 0.0 < r["busy_ms"] <= 1.05 * r["wall_ms"], r
    run(f"--from_json={out}.json", f"--out={tmp_path / 'again' / 'peers'}")
    assert (tmp_path / "again" / "peers.md").read_text() == (tmp_path / "peers.md").read_text()
    bad = run("--from_json=a.json,b.json", f"--out={out}", check=False)
    assert bad.returncode != 0 and "--from_json with --profile takes one JSON" in bad.stderr


def test_experiment_modules_the_tests_import_coexist_in_one_process():
    """pytest-xdist puts any two test files in one worker: the experiment modules tests import in-process
    must not define clashing absl flags at import."""
    repo = REPO
    mods = ("bench_moe", "depth_residuals", "moe_balance", "qb_convergence")
    code = "import importlib\n" + "".join(f"importlib.import_module('experiments.{m}')\n" for m in mods)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]


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
moe_balance.write_results({"a": [run, dict(run, val_loss=2.7, compile={"backend_compile_s": 0.5})]}, meta, stem)
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
    repo = REPO
    proc = subprocess.run([sys.executable, "-c", _MOE_BALANCE_CHECKS, str(tmp_path / "mb")], capture_output=True,
                          text=True, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
