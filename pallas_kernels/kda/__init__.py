"""Pallas KDA (Kimi Delta Attention) chunk kernels.

`ops.kda_pallas` (custom_vjp, forward and backward kernels) and `ops.supported`; the kernel bodies
are in `fwd.py` and `bwd.py`, the gate cumsum in `cumsum.py`, the sequence split in `split.py`, shared
in-kernel helpers in `common.py`. Never imports k3jax.
"""
