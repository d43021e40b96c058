"""Kimi Delta Attention layer (Kimi Linear's KDA mixer) as a flax NNX module.

Source: Kimi Linear (arXiv 2510.26692) §3 and fla `fla/layers/kda.py` (`KimiDeltaAttention`):
q, k, v = SiLU(ShortConv(W x)) with a depthwise causal conv of kernel 4; q, k L2-normalised;
beta = sigmoid(W_beta x); the log-decay comes from a low-rank projection (d_model -> head_dim -> H*K)
through `kda_gate` (bounded K3 gate by default, or Kimi Linear's softplus gate); the output is
RMS-normalised per head, gated by sigmoid(low-rank projection of x), and projected back to d_model.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.ops.kda import kda, kda_decode_step, kda_gate, kda_gate_init
from k3jax.ops.kda_chunked import validate_lower_bound
from k3jax.ops.kda_reference import segment_restarts

__all__ = ["KimiDeltaAttention", "short_causal_conv"]


def short_causal_conv(x: jax.Array, weight: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Depthwise causal conv y_t = sum_s weight[W-1-s] * x_{t-s} (s = 0..W-1) within one document.

    x [B, T, C]; weight [W, C] (W = kernel size; weight[-1] multiplies the current token);
    segment_ids [B, T] int or None. Taps that reach back across a change of segment id read zero,
    so nothing leaks between packed documents. Computed in x's dtype.
    """
    B, T, _ = x.shape
    W = weight.shape[0]
    run = jnp.cumsum(segment_restarts(segment_ids, B, T).astype(jnp.int32), axis=1)
    y = x * weight[-1].astype(x.dtype)
    for s in range(1, W):
        x_s = jnp.pad(x, [(0, 0), (s, 0), (0, 0)])[:, :T]
        run_s = jnp.pad(run, [(0, 0), (s, 0)], constant_values=-1)[:, :T]
        y = y + jnp.where((run_s == run)[..., None], x_s, 0) * weight[W - 1 - s].astype(x.dtype)
    return y


# One jit per (kernel, shapes): the KDA layers of an unrolled model share one traced jaxpr forward and
# backward, so JAX lowers each of jla's Mosaic GPU conv kernels once per model, not 3 per layer.
@functools.partial(jax.jit, static_argnames=("conv", "head_dim"))
def _jla_conv(y, weight, segment_ids, *, conv, head_dim: int | None):
    """`conv` (jla's short_conv, or short_conv_l2norm with `head_dim`) on y [B, T, H·K], weight [H·K, W]."""
    if head_dim is None:
        return conv(y, weight, segment_ids=segment_ids)
    return conv(y, weight, head_dim=head_dim, segment_ids=segment_ids)


def _jla_conv_kernels(x: jax.Array, head_dim: int, conv_size: int):
    """``((short_conv, short_conv_l2norm), None)``: jla's Mosaic GPU short-conv kernel modules when they
    take a ``[B, T, H·K]`` projection with this head_dim and conv_size (sm_90, bf16, one device), else
    ``(None, why not)``."""
    try:
        from jla.ops.mosaic_gpu import short_conv, short_conv_l2norm  # noqa: PLC0415 -- optional GPU dependency
    except ImportError as err:
        return None, f"jax-linear-attention is not importable ({err})"
    weight = jax.ShapeDtypeStruct((x.shape[-1], conv_size), jnp.float32)
    reason = short_conv_l2norm.unsupported_reason(x, weight, head_dim=head_dim)
    return (None, reason) if reason is not None else ((short_conv, short_conv_l2norm), None)


class KimiDeltaAttention(nnx.Module):
    """Kimi Linear KDA mixer: `[B, T, D] -> [B, T, D]`, with an fp32 recurrent-state cache for decoding.

    Args:
      d_model: model width D.
      num_heads: H.
      head_dim: K = V per head (128 in Kimi Linear).
      gate: "bounded" (g = lower_bound * sigmoid(exp(A_log) (W x + dt_bias)), declared to the op so the
        chunked op uses single-GEMM bf16 diagonal tiles) or "softplus" (Kimi Linear, unbounded, exact path).
      lower_bound: bound of the "bounded" gate, in [-5, 0).
      conv_size: short-conv kernel size (4).
      chunk_size: chunk length of the chunked op.
      implementation: passed to `k3jax.ops.kda.kda` (None = best available).
      conv_implementation: "xla" (`short_causal_conv`, then SiLU, then the op's q/k L2 norm) or "jla"
        (jax-linear-attention 0.1.0's Mosaic GPU kernels: short conv + SiLU + per-head L2 norm fused for
        q and k, short conv + SiLU for v; Hopper, bf16, one device). None: "jla" where its kernels take
        the call, else "xla".
      dtype: compute dtype of projections, conv and the q/k/v fed to the op (bf16 default); the
        gate, state and normalisation run in fp32.
      param_dtype: parameter dtype (fp32).
      rngs: nnx.Rngs with a "params" stream.

    Init (fla): A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1];
    linear weights N(0, fan_in^-1/2); conv weights U(-1/sqrt(W), 1/sqrt(W)); RMSNorm weight 1.

    Raises:
      ValueError: unknown gate or conv_implementation, lower_bound outside [-5, 0).
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int = 128, *, gate: str = "bounded",
                 lower_bound: float = -5.0, conv_size: int = 4, chunk_size: int = 64,
                 implementation: str | None = None, conv_implementation: str | None = None,
                 dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if gate not in ("bounded", "softplus"):
            raise ValueError(f"gate must be 'bounded' or 'softplus'; got {gate=}")
        if conv_implementation not in (None, "xla", "jla"):
            raise ValueError(f"conv_implementation must be None, 'xla' or 'jla'; got {conv_implementation=}")
        self.conv_implementation = conv_implementation
        validate_lower_bound(lower_bound)
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        self.gate, self.lower_bound = gate, float(lower_bound)
        self.conv_size, self.chunk_size, self.implementation = conv_size, chunk_size, implementation
        self.dtype, self.param_dtype = dtype, param_dtype
        H, K = num_heads, head_dim

        def linear(n_in, n_out, bias=False):
            return nnx.Linear(n_in, n_out, use_bias=bias, kernel_init=nnx.initializers.normal(n_in ** -0.5),
                              dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.q_proj, self.k_proj, self.v_proj = linear(d_model, H * K), linear(d_model, H * K), linear(d_model, H * K)
        bound = 1.0 / math.sqrt(conv_size)
        self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (conv_size, 3 * H * K), param_dtype,
                                                        -bound, bound))
        self.f_proj_a, self.f_proj_b = linear(d_model, K), linear(K, H * K)       # gate: D -> K -> H*K
        self.b_proj = linear(d_model, H)
        self.g_proj_a, self.g_proj_b = linear(d_model, K), linear(K, H * K, bias=True)   # output gate
        A_log, dt_bias = kda_gate_init(rngs.params(), rngs.params(), H, K, dtype=param_dtype)
        self.A_log, self.dt_bias = nnx.Param(A_log), nnx.Param(dt_bias)
        self.o_norm_weight = nnx.Param(jnp.ones((K,), param_dtype))
        self.o_proj = linear(H * K, d_model)

    # ------------------------------------------------------------------------------- pieces
    def _projections(self, x):
        """x [B, T, D] -> pre-conv q|k|v [B, T, 3HK] (compute dtype): one GEMM against the three kernels
        side by side, so neither direction concatenates or slices [B, T, 3HK] activations."""
        kernel = jnp.concatenate([p.kernel[...] for p in (self.q_proj, self.k_proj, self.v_proj)], axis=1)
        return jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))

    def _gates(self, x):
        """x [B, T, D] -> (g [B,T,H,K] fp32, beta [B,T,H] fp32, output-gate logits [B,T,H,K])."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        g_raw = self.f_proj_b(self.f_proj_a(x)).reshape(B, T, H, K)
        g = kda_gate(g_raw, self.A_log[...], self.dt_bias[...],
                     lower_bound=self.lower_bound if self.gate == "bounded" else None)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(jnp.float32))
        gate_out = self.g_proj_b(self.g_proj_a(x)).reshape(B, T, H, K)
        return g, beta, gate_out

    def _split_qkv(self, qkv):
        B, T, _ = qkv.shape
        q, k, v = jnp.split(jax.nn.silu(qkv), 3, axis=-1)
        shape = (B, T, self.num_heads, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.reshape(shape)

    def _output(self, o, gate_out):
        """Sigmoid-gated per-head RMSNorm (fp32) then the output projection. o, gate_out [B,T,H,K]."""
        B, T = o.shape[:2]
        o = o.astype(jnp.float32)
        o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + 1e-5) * self.o_norm_weight[...]
        o = o * jax.nn.sigmoid(gate_out.astype(jnp.float32))
        return self.o_proj(o.reshape(B, T, -1).astype(self.dtype))

    def _lower_bound(self):
        return self.lower_bound if self.gate == "bounded" else None

    # ------------------------------------------------------------------------------- interface
    def __call__(self, x, *, segment_ids, positions):
        """x [B, T, D], segment_ids [B, T] int32 (state and conv restart at every change of id),
        positions [B, T] int32 (unused: KDA needs no positions) -> [B, T, D] in the compute dtype.

        Raises ValueError when conv_implementation="jla" and jla's kernels do not take the call (with
        jla's reason: not importable, not an sm_90 GPU, several devices, a dtype or shape they lack)."""
        del positions
        x = x.astype(self.dtype)
        qkv = self._fused_conv(x, segment_ids) if self.conv_implementation != "xla" else None
        if qkv is None:
            q, k, v = self._split_qkv(short_causal_conv(self._projections(x), self.conv_weight[...], segment_ids))
        else:
            q, k, v = qkv
        g, beta, gate_out = self._gates(x)
        o, _ = kda(q, k, v, g, beta, segment_ids=segment_ids, use_qk_l2norm=qkv is None,
                   lower_bound=self._lower_bound(), chunk_size=self.chunk_size, implementation=self.implementation)
        return self._output(o, gate_out)

    def _fused_conv(self, x, segment_ids):
        """(q, k, v) [B, T, H, K] from jla's kernels, q and k already L2-normalised; None where they do not
        take the call (conv_implementation None) or raises ValueError ("jla")."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        like = jax.ShapeDtypeStruct((B, T, H * K), self.dtype)
        kernels, reason = _jla_conv_kernels(like, K, self.conv_size)
        if kernels is None:
            if self.conv_implementation == "jla":
                raise ValueError(f"conv_implementation='jla': jla's short-conv kernels do not take [B, T, H*K] = "
                                 f"{like.shape} {like.dtype} with head_dim={K}, conv_size={self.conv_size}: {reason}")
            return None
        short_conv, short_conv_l2norm = kernels
        weights = jnp.split(self.conv_weight[...], 3, axis=1)  # [W, HK] each; jla's layout is [HK, W]
        out = []
        for i, proj in enumerate((self.q_proj, self.k_proj, self.v_proj)):
            y = jnp.dot(x, proj.kernel[...].astype(self.dtype))
            if i < 2:
                y = _jla_conv(y, weights[i].T, segment_ids, conv=short_conv_l2norm.short_conv_l2norm, head_dim=K)
            else:
                y = _jla_conv(y, weights[i].T, segment_ids, conv=short_conv.short_conv, head_dim=None)
            out.append(y.reshape(B, T, H, K))
        return tuple(out)

    def init_cache(self, batch_size: int, max_len: int):
        """{"conv": [B, conv_size - 1, 3HK] last pre-conv inputs (compute dtype), "state": [B, H, K, V]
        fp32}. max_len is unused: the cache does not grow with the sequence."""
        del max_len
        H, K = self.num_heads, self.head_dim
        return {"conv": jnp.zeros((batch_size, self.conv_size - 1, 3 * H * K), self.dtype),
                "state": jnp.zeros((batch_size, H, K, K), jnp.float32)}

    def decode(self, x, cache, *, position):
        """One token per row: x [B, 1, D], position [B] int32 -> (y [B, 1, D], cache).

        A row with position 0 starts a new sequence: its conv buffer and state are reset first.
        """
        x = x.astype(self.dtype)
        fresh = (position == 0)
        conv_buf = jnp.where(fresh[:, None, None], 0, cache["conv"]).astype(self.dtype)
        state = jnp.where(fresh[:, None, None, None], 0.0, cache["state"])
        qkv_t = self._projections(x)                                               # [B, 1, 3HK]
        window = jnp.concatenate([conv_buf, qkv_t], axis=1)                       # [B, W, 3HK]
        qkv = jnp.sum(window * self.conv_weight[...].astype(self.dtype), axis=1, keepdims=True)
        q, k, v = self._split_qkv(qkv)
        g, beta, gate_out = self._gates(x)
        o, state = kda_decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state, use_qk_l2norm=True)
        y = self._output(o[:, None], gate_out)
        return y, {"conv": window[:, 1:], "state": state}
