"""ptxas's register and spill report for the Mosaic GPU KDA kernels (GPU only; a developer tool).

Mosaic GPU compiles each kernel to PTX and runs ptxas when XLA compiles the program that calls it;
with MOSAIC_GPU_DUMP_PTXAS=1 (set here before jax is imported) jaxlib prints ptxas's verbose report
to stderr: registers per thread, spill stores / loads in bytes, and notes such as C7514 (wgmma
serialised). One warpgroup a CTA has at most 255 registers a thread, so spills and code size decide
much of these kernels' speed. This compiles the forward and the gradient of `kda_pallas` with
backend="mosaic_gpu" (every Mosaic GPU stage) at --shape.

Run (H200): python -m tools.ptxas_report --shape=1x1024x2x128 2>&1 | grep -E "Compiling|spill|Used|C7514"
"""
from __future__ import annotations

import os

os.environ.setdefault("MOSAIC_GPU_DUMP_PTXAS", "1")

from absl import app, flags  # noqa: E402

flags.DEFINE_string("shape", "1x1024x2x128", "BxTxHxK (V = K); registers do not depend on B, T, H")
FLAGS = flags.FLAGS


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """'BxTxHxK' -> (B, T, H, K); ValueError naming the flag otherwise."""
    try:
        B, T, H, K = (int(x) for x in text.split("x"))
    except ValueError:
        raise ValueError(f"--shape must be BxTxHxK; got {text!r}") from None
    return B, T, H, K


def main(argv):
    del argv
    import jax
    import jax.numpy as jnp

    from pallas_kernels.kda import kda_pallas
    B, T, H, K = parse_shape(FLAGS.shape)
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(ks[i], (B, T, H, K)).astype(jnp.bfloat16) for i in range(3))
    g = -5 * jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))).astype(jnp.bfloat16)

    def loss(*a):
        return jnp.sum(kda_pallas(*a, lower_bound=-5.0, backend="mosaic_gpu")[0].astype(jnp.float32))
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, beta))


if __name__ == "__main__":
    app.run(main)
