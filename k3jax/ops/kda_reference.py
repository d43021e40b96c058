"""Token-by-token fp32 oracle for Kimi Delta Attention (KDA).

Every faster KDA implementation in k3jax (the XLA chunked op, the Pallas kernels) is tested against
`kda_recurrent`. It follows fla's `naive_recurrent_kda` (fla/ops/kda/naive.py) step for step:
decay first, then the delta-rule update, then the output.

Source: Kimi Linear (arXiv 2510.26692), Eq. 1; fla `fla/ops/kda/naive.py`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["kda_recurrent", "l2_normalize", "validate_kda_inputs", "segment_restarts"]

# Inner-scan length of the blockwise rematerialised scan. Autodiff through a plain scan stores the
# [K, V] state at every token; scanning blocks of this many tokens under `jax.checkpoint` stores it
# once per block instead, so the oracle's gradient memory is T/_REMAT_BLOCK states.
_REMAT_BLOCK = 64

L2NORM_EPS = 1e-6
_HI = jax.lax.Precision.HIGHEST  # fp32 stays fp32 on every backend (no TF32)


def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) along the last axis, in fp32 or wider (fla's `l2norm`)."""
    x = x.astype(jnp.promote_types(jnp.float32, x.dtype))
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def validate_kda_inputs(q, k, v, g, beta, initial_state=None, segment_ids=None, scale=None):
    """Checks the shapes shared by every KDA implementation; raises ValueError naming the argument.

    Expected: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [B, H, K, V], all
    of a floating dtype; segment_ids [B, T] of an integer dtype; scale a Python number or None.
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K]; got {q.shape=}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K]; got {k.shape=}, {q.shape=}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape [B, T, H, K]; got {g.shape=}, {q.shape=}")
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] with q's B, T, H; got {v.shape=}, {q.shape=}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H]; got {beta.shape=}, {q.shape=}")
    if T == 0:
        raise ValueError(f"q must have at least one token; got {q.shape=}")
    V = v.shape[-1]
    if initial_state is not None and initial_state.shape != (B, H, K, V):
        raise ValueError(f"initial_state must be [B, H, K, V] = {(B, H, K, V)}; got {initial_state.shape=}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must have a floating dtype (e.g. bfloat16, float32); got {name}.dtype={x.dtype}")
    if segment_ids is not None:
        if segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got {segment_ids.shape=}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must have an integer dtype; got {segment_ids.dtype=}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a Python number or None; got {type(scale)=}")


def segment_restarts(segment_ids: jax.Array | None, batch: int, length: int) -> jax.Array:
    """[B, T] bool: True where the state restarts (the id differs from the previous token's).

    Token 0 never restarts: the initial state belongs to each row's first segment.
    """
    if segment_ids is None:
        return jnp.zeros((batch, length), dtype=bool)
    change = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate([jnp.zeros((batch, 1), dtype=bool), change], axis=1)


def _step(S, inputs):
    """One token for all [B, H]: S [B,H,K,V]; returns (S_t, o_t)."""
    q_t, k_t, v_t, g_t, b_t, r_t = inputs                      # q,k,g [B,H,K]; v [B,H,V]; b [B,H]; r [B]
    S = jnp.where(r_t[:, None, None, None], 0.0, S)            # a new document starts from zero state
    S = S * jnp.exp(g_t)[..., None]                            # decay first: Diag(exp(g_t)) S
    v_old = jnp.einsum("bhk,bhkv->bhv", k_t, S, precision=_HI)                # k_t^T S (what the memory predicts)
    S = S + jnp.einsum("bhk,bhv->bhkv", b_t[..., None] * k_t, v_t - v_old, precision=_HI)   # delta rule
    o_t = jnp.einsum("bhk,bhkv->bhv", q_t, S, precision=_HI)                  # o_t = S_t^T (scale q_t)
    return S, o_t


def kda_recurrent(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """KDA by the token-by-token recurrence, in fp32 (the oracle).

    Per head, with state S [K, V] and for t = 0..T-1:
        S <- S * exp(g_t)[:, None]                       (per-channel decay, applied first)
        S <- S + beta_t k_t (v_t - k_t^T S)^T            (delta rule)
        o_t = S^T (scale * q_t)
    i.e. S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T.

    Args:
      q, k: [B, T, H, K] queries / keys, any float dtype (computed in fp32).
      v: [B, T, H, V] values.
      g: [B, T, H, K] per-channel log-decay in natural-log units (nats), normally <= 0.
      beta: [B, T, H] delta-rule step size, normally in (0, 1).
      scale: query scale; None means K ** -0.5.
      initial_state: [B, H, K, V] state before token 0 (cast to fp32); None means zeros. With
        segment_ids it applies to the first segment of each row only; later segments start at zero.
      output_final_state: also return the fp32 state after the last token.
      segment_ids: [B, T] integer document ids of packed sequences. The state restarts from zero at
        every token whose id differs from the previous token's (ids need not be increasing; a
        repeated id after a change is a new document).
      use_qk_l2norm: L2-normalise q and k along K (fp32, eps 1e-6 inside the sqrt) first.

    Returns:
      (o, final_state): o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32, or None when
      output_final_state is False.

    Raises:
      ValueError: on mismatched shapes or a non-floating q, k, v, g, beta (the message names the argument).

    Source: Kimi Linear (arXiv 2510.26692) Eq. 1; matches fla `naive_recurrent_kda`. Gradients are by
    autodiff through a scan rematerialised every 64 tokens (memory T/64 states).
    """
    validate_kda_inputs(q, k, v, g, beta, initial_state, segment_ids, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    f32 = jnp.promote_types(jnp.float32, q.dtype)   # fp32 (fp64 when the inputs are fp64)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q.astype(f32) * scale
    k, vv, g, beta = k.astype(f32), v.astype(f32), g.astype(f32), beta.astype(f32)
    restart = segment_restarts(segment_ids, B, T)
    S0 = jnp.zeros((B, H, K, V), f32) if initial_state is None else initial_state.astype(f32)

    # Pad to a multiple of the remat block with identity steps (k = 0, beta = 0, g = 0).
    n_blocks = -(-T // _REMAT_BLOCK)
    pad = n_blocks * _REMAT_BLOCK - T

    def prep(x):  # [B, T, ...] -> [n_blocks, _REMAT_BLOCK, B, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = jnp.moveaxis(x, 1, 0)
        return x.reshape((n_blocks, _REMAT_BLOCK) + x.shape[1:])

    xs = tuple(prep(x) for x in (q, k, vv, g, beta, restart))

    @jax.checkpoint
    def block(S, xs_block):
        return jax.lax.scan(_step, S, xs_block)

    S_T, o = jax.lax.scan(block, S0, xs)                      # o [n_blocks, blk, B, H, V]
    o = o.reshape((n_blocks * _REMAT_BLOCK, B, H, V))[:T]
    o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
    return o, (S_T if output_final_state else None)
