"""KDA ops: the oracle against an fp64 numpy loop, and every implementation against the oracle.

`KDAImplementationTests` holds the comparisons; each implementation subclasses it and sets
`implementation` (and, if needed, overrides `run`). The oracle (`kda_recurrent`) is itself checked
against a plain fp64 numpy loop and the decode step.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import kda, kda_chunked, kda_decode_step, kda_gate, kda_recurrent
from tests.kda_shared_tests import KDAImplementationTests, numpy_kda
from tests.kda_testing import make_kda_inputs


# ----------------------------------------------------------------------------------------- oracle
def test_recurrent_matches_fp64_numpy_loop():
    x = make_kda_inputs(jax.random.PRNGKey(1), 2, 37, 2, 6, 5, gate="softplus")
    seg = np.array([[0] * 10 + [1] * 20 + [0] * 7, [3] * 37])
    o, ht = jax.jit(lambda x, seg: kda_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                                 output_final_state=True, segment_ids=seg))(
        x, jnp.asarray(seg, jnp.int32))
    o_ref, ht_ref = numpy_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"], seg, 6 ** -0.5)
    np.testing.assert_allclose(o, o_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ht, ht_ref, rtol=1e-4, atol=1e-5)


def test_decode_chain_equals_recurrence():
    x = make_kda_inputs(jax.random.PRNGKey(2), 2, 29, 3, 8, 12, gate="bounded")
    o_ref, ht_ref = jax.jit(lambda x: kda_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                                    output_final_state=True, use_qk_l2norm=True))(x)
    step = jax.jit(functools.partial(kda_decode_step, use_qk_l2norm=True))
    S, outs = x["h0"], []
    for t in range(29):
        o_t, S = step(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t], x["beta"][:, t], S)
        outs.append(o_t)
    np.testing.assert_allclose(jnp.stack(outs, axis=1), o_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(S, ht_ref, rtol=1e-5, atol=1e-5)
    assert S.dtype == jnp.float32


# ------------------------------------------------------------------------------------------- gate
def test_gate_values_both_parameterisations():
    rng = np.random.default_rng(0)
    g_raw = rng.normal(size=(2, 5, 3, 4)).astype(np.float32) * 4
    A_log = rng.normal(size=(3,)).astype(np.float32)
    dt_bias = rng.normal(size=(12,)).astype(np.float32)
    x = g_raw + dt_bias.reshape(3, 4)
    A = np.exp(A_log)[:, None]
    soft = -A * np.logaddexp(0.0, x)
    bounded = -3.5 / (1.0 + np.exp(-A * x))
    np.testing.assert_allclose(kda_gate(g_raw, A_log, dt_bias), soft, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kda_gate(g_raw, A_log, dt_bias.reshape(3, 4), lower_bound=-3.5), bounded,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kda_gate(g_raw, A_log), -A * np.logaddexp(0.0, g_raw), rtol=1e-5, atol=1e-6)
    gb = kda_gate(jnp.asarray(g_raw, jnp.bfloat16) * 100, A_log, lower_bound=-5.0)
    assert gb.dtype == jnp.float32
    assert float(gb.min()) >= -5.0 and float(gb.max()) <= 0.0


@pytest.mark.parametrize("lower_bound", [-5.5, 0.0, 0.3, -10])
def test_gate_rejects_lower_bound_outside_range(lower_bound):
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(jnp.zeros((1, 2, 3, 4)), jnp.zeros((3,)), lower_bound=lower_bound)


@pytest.mark.parametrize("arg,kwargs", [("A_log", dict(A_log=jnp.zeros((4,)))),
                                        ("dt_bias", dict(dt_bias=jnp.zeros((5,)))),
                                        ("g_raw", dict(g_raw=jnp.zeros((2, 3, 4))))])
def test_gate_rejects_bad_shapes(arg, kwargs):
    args = dict(g_raw=jnp.zeros((1, 2, 3, 4)), A_log=jnp.zeros((3,)), dt_bias=None) | kwargs
    with pytest.raises(ValueError, match=arg):
        kda_gate(args["g_raw"], args["A_log"], args["dt_bias"])


# ------------------------------------------------------------------------------- dispatch / inputs
_SMALL = dict(q=(1, 20, 2, 8), k=(1, 20, 2, 8), v=(1, 20, 2, 6), g=(1, 20, 2, 8), beta=(1, 20, 2))


@pytest.mark.parametrize("arg,change", [
    ("k", dict(k=(1, 20, 2, 7))), ("v", dict(v=(1, 19, 2, 6))), ("g", dict(g=(1, 20, 3, 8))),
    ("beta", dict(beta=(1, 20))), ("initial_state", dict(initial_state=(1, 2, 6, 8))),
    ("segment_ids", dict(segment_ids=(1, 21))), ("q", dict(q=(20, 2, 8))),
    ("q", dict(q=(1, 0, 2, 8), k=(1, 0, 2, 8), v=(1, 0, 2, 6), g=(1, 0, 2, 8), beta=(1, 0, 2))),
])
@pytest.mark.parametrize("implementation", ["recurrent", "chunked", "pallas"])
def test_bad_shapes_raise_naming_the_argument(arg, change, implementation):
    # "pallas": the shared checks run before dispatch (interpret=True, lower_bound declared, so that
    # only the shape is wrong).
    shapes = _SMALL | change
    arrays = {n: jnp.zeros(s) for n, s in shapes.items() if n in _SMALL}
    kwargs = {}
    if "initial_state" in shapes:
        kwargs["initial_state"] = jnp.zeros(shapes["initial_state"])
    if "segment_ids" in shapes:
        kwargs["segment_ids"] = jnp.zeros(shapes["segment_ids"], jnp.int32)
    if implementation == "pallas":
        kwargs.update(interpret=True, lower_bound=-5.0)
    with pytest.raises(ValueError, match=arg):
        kda(arrays["q"], arrays["k"], arrays["v"], arrays["g"], arrays["beta"], implementation=implementation,
            **kwargs)


@pytest.mark.parametrize("arg,kwargs", [
    ("chunk_size", dict(chunk_size=48)), ("chunk_size", dict(chunk_size=8)), ("chunk_size", dict(chunk_size=0)),
    ("lower_bound", dict(lower_bound=-6.0)), ("lower_bound", dict(lower_bound=0.0)),
    ("lower_bound", dict(lower_bound=1.0)), ("implementation", dict(implementation="triton")),
    ("implementation", dict(implementation="pallas")),
])
def test_bad_options_raise_naming_the_argument(arg, kwargs):
    arrays = {n: jnp.zeros(s) for n, s in _SMALL.items()}
    with pytest.raises(ValueError, match=arg):
        kda(*arrays.values(), **kwargs)
    if "implementation" not in kwargs:
        with pytest.raises(ValueError, match=arg):
            kda_chunked(*arrays.values(), **kwargs)


def test_decode_step_rejects_bad_shapes():
    q = jnp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="state"):
        kda_decode_step(q, q, jnp.zeros((2, 3, 5)), q, jnp.zeros((2, 3)), jnp.zeros((2, 3, 5, 4)))
    with pytest.raises(ValueError, match="beta"):
        kda_decode_step(q, q, jnp.zeros((2, 3, 5)), q, jnp.zeros((2,)), jnp.zeros((2, 3, 4, 5)))


@pytest.mark.parametrize("arg", ["q", "k", "v", "g", "beta", "initial_state"])
@pytest.mark.parametrize("implementation", [None, "recurrent", "chunked"])
def test_non_floating_inputs_raise_naming_the_argument(arg, implementation):
    # Issue 23: int32 q/k/v ran (output in int32 v's dtype, truncated).
    arrays = {n: jnp.ones(s) for n, s in _SMALL.items()} | {"initial_state": jnp.zeros((1, 2, 8, 6))}
    arrays[arg] = arrays[arg].astype(jnp.int32)
    with pytest.raises(ValueError, match=rf"{arg} must have a floating dtype .*got {arg}\.dtype=int32"):
        kda(*(arrays[n] for n in _SMALL), initial_state=arrays["initial_state"], implementation=implementation)


def _value_case(bad):
    """Small valid KDA inputs, then one broken value: NaN in g, g > 0, g below lower_bound=-5, NaN in v."""
    x = make_kda_inputs(jax.random.PRNGKey(5), 1, 20, 2, 8)  # bounded gate: g in (-5, 0)
    x = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    if bad == "nan_g":
        x["g"] = x["g"].at[0, 3, 1, 2].set(jnp.nan)
    elif bad == "positive_g":
        x["g"] = x["g"].at[0, 3, 1, 2].set(0.25)
    elif bad == "below_bound":
        x["g"] = x["g"].at[0, 3, 1, 2].set(-6.0)
    elif bad == "nan_v":
        x["v"] = x["v"].at[0, 0, 0, 0].set(jnp.nan)
    return x


_VALUE_MESSAGES = {"nan_g": r"kda: g must be finite; got 1 NaN/inf values of 320",
                   "positive_g": r"kda: g must be <= 0 \(log-decay in nats\); got max\(g\) = 0\.25",
                   "below_bound": r"kda: g must be >= lower_bound=-5\.0 .*got min\(g\) = -6\.0",
                   "nan_v": r"kda: v must be finite; got 1 NaN/inf values of 320"}


@pytest.mark.parametrize("bad", sorted(_VALUE_MESSAGES))
@pytest.mark.parametrize("implementation", ["recurrent", "chunked"])
def test_check_values_reports_the_broken_contract(bad, implementation):
    """Issue 23: NaN in g, g > 0, g below the declared bound passed silently (NaN or blown-up outputs).
    check_values=True raises eagerly and reports through checkify under jit; the default stays silent."""
    from jax.experimental import checkify
    x = _value_case(bad)
    kw = dict(lower_bound=-5.0 if bad == "below_bound" else None, implementation=implementation)
    kda(**x, **kw)  # the default checks shapes and dtypes only: no error
    with pytest.raises(ValueError, match=_VALUE_MESSAGES[bad]):
        kda(**x, **kw, check_values=True)
    checked = jax.jit(checkify.checkify(lambda x: kda(**x, **kw, check_values=True)))
    err, _ = checked(x)
    assert err.get() is not None and re.search(_VALUE_MESSAGES[bad], err.get())
    err, (o, _) = checked(_value_case("none"))
    assert err.get() is None and np.isfinite(np.asarray(o)).all()
    with pytest.raises(ValueError, match="checkify"):  # checks asked for under a plain jit: fails to trace
        jax.jit(lambda x: kda(**x, **kw, check_values=True))(x)


def test_default_implementation_is_chunked_and_matches():
    x = make_kda_inputs(jax.random.PRNGKey(3), 1, 40, 2, 16)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o_default, _ = jax.jit(lambda a: kda(*a))(args)
    o_chunked, _ = jax.jit(lambda a: kda_chunked(*a))(args)
    np.testing.assert_array_equal(o_default, o_chunked)


# ------------------------------------------------------------------------ implementation tests
class TestRecurrentOracle:
    """The oracle's own semantics beyond the numpy loop: padding blocks and dtypes."""

    def test_output_dtype_and_state(self):
        x = make_kda_inputs(jax.random.PRNGKey(9), 1, 70, 1, 8, dtype=jnp.bfloat16)
        o, ht = jax.jit(lambda x: kda_recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True))(x)
        assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32 and ht.shape == (1, 1, 8, 8)
        o2, _ = kda_recurrent(x["q"][:, :64], x["k"][:, :64], x["v"][:, :64], x["g"][:, :64], x["beta"][:, :64])
        np.testing.assert_array_equal(o[:, :64], o2)


class TestChunked(KDAImplementationTests):
    implementation = "chunked"


@pytest.mark.gpu
class TestChunkedGPU(TestChunked):
    """The chunked op compiled for the GPU (XLA:GPU keeps fp32 denormals; XLA:CPU flushes them): the
    loss-scale and small-input cases at T = 8192, K = V = 128."""

    loss_scale_shape = (1, 8192, 2, 128)
    test_matches_recurrent_on_fla_shapes = None
    test_segment_ids_equal_each_document_alone = None
    test_future_gates_do_not_change_past_outputs = None
    test_check_grads_fp64 = None
    test_odd_sizes_and_options = None
