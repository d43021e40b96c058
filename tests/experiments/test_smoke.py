"""Every experiment script end to end at a tiny size on CPU: it runs, exits 0 and writes its outputs.

Scripts define absl flags at import, so each runs in its own subprocess. The logic beyond "it runs"
(merges, tables, timing pattern, trace parsing) is tested in test_harness, test_results_merges and
test_scripts; bench_moe's jla rows (stand-in kernels) in test_bench_moe.
"""
import os
import subprocess
import sys

import pytest

from tests.repo import REPO

# The tiny LM of every --config run (one place to edit when config fields move).
TINY_LM = ["--config.model.d_model=32", "--config.model.num_layers=2", "--config.model.mixer_pattern=KA",
           "--config.model.num_heads=2", "--config.model.head_dim=16", "--config.model.d_ff=64",
           "--config.model.moe.num_experts=4", "--config.model.moe.d_ff=32", "--config.model.residual.blocks=2",
           "--config.data.seq_len=64", "--config.data.batch_size=2"]

# name -> (module, arguments with {out} for a tmp prefix, files under tmp that must exist afterwards)
SCRIPTS = {
    "bench_kda": ("bench_kda", ["--shapes=1x64x1x16", "--implementations=chunked", "--iters=1", "--warmup=0",
                                "--check_max_t=32", "--out={out}/kda"], ["kda.json", "kda.md"]),
    "bench_kda_packed": ("bench_kda", ["--shapes=1x128x1x16", "--implementations=chunked", "--iters=1", "--warmup=0",
                                       "--docs_per_row=2", "--check_max_t=64", "--out={out}/kdap"],
                         ["kdap.json", "kdap.md"]),
    "bench_kda_profile": ("bench_kda", ["--profile", "--shapes=1x64x1x16", "--implementations=chunked",
                                        "--modes=fwd", "--iters=1", "--warmup=0", "--out={out}/peers"],
                          ["peers.json", "peers.md"]),
    "kda_loss_scale": ("kda_loss_scale", ["--shape=1x64x1x16", "--implementations=chunked", "--gates=recipe",
                                          "--scales=1", "--out={out}/ls"], ["ls.json", "ls.md"]),
    "gate_stability": ("gate_stability", ["--seq_len=64", "--heads=1", "--head_dim=16", "--long_seq_len=256",
                                          "--long_heads=1", "--chunk_sizes=16", "--out_dir={out}"],
                       ["gate_stability.json", "gate_stability.md"]),
    "qb_convergence": ("qb_convergence", ["--d=8", "--num_experts=4", "--top_k=2", "--tokens=64", "--steps=3",
                                          "--stationary_tokens=64", "--warmup=1", "--docs=4", "--out={out}/qb"],
                       ["qb.json", "qb.md"]),
    "moe_ep": ("moe_ep", ["--tokens=64", "--batch=2", "--d_model=16", "--d_ff=8", "--experts=4", "--top_k=2",
                          "--iters=1", "--out={out}/ep"], ["ep.json", "ep.md"]),
    "bench_train": ("bench_train", ["--shape=tiny", "--rows=like_for_like,jla", "--steps=2", "--warmup=1",
                                    "--out={out}/train"], ["train.json", "train.md"]),
    "bench_dispatch": ("bench_dispatch", ["--shape=tiny", "--rows=k3_default", "--calls=1", "--out={out}/disp"],
                       ["disp.json", "disp.md"]),  # the k3_default row that bench_train's smoke leaves out
    "bench_attention": ("bench_attention", ["--shapes=1x128x1x32", "--docs_per_row=1,2", "--iters=1", "--warmup=0",
                                            "--stream_reps=1", "--out={out}/attn"], ["attn.json", "attn.md"]),
    "bench_depth_attention": ("bench_depth_attention", ["--shapes=tiny", "--iters=1", "--reps=1", "--out={out}/da"],
                              ["da.json", "da.md"]),
    "bench_cross_entropy": ("bench_cross_entropy", ["--tiny", "--out={out}/ce"], ["ce.json", "ce.md"]),
    "bench_moe": ("bench_moe", ["--gemm_shape=tiny", "--impls=xla,blocked", "--torch=false", "--out_dtypes=bfloat16",
                                "--iters=1", "--warmup=0", "--stream_calls=2", "--stream_reps=1", "--layer_shape=tiny",
                                "--layer_impls=default", "--layer_iters=1", "--out={out}/moe"], ["moe.json", "moe.md"]),
    "bench_moe_per_op": ("bench_moe", ["--study=per_op", "--gemm_shape=tiny", "--per_op_impl=xla", "--torch=false",
                                       "--iters=1", "--warmup=0", "--stream_calls=2", "--stream_reps=1",
                                       "--out={out}/ops"], ["ops.json", "ops.md"]),
    "lowering_time": ("lowering_time", ["--shapes=tiny", "--rows=k3_default", "--depth_layers=1", "--out={out}/lt"],
                      ["lt.json", "lt.md"]),
    "scan_buffer_memory": ("scan_buffer_memory", ["--tiny", "--out={out}/sbm"], ["sbm.json", "sbm.md"]),
    "profile_step_layers": ("profile_step", ["--layers", *TINY_LM, "--timed=1", "--warmup=0", "--out={out}/layers"],
                            ["layers.json", "layers.md"]),
    "quantile_threshold_study": ("quantile_threshold_study", ["--mode=synthetic", "--out={out}/qt"], ["qt.json"]),
    "train": ("train", [*TINY_LM, "--config.train.steps=2", "--config.train.eval_every=2",
                        "--config.train.eval_batches=1", "--config.train.checkpoint_every=2",
                        "--config.train.warmup_steps=1", "--config.workdir={out}/run"], ["run/run_header.json"]),
}


# Scripts whose run time is long loops, not compilation: they keep LLVM's optimisation (conftest.py
# turns it off for the rest; quantile_threshold_study takes 9 s with it, 26 s without).
RUN_BOUND = {"quantile_threshold_study"}


def _run(module: str, args: list[str], out: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if module in RUN_BOUND:
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    if module == "moe_ep":  # expert parallelism needs >= 2 devices: two fake CPU devices
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    return subprocess.run([sys.executable, "-m", f"experiments.{module}", *(a.format(out=out) for a in args)],
                          cwd=REPO, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_script_runs_at_a_tiny_size(name, tmp_path):
    module, args, outputs = SCRIPTS[name]
    proc = _run(module, args, str(tmp_path))
    assert proc.returncode == 0 and (outputs or proc.stdout.strip()), proc.stderr[-3000:]
    for rel in outputs:
        path = tmp_path / rel
        assert path.exists() and path.stat().st_size > 0, (rel, sorted(p.name for p in tmp_path.rglob("*")))
    if name == "train":  # the checkpoint it wrote samples and evaluates
        proc = _run("generate", ["--workdir={out}/run", "--max_tokens=4", "--prompt=a"], str(tmp_path))
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]
        proc = _run("eval_runs", ["--workdirs={out}/run", "--max_batches=2", "--out={out}/eval"], str(tmp_path))
        assert proc.returncode == 0 and (tmp_path / "eval.md").stat().st_size > 0, proc.stderr[-3000:]
