"""Causal softmax attention with document (segment) masking, and rotary position embeddings.

`causal_attention` runs XLA's `jax.nn.dot_product_attention` (portable; the mask is materialised),
jax-linear-attention's Mosaic GPU flash attention (the H100/H200 default: with packed documents it skips
the key blocks before a query tile's document), cuDNN flash attention (dense document mask) or jax's
Pallas flash attention with segment ids; `supported` says which runs a call and why not.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def segment_causal_mask(q_segment_ids, kv_segment_ids, q_positions=None, kv_positions=None):
    """Boolean attention mask [B, 1, Tq, Tk]: same document AND key not after query.

    Args:
      q_segment_ids: [B, Tq] int32 document ids of the queries (0 = padding).
      kv_segment_ids: [B, Tk] int32 document ids of the keys.
      q_positions, kv_positions: optional [B, Tq] / [B, Tk] int32 absolute stream positions used for the
        causal part; default: index order (query i may see keys 0..i when Tq == Tk).
    """
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if q_positions is None:
        tq, tk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
        causal = jnp.tril(jnp.ones((tq, tk), bool), k=tk - tq)[None]
    else:
        causal = q_positions[:, :, None] >= kv_positions[:, None, :]
    return (same & causal)[:, None]


IMPLEMENTATIONS = ("xla", "pallas_triton", "cudnn", "jla")
# implementation=None on a CUDA GPU: the first that supports the call; "xla" otherwise. Measured on an
# H200, fwd+bwd with 4 documents a row (experiments/results/attention_h200.md): at 32 x 2048 x 6 x 128
# bf16 jla 1.09 ms, cudnn 5.20, pallas_triton 5.84; at 16 x 4096 x 16 x 128 jla 4.42, cudnn 24.7,
# pallas_triton 30.9 (xla: 10.7 and 31.8 ms at the 2026-12-03 shapes, git ca8f409).
GPU_AUTO_ORDER = ("jla", "cudnn", "pallas_triton")
_FLASH_BLOCK = 128  # jax's Pallas flash attention forward tiles (BlockSizes.get_default())


def _jla_attention():
    from jla.ops.mosaic_gpu import attention as jla_attention  # noqa: PLC0415 -- optional GPU dependency

    return jla_attention


def supported(implementation: str, q, k, v, *, segment_ids=None, interpret: bool = False) -> tuple[bool, str]:
    """Whether `implementation` runs this `causal_attention` call: ``(ok, reason)``, reason "" when ok.

    Reads only shapes, dtypes and the platform. "xla" runs everything. "pallas_triton" (jax's Pallas
    flash attention, `jax.experimental.pallas.ops.gpu.attention.mha`, Triton lowering: causal + segment
    masks inside the kernel) needs a CUDA GPU (or interpret=True), T a multiple of 128 (or T <= 128 and
    a multiple of 32), Dh a power of two in [16, 256] and bf16/fp16 inputs (fp32 only in interpret
    mode: compiled, its dots run in TF32). "cudnn" (`jax.nn.dot_product_attention(implementation=
    "cudnn")`, cuDNN flash attention; the segment mask goes in as a dense [B, 1, T, T] mask) needs a
    CUDA GPU, bf16/fp16 inputs and Dh a multiple of 8 up to 128. "jla" (jax-linear-attention 0.1.0's
    `jla.ops.mosaic_gpu.attention.flash_attention`: FlashAttention-3-style Mosaic GPU kernels; they skip
    the key blocks in the causal future and, in rows where every document id forms one run, those before
    the document of a tile's first query; exact for any segment layout) needs jla importable
    (experiments/gpu_wheels.txt), an sm_90 GPU, bf16/fp16 inputs and Dh 64 or 128 (jla's own `supported`).

    Raises:
      ValueError: unknown `implementation`.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation=}")
    if implementation == "xla":
        return True, ""
    B, T, H, Dh = q.shape
    on_gpu = jax.default_backend() == "gpu"
    if implementation == "jla":
        if not on_gpu:
            return False, f"jla needs a CUDA GPU; the backend is {jax.default_backend()!r}"
        try:
            why = _jla_attention().supported(q, k, v)
        except ModuleNotFoundError as e:  # jla itself or one of its dependencies
            return False, (f"jla (jax-linear-attention) is not installed ({e}; experiments/gpu_wheels.txt "
                           "lists the wheels)")
        except Exception as e:  # noqa: BLE001 -- a broken install refuses the call (fail-closed), never crashes it
            return False, f"jla could not be imported or checked: {type(e).__name__}: {e}"
        return (True, "") if why is None else (False, f"jla: {why}")
    if implementation == "cudnn":
        if not on_gpu:
            return False, f"cudnn needs a CUDA GPU; the backend is {jax.default_backend()!r}"
        if q.dtype not in (jnp.bfloat16, jnp.float16):
            return False, f"cudnn needs bf16 or fp16 inputs; got {q.dtype}"
        if Dh % 8 or Dh > 128:
            return False, f"cudnn needs a head dim that is a multiple of 8 up to 128; got Dh={Dh}"
        return True, ""
    if not (on_gpu or interpret):
        return False, f"pallas_triton compiles for a CUDA GPU; the backend is {jax.default_backend()!r}"
    if not (T % _FLASH_BLOCK == 0 or (T < _FLASH_BLOCK and T % 32 == 0)):
        return False, f"pallas_triton needs T a multiple of {_FLASH_BLOCK} (or of 32 below it); got T={T}"
    if Dh & (Dh - 1) or not 16 <= Dh <= 256:
        return False, f"pallas_triton needs a power-of-two head dim in [16, 256]; got Dh={Dh}"
    if q.dtype not in (jnp.bfloat16, jnp.float16) + ((jnp.float32,) if interpret else ()):
        return False, f"pallas_triton needs bf16 or fp16 inputs (fp32 in interpret mode); got {q.dtype}"
    return True, ""


def default_implementation(q, k, v, *, segment_ids=None) -> str:
    """What implementation=None runs: on a CUDA GPU the first of `GPU_AUTO_ORDER` that supports the
    call, else "xla" (CPU, TPU, unsupported shapes)."""
    if jax.default_backend() == "gpu":
        for name in GPU_AUTO_ORDER:
            if supported(name, q, k, v, segment_ids=segment_ids)[0]:
                return name
    return "xla"


def causal_attention(q, k, v, *, segment_ids=None, scale=None, implementation: str | None = None,
                     interpret: bool = False):
    """Causal multi-head softmax attention; tokens attend only within their own document.

    Args:
      q: [B, T, H, Dh] queries; k, v: [B, T, H, Dh] keys and values (same dtype as q).
      segment_ids: optional [B, T] int32 document ids (packed sequences); None = one document per row.
      scale: logit scale, default Dh**-0.5.
      implementation: None (the fastest supported, `default_implementation`), "xla"
        (`jax.nn.dot_product_attention` with a [B, 1, T, T] mask), "jla" (jax-linear-attention's
        Mosaic GPU flash attention with segment ids), "cudnn" (cuDNN flash attention) or
        "pallas_triton" (jax's Pallas flash attention with segment ids); see `supported`.
      interpret: run "pallas_triton" in Pallas interpret mode (CPU tests).

    Returns:
      [B, T, H, Dh] in q's dtype. Softmax is computed in fp32.

    Raises:
      ValueError: shapes disagree, an unknown implementation, or an explicit one that cannot run the
        call (the message gives `supported`'s reason).
    """
    if q.shape != k.shape or k.shape[:3] != v.shape[:3] or q.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, Dh] with matching shapes, got {q.shape=} {k.shape=} {v.shape=}")
    if segment_ids is not None and segment_ids.shape != q.shape[:2]:
        raise ValueError(f"segment_ids must be [B, T] = {q.shape[:2]}, got {segment_ids.shape=}")
    if implementation is None:
        implementation = default_implementation(q, k, v, segment_ids=segment_ids)
    ok, why = supported(implementation, q, k, v, segment_ids=segment_ids, interpret=interpret)
    if not ok:
        raise ValueError(f"causal_attention {implementation=} cannot run this call: {why}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if implementation in ("jla", "pallas_triton"):
        seg = None if segment_ids is None else segment_ids.astype(jnp.int32)
        if implementation == "jla":
            return _jla_flash(q, k, v, seg, kernel=_jla_attention().flash_attention, scale=float(scale))
        return _pallas_triton_flash(q, k, v, seg, scale=float(scale), interpret=interpret)
    backend = implementation  # "xla" or "cudnn"
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale, implementation=backend)
    mask = segment_causal_mask(segment_ids, segment_ids)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation=backend)


# One jit per (kernel, shapes): the attention layers of an unrolled model share one traced jaxpr forward
# and backward, so JAX lowers each kernel once per model, not once per layer (jla's Mosaic GPU kernels:
# ~0.6-1 s each on a CPU host; experiments/results/lowering_cpu.md).
@functools.partial(jax.jit, static_argnames=("kernel", "scale"))
def _jla_flash(q, k, v, segment_ids, *, kernel, scale: float):
    return kernel(q, k, v, segment_ids=segment_ids, scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def _pallas_triton_flash(q, k, v, segment_ids, *, scale: float, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415
    T = q.shape[1]
    blocks = pallas_attention.BlockSizes(block_q=min(_FLASH_BLOCK, T), block_k=min(_FLASH_BLOCK, T),
                                         block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
    return pallas_attention.mha(q, k, v, segment_ids, sm_scale=scale, causal=True, block_sizes=blocks,
                                interpret=interpret)


def rope(x, positions, *, theta=10000.0):
    """Rotary position embedding (Su et al. 2021, RoFormer eq. 34), half-split ("GPT-NeoX") layout.

    Args:
      x: [B, T, H, Dh] with Dh even.
      positions: [B, T] int32 position of each token inside its document.
      theta: frequency base.

    Returns:
      x rotated, same shape and dtype (angles in fp32).
    """
    dh = x.shape[-1]
    if dh % 2:
        raise ValueError(f"rope needs an even head dim, got {x.shape=}")
    freqs = theta ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2.0 / dh)
    ang = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, Dh/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
