"""Hopper (sm_90) Mosaic GPU kernel a of the intra-chunk backward (issue 7's lever after round 12).

`intra_bwd_a` is a drop-in for bwd.intra_bwd_a with the op's default options on Hopper
(bf16_dots=True, gate_cumsum=True, no segments, whole states): the same math, the same bf16
operand rounding of every dot and the same outputs, which kernel b (bwd.intra_bwd_b) consumes
unchanged. One warpgroup per (batch x head, chunk of 64 tokens). Per chunk, from the saved
transposed states St = S^T, dSt = dS^T [V, K] (bf16), dO [C, V], dU = dV' [C, V] and the forward's
W, U, A, M (bwd._state_solve_bwd / _solve_bwd):
  V' = U - W S;  dAqk = dO V'^T;  dKd = V' dS^T;  dQg = dO S^T;  dW = -dU S^T;  dX = A^T dW;
  dY = A^T dU;  dA = dW X^T + dU Y^T;  dL = -A^T dA A^T (strictly lower);
  d e^{G_last} = colsum(St * dSt);
then the elementwise chain rule to the partial dq, dk, dG, dG_last, the final dv, dbeta and the
score gradients dM = beta dL, dAqk. Every product is a wgmma with bf16 operands in 128-byte-swizzled
SMEM and an fp32 accumulator (common.BF16_OPERANDS); the two dL products take split-bf16 operands
(hi + lo, three wgmma each: BF16_BF16_F32_X3, common.exact_precision for bf16 inputs). The
[C, K] work runs in halves of 64 columns (the states arrive as two [V, 64] boxes each), so that at
most a few [64, 64] fp32 values are live per thread; only dA accumulates across the halves.

I/O: the dot operands that are bf16 in HBM (the states, dO) arrive by TMA; the fp32 operands (W, dU,
A) and every elementwise input (q, k, v, G, beta, U, M) are read straight from HBM into registers in
the wgmma layout (fp32 operands are rounded there and stored as bf16 operands); the outputs are
written straight from registers. SMEM: 176 KiB at K = V = 128 (one CTA per SM). Measured on the H200
(round 13 of kda_pallas_notes.md): op fwd+bwd 11.11 -> 8.22 ms at 8x4096x16x128; kernel a itself
~3.3 ms against the Triton kernel's 6.09 (inferred from the profile: the three Mosaic GPU kernels
together minus the two state passes' round-12 time), probably latency-bound (four warps per SM).

Dispatch: ops.KernelOptions.hopper_intra_bwd; the conditions are ops.use_hopper_intra_bwd's.
Source: Kimi Linear (arXiv 2510.26692) chunk form as fla `chunk_kda`'s backward; Mosaic GPU API of
jax 0.11.2 (jax.experimental.pallas.mosaic_gpu).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.kda.hopper import BF16, CHUNK, F32, HEAD_DIMS, _operand, interpret_params

HALF = 64                  # columns of K per step (one 128-byte swizzle tile of bf16)
ABLATIONS = ("hbm_loads", "dL")    # intra_bwd_a's private profiling ablations
_WG = plgpu.Layout.WGMMA
_ROW, _COL = _WG.reduce(1), _WG.reduce(0)      # a [C] per-row and a [N] per-column vector


def _iota(shape, dim):
    return plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, shape, dim), _WG)


def _load(ref, layout=_WG, smem=False):
    """ref (GMEM unless smem) into registers in `layout`, as fp32. GMEM loads take Mosaic GPU's
    plain (non-"optimized") transfer: one vector load per register, straight from HBM / L2."""
    return plgpu.load(ref, layout=layout, optimized=smem).astype(F32)


def _split(x, hi_s, lo_s):
    """x fp32 -> hi = bf16(x), lo = bf16(x - hi) into two operand buffers (split-bf16 operands)."""
    hi = x.astype(BF16)
    hi_s[...] = hi
    lo_s[...] = (x - hi.astype(F32)).astype(BF16)


def _dl(dA, r_i, c_i, a_hi, a_lo, t_hi, t_lo):
    """dL = -A^T dA A^T on the strict lower triangle (dA masked to rows >= cols first), both products
    with split-bf16 operands (hi hi + hi lo + lo hi); t_hi, t_lo: two free [C, C] operand buffers."""
    _split(jnp.where(r_i >= c_i, dA, 0.0), t_hi, t_lo)
    plgpu.commit_smem()

    def r_dot(acc):                                       # A^T dA
        plgpu.wgmma(acc, a_hi.T, t_hi)
        plgpu.wgmma(acc, a_hi.T, t_lo)
        plgpu.wgmma(acc, a_lo.T, t_hi)
        return acc[...]
    r = pl.run_scoped(r_dot, plgpu.ACC(dA.shape, F32))
    plgpu.commit_smem()                                   # every warp's reads of t_hi, t_lo are done
    _split(r, t_hi, t_lo)
    plgpu.commit_smem()

    def l_dot(acc):                                       # (A^T dA) A^T
        plgpu.wgmma(acc, t_hi, a_hi.T)
        plgpu.wgmma(acc, t_hi, a_lo.T)
        plgpu.wgmma(acc, t_lo, a_hi.T)
        return acc[...]
    return jnp.where(r_i > c_i, -pl.run_scoped(l_dot, plgpu.ACC(dA.shape, F32)), 0.0)


def _const_load(ref, layout=_WG):
    """The "hbm_loads" profiling ablation's stand-in for _load: a constant in the same layout."""
    return plgpu.layout_cast(jnp.full(ref.shape, 0.5, F32), layout)


def _check_shapes(arrays, want, context):
    """Raises a ValueError naming every array of `arrays` ({name: array}) whose shape is not
    want[name], with `context` (what the expected shapes follow from)."""
    bad = {n: a.shape for n, a in arrays.items() if a.shape != want[n]}
    if bad:
        raise ValueError(f"shapes do not match {context}: {bad}; expected { {n: want[n] for n in bad} }")


def _check(q, k, v, G, beta, do, du, h, dh, w, u, A, M):
    B, T, H, K = q.shape
    V = v.shape[-1]
    if T % CHUNK:
        raise ValueError(f"T = {T} must be a multiple of {CHUNK}")
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise ValueError(f"K = {K} and V = {V} must be in {HEAD_DIMS} (wgmma tiles of 64 columns)")
    if not all(x.dtype == BF16 for x in (q, k, v, do, h, dh)):
        raise ValueError("q, k, v, do, h and dh must be bf16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}, {do.dtype}, {h.dtype}, {dh.dtype}")
    if not all(x.dtype == F32 for x in (G, du, w, u, A, M)):
        raise ValueError("G, du, w, u, A and M must be fp32; got "
                         f"{G.dtype}, {du.dtype}, {w.dtype}, {u.dtype}, {A.dtype}, {M.dtype}")
    if not jnp.issubdtype(beta.dtype, jnp.floating):
        raise ValueError(f"beta must be a float array; got {beta.dtype}")
    NT, C = T // CHUNK, CHUNK
    want = dict(k=(B, T, H, K), v=(B, T, H, V), G=(B, T, H, K), beta=(B, T, H), do=(B, T, H, V),
                du=(B, H, T, V), h=(B, H, NT, V, K), dh=(B, H, NT, V, K), w=(B, H, T, K),
                u=(B, H, T, V), A=(B, H, T, C), M=(B, H, T, C))
    _check_shapes(dict(k=k, v=v, G=G, beta=beta, do=do, du=du, h=h, dh=dh, w=w, u=u, A=A, M=M), want,
                  f"q {q.shape} (B, T, H, K) and v's V = {V}")
    return B, T, H, K, V, NT


def intra_bwd_a(q, k, v, G, beta, do, du, h, dh, w, u, A, M, *, scale: float,
                interpret: bool | plgpu.InterpretGPUParams = False, _ablate: tuple[str, ...] = ()):
    """Kernel a of the intra-chunk backward on Hopper (module docstring); chunk 64.

    Args:
      q, k: [B, T, H, K] bf16; v: [B, T, H, V] bf16; G: [B, T, H, K] fp32, the chunk-local inclusive
        cumsum of the log-decay g (nats; the op's xla_gate_cumsum form); beta: [B, T, H], any float
        dtype (read as fp32); do: [B, T, H, V] bf16 (all token-major, the user's layout).
      du: [B, H, T, V] fp32, dV' from the reverse state pass; h, dh: [B, H, T / 64, V, K] bf16, the
        transposed state entering each chunk and the transposed gradient of the state after it.
      w: [B, H, T, K], u: [B, H, T, V] fp32 (the forward's W, U); A, M: [B, H, T, 64] fp32 (the
        forward's (I + L)^-1 and beta-free score tile, per chunk).
      scale: the query scale; interpret: as hopper.state_fwd.
    Returns (as bwd.intra_bwd_a with gate_cumsum=True): dv [B, T, H, V] bf16 and dbeta [B, T, H]
      fp32 (final, token-major); head-major fp32 partial dq, dk, dG [B, H, T, K], dG_last
      [B, H, T / 64, K], the score gradients dM, dAqk [B, H, T, 64].
    _ablate: PRIVATE profiling option (timing only, results WRONG): "hbm_loads" (every direct HBM
      read replaced by a constant; the TMA copies stay), "dL" (the exact dL products skipped).
    Raises: ValueError for T not a multiple of 64, K or V not in HEAD_DIMS, wrong dtypes or shapes,
      an unknown _ablate name.
    """
    B, T, H, K, V, NT = _check(q, k, v, G, beta, do, du, h, dh, w, u, A, M)
    ablate = frozenset(_ablate)
    if not ablate <= set(ABLATIONS):
        raise ValueError(f"_ablate={_ablate} must name some of {ABLATIONS}")
    ld = _const_load if "hbm_loads" in ablate else _load
    C, KH, BH = CHUNK, K // HALF, B * H

    def body(q_ref, k_ref, v_ref, G_ref, beta_ref, do_ref, du_ref, h_ref, dh_ref, w_ref, u_ref, A_ref,
             M_ref, dv_ref, dbeta_ref, dq_ref, dk_ref, dg_ref, dgl_ref, dm_ref, daqk_ref,
             h_s, dh_s, do_s, w_s, du_s, vp_s, x_s, a_hi, a_lo, t_hi, t_lo, bar):
        bh, c = lax.axis_index("bh"), lax.axis_index("c")
        b, hh = lax.div(bh, H), lax.rem(bh, H)
        rows = pl.ds(c * C, C)
        for kh in range(KH):
            cols = pl.ds(kh * HALF, HALF)
            plgpu.copy_gmem_to_smem(h_ref.at[bh, c, :, cols], h_s.at[kh], bar.at[0])
            plgpu.copy_gmem_to_smem(dh_ref.at[bh, c, :, cols], dh_s.at[kh], bar.at[0])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, hh], do_s, bar.at[0])

        # the fp32 operands, rounded to bf16 while the loads fly (A also split for the exact dots)
        for kh in range(KH):
            w_s.at[kh][...] = ld(w_ref.at[bh, rows, pl.ds(kh * HALF, HALF)]).astype(BF16)
        du_s[...] = ld(du_ref.at[bh, rows]).astype(BF16)
        _split(ld(A_ref.at[bh, rows]), a_hi, a_lo)
        beta_c = ld(beta_ref.at[bh, rows], _ROW)[:, None]
        r_i, c_i = _iota((C, C), 0), _iota((C, C), 1)
        plgpu.commit_smem()
        plgpu.barrier_wait(bar.at[0])

        def vp_dot(acc):                                  # W S = sum over halves W_h (St_h)^T
            for kh in range(KH):
                plgpu.wgmma(acc, w_s.at[kh], h_s.at[kh].T)
            return acc[...]
        vp_s[...] = (ld(u_ref.at[bh, rows]) - pl.run_scoped(vp_dot, plgpu.ACC((C, V), F32))).astype(BF16)
        plgpu.commit_smem()

        def daqk_dot(acc):                                # dO V'^T
            plgpu.wgmma(acc, do_s, vp_s.T)
            return acc[...]
        daqk_ref.at[bh, rows][...] = jnp.where(r_i >= c_i, pl.run_scoped(daqk_dot, plgpu.ACC((C, C), F32)), 0.0)

        dbeta = jnp.zeros((C,), F32)
        for kh in range(KH):
            cols = pl.ds(kh * HALF, HALF)
            g_h = ld(G_ref.at[b, rows, hh, cols])
            gl_v = ld(G_ref.at[b, c * C + C - 1, hh, cols], _COL)
            q_h = ld(q_ref.at[b, rows, hh, cols])
            k_h = ld(k_ref.at[b, rows, hh, cols])
            eg = jnp.exp(g_h)

            def half_dots(a_kd, a_qg, a_dw):          # V' dS^T, dO S^T, dU S^T on this half
                plgpu.wgmma(a_kd, vp_s, dh_s.at[kh])
                plgpu.wgmma(a_qg, do_s, h_s.at[kh])
                plgpu.wgmma(a_dw, du_s, h_s.at[kh])
                return a_kd[...], a_qg[...], a_dw[...]
            dkd, dqg, dw = pl.run_scoped(half_dots, *[plgpu.ACC((C, HALF), F32)] * 3)
            # w_s's half kh is free: every warp's wgmma reading it (V') finished before the commit
            # that followed vp_s's store
            w_s.at[kh][...] = (-dw).astype(BF16)
            x = beta_c * eg * k_h
            x_s.at[kh][...] = x.astype(BF16)
            plgpu.commit_smem()

            dq = scale * eg * dqg
            dk = jnp.exp(gl_v[None, :] - g_h) * dkd
            t = k_h * dk
            dG = q_h * dq - t
            st = _load(h_s.at[kh], smem=True)
            dst = _load(dh_s.at[kh], smem=True)
            dgl = jnp.exp(gl_v) * jnp.sum(st * dst, axis=0) + jnp.sum(t, axis=0)

            def dx_dot(acc):                              # A^T dW on this half
                plgpu.wgmma(acc, a_hi.T, w_s.at[kh])
                return acc[...]
            dx = pl.run_scoped(dx_dot, plgpu.ACC((C, HALF), F32))
            dk = dk + beta_c * eg * dx
            dG = dG + x * dx
            dbeta = dbeta + jnp.sum(eg * k_h * dx, axis=1)
            dq_ref.at[bh, rows, cols][...] = dq
            dk_ref.at[bh, rows, cols][...] = dk
            dg_ref.at[bh, rows, cols][...] = dG
            dgl_ref.at[bh, c, cols][...] = dgl

        # the V side: Y = beta v into V''s buffer (its last wgmma reads finished before the commits above)
        v_c = ld(v_ref.at[b, rows, hh])
        vp_s[...] = (beta_c * v_c).astype(BF16)
        plgpu.commit_smem()

        def dy_da_dots(a_dy, a_da):                       # A^T dU; dW X^T + dU Y^T
            plgpu.wgmma(a_dy, a_hi.T, du_s)
            for kh in range(KH):
                plgpu.wgmma(a_da, w_s.at[kh], x_s.at[kh].T)
            plgpu.wgmma(a_da, du_s, vp_s.T)
            return a_dy[...], a_da[...]
        dy, dA = pl.run_scoped(dy_da_dots, plgpu.ACC((C, V), F32), plgpu.ACC((C, C), F32))
        dv_ref.at[b, rows, hh][...] = (beta_c * dy).astype(dv_ref.dtype)
        dbeta = dbeta + jnp.sum(v_c * dy, axis=1)

        if "dL" in ablate:                                # profiling: the exact dL products skipped
            dL = jnp.where(r_i > c_i, -dA, 0.0)
        else:
            dL = _dl(dA, r_i, c_i, a_hi, a_lo, t_hi, t_lo)
        dbeta = dbeta + jnp.sum(dL * ld(M_ref.at[bh, rows]), axis=1)
        dm_ref.at[bh, rows][...] = beta_c * dL
        dbeta_ref.at[bh, rows][...] = dbeta

    out_type = (jax.ShapeDtypeStruct((B, T, H, V), BF16), jax.ShapeDtypeStruct((BH, T), F32),
                *[jax.ShapeDtypeStruct((BH, T, K), F32)] * 3, jax.ShapeDtypeStruct((BH, NT, K), F32),
                *[jax.ShapeDtypeStruct((BH, T, C), F32)] * 2)
    kernel = plgpu.kernel(
        body, out_type=out_type,
        scratch_types=[_operand((KH, V, HALF)), _operand((KH, V, HALF)), _operand((C, V)),
                       _operand((KH, C, HALF)), _operand((C, V)), _operand((C, V)), _operand((KH, C, HALF)),
                       _operand((C, C)), _operand((C, C)), _operand((C, C)), _operand((C, C)),
                       plgpu.Barrier(num_arrivals=2 * KH + 1, num_barriers=1)],
        grid=(BH, NT), grid_names=("bh", "c"), interpret=interpret_params(interpret))
    flat = lambda x: x.reshape(BH, *x.shape[2:])   # noqa: E731  (free: leading dims merged)
    beta_hm = jnp.swapaxes(beta, 1, 2).reshape(BH, T).astype(F32)   # head-major rows for one load each
    dv, dbeta, dq, dk, dg, dgl, dm, daqk = kernel(
        q, k, v, G, beta_hm, do, flat(du), flat(h), flat(dh), flat(w), flat(u), flat(A), flat(M))
    hm = lambda x: x.reshape(B, H, *x.shape[1:])   # noqa: E731
    return (dv, jnp.swapaxes(dbeta.reshape(B, H, T), 1, 2), hm(dq), hm(dk), hm(dg), hm(dgl), hm(dm),
            hm(daqk))
