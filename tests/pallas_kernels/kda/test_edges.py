"""Edge cases of the exact diagonal tiles for unbounded gates (lower_bound=None; the Triton kernels'
triton/common.own_block_scores and triton/intra_bwd._own_block_bwd), interpret mode on CPU, against the
fp32 recurrence: o, final state and every gradient (dh0 included) at T < 16 and T not a multiple of
64, K and V not powers of two and different (padded to 16), an initial state, packed documents of
length 1 at the 16-token tile edges and the 64-token chunk edges and a document per token,
sequence_split 1 and None, gates exactly 0, a single very negative gate (g = -1e4), beta exactly 0
and 1, fp32 and bf16.

Known limit (not a kernel bug; measured, asserted in test_single_huge_gate_fp32): a single gate
g = -1e4 followed by mild gates in the same chunk costs fp32 inputs 1.5e-4 .. 6.7e-4 RMS ratio
(> FP32_TOLERANCE) in o, the final state and every gradient but dh0. The chunk form works with the chunk-local cumsum G (~ -1e4 after that token) and
exps of differences G_i - G_j of two numbers ~1e4, whose fp32 rounding (ulp(1e4) ~ 1e-3) is an
error in the decay exponents of the mild tokens. k3jax's XLA kda_chunked has the same error (the
two agree to 5e-8) and fla's chunk kernels use the same chunk-local cumsum; the token-by-token
recurrence has none (vs an fp64 recurrence: 1.2e-7). The same effect gives
dg 6.7e-5 for fp32 softplus gates x30 (g down to ~-2700 per token).
Measured errors are in each test's comment (interpret mode, jax 0.11.2, CPU).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda import kda_chunked, kda_recurrent
from pallas_kernels.kda import kda_pallas
from tests.kda_testing import (FLA_BF16_TOLERANCES, FP32_TOLERANCE, GRAD_NAMES, assert_rms_close,
                               kda_loss_and_grads, make_kda_inputs, rms_ratio, fp32_tolerance)

K, V = 12, 7            # not powers of two, different: padded to 16 and 16


def _doc_ids(cuts, T):
    """[1, T] int32 segment ids with documents [cuts[i], cuts[i+1]) (consecutive ids differ)."""
    seg = np.zeros((1, T), np.int32)
    for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
        seg[0, s:e] = i % 2 + 1
    return jnp.asarray(seg)


def _cotangents(x):
    B, T, H, Kx = x["q"].shape
    Vx = x["v"].shape[-1]
    return (jax.random.normal(jax.random.PRNGKey(101), (B, T, H, Vx)),
            jax.random.normal(jax.random.PRNGKey(102), (B, H, Kx, Vx)))


@functools.partial(jax.jit, static_argnames=("kw",))
def _pallas_jit(x, seg, do, dht, kw):
    kw = dict(kw, output_final_state=True, segment_ids=seg, interpret=True, backend="triton")
    return kda_loss_and_grads(
        lambda q, k, v, g, b, h0: kda_pallas(q, k, v, g, b, initial_state=h0, **kw), x, do, dht)


@jax.jit
def _recurrent_jit(x, seg, do, dht):
    return kda_loss_and_grads(
        lambda q, k, v, g, b, h0: kda_recurrent(q, k, v, g, b, initial_state=h0, output_final_state=True,
                                                segment_ids=seg), x, do, dht)


def _pallas(x, seg, **kw):
    """(o, final state, grads) of kda_pallas in interpret mode (compiled once per shape and kw)."""
    return _pallas_jit(x, seg, *_cotangents(x), tuple(sorted(kw.items())))


def _recurrent(x, seg):
    """(o, final state, grads) of the fp32 recurrence on x cast to fp32."""
    return _recurrent_jit({n: a.astype(jnp.float32) for n, a in x.items()}, seg, *_cotangents(x))


def _assert_close(ref, out, tol):
    """o, ht and every gradient of out within tol(name) of ref (fla's RMS ratio); returns the errors."""
    errs = {"o": assert_rms_close("o", ref[0], out[0], tol("o")),
            "ht": assert_rms_close("ht", ref[1], out[1], tol("ht"))}
    for name in GRAD_NAMES:
        assert float(jnp.max(jnp.abs(ref[2][name].astype(jnp.float32)))) > 0, name   # not vacuous
        errs[name] = assert_rms_close(name, ref[2][name], out[2][name], tol(name))
    return errs


def _tolerance(dtype):
    return fp32_tolerance if dtype == jnp.float32 else FLA_BF16_TOLERANCES.get


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6))
def _inputs(key, B, T, H, Kx=K, Vx=V, dtype=jnp.float32, gate_scale=1.0):
    """make_kda_inputs with softplus (unbounded) gates times gate_scale, and the edges every test
    shares: g exactly 0 on every 3rd token (from token 1), beta exactly 0 on every 4th (from token
    2) and exactly 1 on every 4th (from token 3)."""
    x = make_kda_inputs(jax.random.PRNGKey(key), B, T, H, Kx, Vx, gate="softplus")   # one jit per shape
    x["g"] = (gate_scale * x["g"]).at[:, 1::3].set(0.0)
    x["beta"] = x["beta"].at[:, 2::4].set(0.0).at[:, 3::4].set(1.0)
    out = {n: a.astype(dtype) for n, a in x.items() if n != "h0"}
    out["h0"] = x["h0"]
    return out


def test_unbounded_documents_at_tile_and_chunk_edges_fp32():
    # T = 65 (2 chunks, the second with one real token); row 0: length-1 documents at tokens 15, 16
    # (either side of the first tile edge), 63, 64 (either side of the chunk edge) and the last
    # token; row 1: a document per token (every token restarts the state); sequence_split=1 (each
    # chunk its own segment of the split state passes). Gates x0.2 so that the state really crosses
    # the edges. Measured: <= 1.5e-6.
    T = 65
    x = _inputs(2, 2, T, 1, gate_scale=0.2)
    seg = jnp.concatenate([_doc_ids([0, 15, 16, 17, 63, 64, 65], T), jnp.arange(T, dtype=jnp.int32)[None]])
    _assert_close(_recurrent(x, seg), _pallas(x, seg, lower_bound=None, sequence_split=1),
                  _tolerance(jnp.float32))


def test_unbounded_shorter_than_a_tile():
    # T = 15 < 16: one partly padded 16-row tile in one padded chunk; fp32, initial state.
    # Measured: <= 1.4e-6 (T = 1, tried once, not kept for time: <= 1.2e-7).
    T = 15
    x = _inputs(1, 1, T, 1)
    assert float(jnp.min(x["g"])) < -5             # the gates really are beyond any bound
    _assert_close(_recurrent(x, None), _pallas(x, None, lower_bound=None), _tolerance(jnp.float32))


def test_single_huge_gate_fp32():
    # The known limit of the chunk form (module docstring): g = -1e4 at token 4, mild gates after
    # it, fp32; the shape of test_unbounded_shorter_than_a_tile (one compile for both). Measured
    # vs the recurrence (RMS ratio): o 1.6e-4, ht 3.6e-4, dq 1.5e-4, dk 4.8e-4, dv 3.6e-4, dg 2.4e-4,
    # dbeta 6.7e-4, dh0 7.7e-8; asserted <= 2e-3 (and > FP32_TOLERANCE on o, to keep this comment
    # true), finite. The same error as k3jax's XLA chunk form (o: pallas vs kda_chunked 4.8e-8,
    # asserted 1e-5), i.e. the shared cumsum arithmetic, not the kernels. (At T = 130 with the
    # gate at token 70: 2.3e-4 .. 4.1e-4; at token 63, the last of a chunk, where the cumsum
    # restarts right after it: 4.4e-7, within FP32_TOLERANCE.)
    T = 15
    x = _inputs(1, 1, T, 1, gate_scale=0.05)
    x["g"] = x["g"].at[:, 4].set(-1e4)
    out = _pallas(x, None, lower_bound=None)
    errs = _assert_close(_recurrent(x, None), out, lambda name: 2e-3)
    assert errs["o"] > FP32_TOLERANCE
    o_chunked, _ = jax.jit(lambda q, k, v, g, b, h0: kda_chunked(q, k, v, g, b, initial_state=h0))(
        *(x[n] for n in ("q", "k", "v", "g", "beta", "h0")))
    assert rms_ratio(o_chunked, out[0]) <= 1e-5


def test_unbounded_bf16_huge_gate_and_documents():
    # bf16: T = 130 (3 chunks, the last padded), V = 33, one gate g = -1e4 at token
    # 70 (mid-tile of chunk 1), length-1 documents at the chunk edges, one serial state pass
    # (sequence_split=None leaves this shape unsplit). Measured: o 4.5e-3 (tol 5e-3; bf16 o at
    # these shapes measured 3.1e-3 .. 4.5e-3 with or without the huge gate), ht 1.6e-3, dq, dk, dv,
    # dbeta, dh0 4.0e-3 .. 4.7e-3 (tol 8e-3), dg 8.8e-3 (tol 2e-2).
    T = 130
    x = _inputs(3, 1, T, 1, Vx=33, dtype=jnp.bfloat16, gate_scale=0.05)
    x["g"] = x["g"].at[:, 70].set(-1e4)
    seg = _doc_ids([0, 63, 64, 65, 127, 128, 129, T], T)
    _assert_close(_recurrent(x, seg), _pallas(x, seg, lower_bound=None), _tolerance(jnp.bfloat16))
