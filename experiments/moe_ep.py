"""Expert parallelism of the MoE layer on every local device: correctness against one device, then
forward+backward throughput, 1 device vs N devices.

  python -m experiments.moe_ep --out=$OUT/moe_ep_h200x2
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m experiments.moe_ep --tokens=256 \
      --d_model=128 --d_ff=128 --experts=8 --top_k=2 --iters=2 --out=/tmp/moe_ep_cpu   # CPU check

The layer is `k3jax.nn.MoEFeedForward` (bf16 experts, fp32 router, `--balancing`) on `[batch, T, D]`
tokens. Expert parallel = the same module with `mesh=make_mesh(data, N / data)`: tokens sharded over
(data, expert), experts over "expert", two all_to_all per call (`expert_parallel_dropless_moe`, send
buffers padded to the worst case). Both modules get the same initial parameters; the check compares
the output, the balancing loss, the next router bias and the gradients of the input and of every
parameter as RMS(ep - ref)/RMS(ref), asserts each is below `--tol`, and prints them. Throughput:
median of `--iters` timed `value_and_grad` calls after 3 warm-ups, tokens/s of the whole batch.
Results go to `<out>.json` and `<out>.md` with date, device and versions.
"""
import json
import os
import time

import numpy as np
from absl import app, flags

from experiments.harness import VERSIONED, median_ms, package_versions


_OUT = flags.DEFINE_string("out", "/tmp/k3jax_moe_ep/moe_ep", "Output path prefix (.json, .md); the committed "
                           "table is --out=experiments/results/moe_ep_h200x2.")
_TOKENS = flags.DEFINE_integer("tokens", 16384, "Tokens per call (batch x T).")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per call; must divide by the device count.")
_D = flags.DEFINE_integer("d_model", 2048, "Model width D.")
_F = flags.DEFINE_integer("d_ff", 1024, "Hidden width of one expert.")
_E = flags.DEFINE_integer("experts", 64, "Routed experts; must divide by the expert axis.")
_K = flags.DEFINE_integer("top_k", 8, "Experts per token.")
_BALANCING = flags.DEFINE_string("balancing", "quantile", "Balancing method (k3jax.ops.balancing.METHODS).")
_IMPL = flags.DEFINE_string("dispatch_implementation", None, "Grouped matmul (None = default for the call).")
_DATA = flags.DEFINE_integer("data", 1, "Size of the data axis; the expert axis gets the rest of the devices.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed calls per measurement (median reported).")
_TOL = flags.DEFINE_float("tol", 2e-2, "Max relative RMS error of EP vs 1 device (output, loss, bias, grads).")


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = np.sqrt(np.mean(b**2))
    return float(np.sqrt(np.mean((a - b) ** 2)) / denom) if denom > 0 else float(np.abs(a - b).max())




def main(argv):
    del argv
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from k3jax import sharding as S
    from k3jax.nn.moe import MoEFeedForward
    from k3jax.ops import grouped_matmul
    from k3jax.ops.balancing import balancing_config

    devices = jax.devices()
    n_dev = len(devices)
    if n_dev < 2:
        raise ValueError(f"expert parallelism needs >= 2 devices; got {n_dev}")
    if n_dev % _DATA.value or _BATCH.value % n_dev or _TOKENS.value % _BATCH.value:
        raise ValueError(f"need devices % data == 0, batch % devices == 0, tokens % batch == 0; got "
                         f"{n_dev=}, {_DATA.value=}, {_BATCH.value=}, {_TOKENS.value=}")
    mesh = S.make_mesh(_DATA.value, n_dev // _DATA.value)
    batch, seq = _BATCH.value, _TOKENS.value // _BATCH.value
    d, f, e, k = _D.value, _F.value, _E.value, _K.value
    kw = dict(balancing=balancing_config(_BALANCING.value), dispatch_implementation=_IMPL.value,
              dtype=jnp.bfloat16)
    ref = MoEFeedForward(d, f, e, k, rngs=nnx.Rngs(0), **kw)
    ep = MoEFeedForward(d, f, e, k, rngs=nnx.Rngs(0), mesh=mesh, **kw)
    for name in ("w_gate", "w_up", "w_down"):
        v = getattr(ep, name)
        v.set_value(jax.device_put(v.get_value(), S.expert_sharding(mesh, 3)))
    for name in ("router", "router_bias"):
        v = getattr(ep, name)
        v.set_value(jax.device_put(v.get_value(), S.replicated(mesh)))
    if ep.balancing_state is not None:
        ep.balancing_state.set_value(jax.device_put(ep.balancing_state.get_value(), S.replicated(mesh)))

    x = jax.random.normal(jax.random.key(1), (batch, seq, d), jnp.float32).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), (batch, seq, d), jnp.float32)

    def make_step(module, cot):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)

        def loss(params, x):
            y, aux = nnx.merge(graphdef, params, rest)(x)
            return jnp.sum(y.astype(jnp.float32) * cot) + aux["loss"], (y, aux["loss"], aux["next_bias"])

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)), params

    step_ref, params_ref = make_step(ref, cot)
    step_ep, params_ep = make_step(ep, jax.device_put(cot, S.token_sharding(mesh, 3)))
    x_ep = jax.device_put(x, S.token_sharding(mesh, 3))
    rows_m = batch * seq * k
    probe = (jax.ShapeDtypeStruct((rows_m, d), jnp.bfloat16), jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16),
             jax.ShapeDtypeStruct((e,), jnp.int32))
    resolved = _IMPL.value or grouped_matmul.default_implementation(*probe)

    t0 = time.perf_counter()
    (_, (y0, l0, b0)), (g0, gx0) = step_ref(params_ref, x)
    (_, (y1, l1, b1)), (g1, gx1) = step_ep(params_ep, x_ep)
    errors = {"output": _rel(y1, y0), "balance_loss": _rel(l1, l0), "next_bias": _rel(b1, b0), "d_x": _rel(gx1, gx0)}
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
        keys = (getattr(p, "key", getattr(p, "name", p)) for p in path)
        errors["d_" + ".".join(str(key) for key in keys if key != "value")] = _rel(b, a)
    print(f"compile + first calls {time.perf_counter() - t0:.1f} s; relative RMS errors EP vs 1 device:", flush=True)
    for name, err in errors.items():
        print(f"  {name:24s} {err:.2e}", flush=True)

    tokens = batch * seq
    ms_1 = median_ms(step_ref, params_ref, x, iters=_ITERS.value)
    ms_n = median_ms(step_ep, params_ep, x_ep, iters=_ITERS.value)
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": devices[0].device_kind,
        "num_devices": n_dev, "mesh": dict(mesh.shape), "versions": package_versions(VERSIONED),
        "shape": dict(batch=batch, seq=seq, tokens=tokens, d_model=d, d_ff=f, experts=e, top_k=k),
        "balancing": _BALANCING.value, "grouped_matmul": resolved, "tol": _TOL.value, "errors": errors,
        "max_error": max(errors.values()),
        "fwdbwd_ms_1dev": ms_1, "fwdbwd_ms_ep": ms_n,
        "tokens_per_s_1dev": tokens / ms_1 * 1e3, "tokens_per_s_ep": tokens / ms_n * 1e3, "speedup": ms_1 / ms_n,
    }
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value + ".json", "w") as fh:
        json.dump(results, fh, indent=1)
    lines = [f"# MoE expert parallelism, {n_dev} x {results['device']}, {results['date']}", "",
             f"Versions: {results['versions']}", "",
             f"MoEFeedForward: {tokens} tokens ({batch} x {seq}), d_model {d}, expert d_ff {f}, {e} experts, top-{k}, "
             f"{_BALANCING.value} balancing, bf16 experts, grouped matmul `{resolved}`; mesh {dict(mesh.shape)}. "
             "Forward+backward (input and all parameters), median.", "",
             "| setup | fwd+bwd ms | tokens/s |", "|---|---|---|",
             f"| 1 device | {ms_1:.2f} | {results['tokens_per_s_1dev']:.3g} |",
             f"| {n_dev} devices, expert parallel | {ms_n:.2f} | {results['tokens_per_s_ep']:.3g} |", "",
             f"Speed-up {results['speedup']:.2f}x. EP vs 1 device, relative RMS error (tolerance {_TOL.value:g}):", "",
             "| quantity | error |", "|---|---|"]
    lines += [f"| {name} | {err:.2e} |" for name, err in errors.items()]
    with open(_OUT.value + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    bad = {name: err for name, err in errors.items() if not err <= _TOL.value}
    if bad:
        raise AssertionError(f"expert-parallel result differs from 1 device beyond tol={_TOL.value}: {bad}")


if __name__ == "__main__":
    app.run(main)
