"""Pallas KDA (Kimi Delta Attention) chunk kernels: `kda_pallas` (custom_vjp), `supported`, `kda_plan`.

Layout: api.py (the op, padding, custom_vjp), plan.py (which backend runs each stage; tuning
values), triton/ (portable kernels by stage), mosaic_gpu/ (sm_90 kernels by stage),
sequence_split.py. Design: docs/kda_kernels.md. Never imports k3jax.
"""
from pallas_kernels.kda.api import kda_pallas, kda_plan, supported
from pallas_kernels.kda.plan import BACKENDS, CHUNK_SIZE, Plan, Tuning

__all__ = ["kda_pallas", "kda_plan", "supported", "BACKENDS", "CHUNK_SIZE", "Plan", "Tuning"]
