"""experiments/bench_kda.py end to end on a tiny shape (subprocess: the script defines absl flags)."""
import json
import subprocess
import sys


def _run(*args, cwd):
    return subprocess.run([sys.executable, "-m", "experiments.bench_kda", *args], cwd=cwd, capture_output=True,
                          text=True, check=True, timeout=600)


def test_check_rows_and_merge_with_fla_rows(tmp_path):
    repo = __file__.rsplit("/tests/", 1)[0]
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


def test_experiment_modules_the_tests_import_coexist_in_one_process():
    """pytest-xdist puts any two test files in one worker: the experiment modules tests import in-process
    must not define clashing absl flags at import."""
    repo = __file__.rsplit("/tests/", 1)[0]
    mods = ("bench_grouped_gemm_ops", "depth_residuals", "moe_balance", "qb_convergence")
    code = "import importlib\n" + "".join(f"importlib.import_module('experiments.{m}')\n" for m in mods)
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-1500:]


def test_package_versions_records_installed_distributions_only():
    from experiments.runtime import package_versions  # noqa: PLC0415
    import jax  # noqa: PLC0415

    assert package_versions(("jax", "no-such-distribution-k3jax")) == {"jax": jax.__version__}


def test_profile_kda_peers_tables_from_a_cpu_trace(tmp_path):
    """experiments/profile_kda_peers.py end to end on CPU (the chunked op, XLA:CPU thunks as the "kernels"):
    one row per mode with nonzero kernel times and a device-busy time within the traced wall time, the
    markdown re-written from the JSON, and bad flags refused."""
    repo = __file__.rsplit("/tests/", 1)[0]
    run = lambda *a, check=True: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "experiments.profile_kda_peers", *a], cwd=repo, capture_output=True, text=True,
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
    assert bad.returncode != 0 and "--from_json takes one JSON" in bad.stderr


def test_time_call_back_to_back_groups_reuse_one_input_set_each():
    """time_call's call pattern (subprocess: bench_kda defines absl flags at import): compile + warm-up +
    timed calls each with fresh inputs, then stream_reps groups of stream_calls calls, one fresh input
    set a group; without groups no stream_ms."""
    repo = __file__.rsplit("/tests/", 1)[0]
    code = """
import jax.numpy as jnp
from experiments.bench_kda import time_call
calls, made = [], []
def fn(x):
    calls.append(x)
    return x + 1
def make_args(i):
    made.append(i)
    return (jnp.full((4,), float(i)),)
r = time_call(fn, make_args, iters=3, warmup=2, stream_calls=4, stream_reps=5)
assert len(calls) == 1 + 2 + 3 + 4 * 5, len(calls)
assert made == [0, 1, 2, 1000, 1001, 1002] + list(range(2000, 2005)), made
assert all(calls[6 + 4 * g + j] is calls[6 + 4 * g] for g in range(5) for j in range(4))
assert r["stream_ms"] > 0 and (r["stream_calls"], r["stream_reps"], r["iters"]) == (4, 5, 3), r
assert "stream_ms" not in time_call(fn, make_args, iters=1, warmup=0, stream_calls=0, stream_reps=5)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
