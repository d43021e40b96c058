"""Exact sequence split of the serial KDA state passes: segments run in parallel (portable Pallas).

Per chunk c the transposed state St [V, K] (fp32) evolves affinely (triton/state_fwd.py notation):
  St_{c+1} = St_c * e^{G_last} + (U - W St_c^T)^T Kd = St_c M_c + U^T Kd,
  M_c = Diag(e^{G_last}) - W^T Kd  [K, K],
and the reverse pass (triton/state_bwd.py) likewise: dSt_c = dSt_{c+1} N_c + (Qg^T dO - W^T Aqk^T dO)^T-terms,
N_c = Diag(e^{G_last}) - Kd^T W. For a segment of L chunks:
  St_end = St_start P + R,  P = M_{c0} ... M_{c0+L-1},  R = the segment's pass from a zero state;
  dSt_start = dSt_end Q + Z,  Q = N_{c0+L-1} ... N_{c0},  Z = its reverse pass from a zero gradient.
P (Q) is the same pass started from the identity with U = 0 (dO = 0): `transitions_fwd` /
`transitions_bwd` run R and P (Z and Q) as one pass over an augmented state of V + K rows, in
parallel over (batch, head, segment, row block). `segment_scan` then carries the true states across
the NS segments (NS steps of one [V, K] x [K, K] dot), and the state passes (either backend) rerun each
segment from its true start state, again in parallel over segments. Work: about 3x the serial pass,
in T / (64 L) times fewer serial steps. The result equals the serial pass up to rounding (the
products P, Q at the exact precision of triton/common.precisions).

Source: the linear-recurrence scan of chunked linear attention (e.g. the chunk-level parallel scan
of "Gated Linear Attention", Yang et al. 2024, sec. 3); for the delta rule the per-chunk transition
is the WY form above (Kimi Linear, arXiv 2510.26692, chunk form as in fla `chunk_kda`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.triton import common as cm
from pallas_kernels.kda.triton.common import F32


def _start_rows(shape, is_z, first_col):
    """[BR, K] start block: zeros for a state row block, identity rows (from first_col) otherwise."""
    rows, cols = cm.iotas(*shape)
    return jnp.where(jnp.logical_and(jnp.logical_not(is_z), cols == first_col + rows),
                     1.0, 0.0).astype(F32)


def _transition_fwd_kernel(kd_ref, w_ref, u_ref, gl_ref, out_ref, *, chunk_size, precision, n_z):
    C = chunk_size
    iv = pl.program_id(3)
    is_z = iv < n_z
    BR = out_ref.shape[0]
    p = precision

    def body(c, St):
        rows = pl.ds(c * C, C)
        u = jnp.where(is_z, u_ref[rows, :].astype(F32), 0.0)
        vp = u - cm.dot_nt(w_ref[rows, :].astype(F32), St, p)
        return St * gl_ref[pl.ds(c, 1), :] + cm.dot_tn(vp, kd_ref[rows, :].astype(F32), p)

    St0 = _start_rows(out_ref.shape, is_z, (iv - n_z) * BR)
    out_ref[...] = lax.fori_loop(0, kd_ref.shape[0] // C, body, St0)


def transitions_fwd(kd, w, u, gl, *, chunk_size: int, seg_chunks: int, block_v: int,
                    interpret: bool, precision=None, num_warps: int = 4):
    """Per-segment forward transition P and zero-start state R.

    Args: intra_fwd outputs kd, w [B, H, T, K], u [B, H, T, V], gl [B, H, NT, K]; seg_chunks L
      (NT % L == 0); block_v: row-block size (capped at K); precision of the dots.
    Returns (fp32, transposed like the states): P [B, H, NS, K, K], R [B, H, NS, V, K].
    """
    B, H, T, K = kd.shape
    V = u.shape[-1]
    C, L = chunk_size, seg_chunks
    NS = T // (C * L)
    BR = min(block_v, K)
    n_z = V // BR
    sk = pl.BlockSpec((None, None, L * C, K), lambda b, h, s, i: (b, h, s, 0))
    su = pl.BlockSpec((None, None, L * C, BR), lambda b, h, s, i: (b, h, s, jnp.minimum(i, n_z - 1)))
    sg = pl.BlockSpec((None, None, L, K), lambda b, h, s, i: (b, h, s, 0))
    so = pl.BlockSpec((None, None, None, BR, K), lambda b, h, s, i: (b, h, s, i, 0))
    out = pl.pallas_call(
        functools.partial(_transition_fwd_kernel, chunk_size=C, precision=precision, n_z=n_z),
        grid=(B, H, NS, n_z + K // BR),
        in_specs=[sk, sk, su, sg], out_specs=so,
        out_shape=jax.ShapeDtypeStruct((B, H, NS, V + K, K), F32),
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_split_transitions_fwd",
    )(kd, w, u, gl)
    return out[:, :, :, V:], out[:, :, :, :V]


def _transition_bwd_kernel(qg_ref, kd_ref, w_ref, aqk_ref, gl_ref, do_ref, out_ref, *, chunk_size,
                           precision, n_z):
    C = chunk_size
    n = kd_ref.shape[0] // C
    iv = pl.program_id(3)
    is_z = iv < n_z
    BR = out_ref.shape[0]
    p = precision

    def body(i, dSt):
        c = n - 1 - i
        rows = pl.ds(c * C, C)
        do = jnp.where(is_z, do_ref[rows, :].astype(F32), 0.0)
        dvp = (cm.dot_tn(aqk_ref[rows, :].astype(F32), do, p)
               + cm.dot_nt(kd_ref[rows, :].astype(F32), dSt, p))
        return (cm.dot_tn(do, qg_ref[rows, :].astype(F32), p) + dSt * gl_ref[pl.ds(c, 1), :]
                - cm.dot_tn(dvp, w_ref[rows, :].astype(F32), p))

    dSt0 = _start_rows(out_ref.shape, is_z, (iv - n_z) * BR)
    out_ref[...] = lax.fori_loop(0, n, body, dSt0)


def transitions_bwd(qg, kd, w, aqk, gl, do, *, chunk_size: int, seg_chunks: int, block_v: int,
                    interpret: bool, precision=None, num_warps: int = 4):
    """Per-segment reverse transition Q and zero-start state gradient Z.

    Args: intra_fwd outputs qg, kd, w [B, H, T, K], aqk [B, H, T, C], gl [B, H, NT, K];
      do [B, T, H, V] (token-major); seg_chunks, block_v, precision as transitions_fwd.
    Returns (fp32, transposed): Q [B, H, NS, K, K], Z [B, H, NS, V, K].
    """
    B, H, T, K = kd.shape
    V = do.shape[-1]
    C, L = chunk_size, seg_chunks
    NS = T // (C * L)
    BR = min(block_v, K)
    n_z = V // BR
    sk = pl.BlockSpec((None, None, L * C, K), lambda b, h, s, i: (b, h, s, 0))
    sa = pl.BlockSpec((None, None, L * C, C), lambda b, h, s, i: (b, h, s, 0))
    sg = pl.BlockSpec((None, None, L, K), lambda b, h, s, i: (b, h, s, 0))
    sd = pl.BlockSpec((None, L * C, None, BR), lambda b, h, s, i: (b, s, h, jnp.minimum(i, n_z - 1)))
    so = pl.BlockSpec((None, None, None, BR, K), lambda b, h, s, i: (b, h, s, i, 0))
    out = pl.pallas_call(
        functools.partial(_transition_bwd_kernel, chunk_size=C, precision=precision, n_z=n_z),
        grid=(B, H, NS, n_z + K // BR),
        in_specs=[sk, sk, sk, sa, sg, sd], out_specs=so,
        out_shape=jax.ShapeDtypeStruct((B, H, NS, V + K, K), F32),
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_split_transitions_bwd",
    )(qg, kd, w, aqk, gl, do)
    return out[:, :, :, V:], out[:, :, :, :V]


def _scan_kernel(x0_ref, p_ref, r_ref, starts_ref, final_ref, *, reverse, precision):
    NS = p_ref.shape[0]

    def body(i, St):
        s = NS - 1 - i if reverse else i
        starts_ref[s] = St
        return cm.dot(St, p_ref[s], precision) + r_ref[s]

    final_ref[...] = lax.fori_loop(0, NS, body, x0_ref[...].astype(F32))


def segment_scan(x0, P, R, *, reverse: bool, block_v: int, interpret: bool, precision=None, num_warps: int = 4):
    """Carry the true state across segments: x_{s+1} = x_s P_s + R_s (reverse: from the last).

    Args: x0 [B, H, V, K] fp32 (initial state, or the final-state gradient when reverse);
      P [B, H, NS, K, K], R [B, H, NS, V, K] from transitions_fwd / transitions_bwd.
    Returns: starts [B, H, NS, V, K] fp32 (the state entering each segment; reverse: the gradient
      of the state at each segment's end), final [B, H, V, K] fp32 (after the last step).
    """
    B, H, V, K = x0.shape
    NS = P.shape[2]
    BV = block_v
    xs = pl.BlockSpec((None, None, BV, K), lambda b, h, i: (b, h, i, 0))
    ps = pl.BlockSpec((None, None, NS, K, K), lambda b, h, i: (b, h, 0, 0, 0))
    rs = pl.BlockSpec((None, None, NS, BV, K), lambda b, h, i: (b, h, 0, i, 0))
    return pl.pallas_call(
        functools.partial(_scan_kernel, reverse=reverse, precision=precision),
        grid=(B, H, V // BV),
        in_specs=[xs, ps, rs], out_specs=[rs, xs],
        out_shape=[jax.ShapeDtypeStruct((B, H, NS, V, K), F32), jax.ShapeDtypeStruct((B, H, V, K), F32)],
        interpret=interpret, compiler_params=cm.compiler_params(num_warps), name="kda_split_scan",
    )(x0, P, R)
