"""Fused vs solve_bwd -> score_bwd (interpret on CPU, compiled on GPU): RMS ratios per output."""
import sys, time
import jax, jax.numpy as jnp, numpy as np
sys.path.insert(0, ".")
from tests.pallas_kernels.kda.test_stages import solve_bwd_inputs, stage_rel, STAGE_CUTS, CENTRE
from tests.kda_testing import rms_ratio
from pallas_kernels.kda import mosaic_gpu as mgpu
from experiments.prototypes.fused_intra_bwd.fused_bwd import fused_bwd

interp = jax.default_backend() != "gpu"
def two(args, scale, seg):
    dv, dbeta, *scores = mgpu.solve_bwd(*args, scale=scale, segments=seg, interpret=interp)
    dq, dk, dG = mgpu.score_bwd(args[0], args[1], args[3], *scores, scale=scale, centre=CENTRE, interpret=interp)
    return dv, dbeta, dq, dk, dG
shapes = [tuple(map(int, s.split("x"))) for s in (sys.argv[1:] or ["1x128x1x128x128", "1x128x1x64x64"])]
for (B, T, H, K, V) in shapes:
    args = solve_bwd_inputs(B, T, H, K, V)
    if "BETA1" in __import__("os").environ:
        args = args[:4] + (jnp.ones_like(args[4]),) + args[5:]
    scale = K ** -0.5
    for segd in (None, "docs"):
        seg = None
        if segd:
            from pallas_kernels.kda.api import document_offsets
            ids = jnp.asarray(np.cumsum(np.random.RandomState(0).rand(B, T) < (0.05 if T <= 512 else 16 / T), axis=1), jnp.int32)
            seg = document_offsets(ids, 64, T)
        t0 = time.time()
        ref = jax.jit(lambda *a: two(a, scale, seg))(*args)
        out = jax.jit(lambda *a: fused_bwd(*a, scale=scale, centre=CENTRE, segments=seg, interpret=interp))(*args)
        jax.block_until_ready(out)
        errs = {n: float(rms_ratio(o.astype(jnp.float32), r.astype(jnp.float32))) for n, o, r in
                zip(("dv", "dbeta", "dq", "dk", "dG"), out, ref)}
        print((B, T, H, K, V), segd, {n: f"{e:.1e}" for n, e in errs.items()}, f"{time.time() - t0:.0f}s", flush=True)
