"""Pallas kernels of Block AttnRes's depth attention: `depth_attention_pallas` (custom_vjp), `supported`.

api.py (the op: call forms, custom_vjp), kernels.py (the forward and backward kernel bodies). Design:
docs/attnres.md. Never imports k3jax.
"""
from pallas_kernels.depth_attention.api import depth_attention_pallas, supported
from pallas_kernels.depth_attention.kernels import Tuning

__all__ = ["depth_attention_pallas", "supported", "Tuning"]
