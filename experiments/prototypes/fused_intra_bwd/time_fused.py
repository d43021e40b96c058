"""GPU: fused vs solve_bwd -> score_bwd, compiled; correctness at a small shape, then back-to-back ms."""
import sys, time, statistics, json
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from tests.pallas_kernels.kda.test_stages import solve_bwd_inputs, CENTRE
from tests.kda_testing import rms_ratio
from pallas_kernels.kda import mosaic_gpu as mgpu
from pallas_kernels.kda.api import document_offsets
from experiments.harness import packed_segment_ids
from experiments.prototypes.fused_intra_bwd.fused_bwd import fused_bwd

def two(args, scale, seg):
    dv, dbeta, *scores = mgpu.solve_bwd(*args, scale=scale, segments=seg)
    dq, dk, dG = mgpu.score_bwd(args[0], args[1], args[3], *scores, scale=scale, centre=CENTRE)
    return dv, dbeta, dq, dk, dG

def bb(fn, args, calls=10, reps=15):
    jax.block_until_ready(fn(*args)); jax.block_until_ready(fn(*args))
    gs = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            y = fn(*args)
        jax.block_until_ready(y); gs.append((time.perf_counter() - t) / calls)
    return 1e3 * statistics.median(gs)

res = {"device": jax.devices()[0].device_kind}
for (B, T, H, beta1) in ((1, 256, 2, True), (1, 256, 2, False)):
    args = solve_bwd_inputs(B, T, H, 128, 128)
    if beta1:
        args = args[:4] + (jnp.ones_like(args[4]),) + args[5:]
    for docs in (0, 1):
        seg = document_offsets(packed_segment_ids(B, T, 4), 64, T) if docs else None
        ref = jax.jit(lambda *a: two(a, 128 ** -0.5, seg))(*args)
        out = jax.jit(lambda *a: fused_bwd(*a, scale=128 ** -0.5, centre=CENTRE, segments=seg))(*args)
        e = {n: float(rms_ratio(o.astype(jnp.float32), r.astype(jnp.float32))) for n, o, r in
             zip(("dv", "dbeta", "dq", "dk", "dG"), out, ref)}
        print("check", (B, T, H), "beta=1" if beta1 else "beta", "docs" if docs else "dense", {n: f"{v:.1e}" for n, v in e.items()}, flush=True)
        res[f"check_{T}_{'b1' if beta1 else 'b'}_{docs}"] = e
for (B, T, H) in ((8, 4096, 16), (32, 2048, 6)):
    args = solve_bwd_inputs(B, T, H, 128, 128)
    for docs in (16, 1):
        seg = document_offsets(packed_segment_ids(B, T, docs), 64, T) if docs > 1 else None
        t2 = bb(jax.jit(lambda *a: two(a, 128 ** -0.5, seg)), args)
        tf = bb(jax.jit(lambda *a: fused_bwd(*a, scale=128 ** -0.5, centre=CENTRE, segments=seg)), args)
        print("time", (B, T, H), f"docs={docs}", f"two kernels {t2:.3f} ms, fused {tf:.3f} ms, ratio {tf / t2:.3f}", flush=True)
        res[f"time_{B}x{T}x{H}_d{docs}"] = dict(two_ms=t2, fused_ms=tf)
json.dump(res, open(sys.argv[1], "w"), indent=1)
