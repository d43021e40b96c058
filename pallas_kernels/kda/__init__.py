"""Pallas KDA kernels."""
