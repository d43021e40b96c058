"""The portable KDA kernels (`pl.pallas_call`; Triton on GPU, interpret mode on CPU), by stage."""
from pallas_kernels.kda.triton.cumsum import chunk_cumsum
from pallas_kernels.kda.triton.intra_bwd import score_bwd, solve_bwd
from pallas_kernels.kda.triton.intra_fwd import intra_fwd
from pallas_kernels.kda.triton.state_bwd import state_bwd
from pallas_kernels.kda.triton.state_fwd import output_fwd, state_fwd

__all__ = ["chunk_cumsum", "intra_fwd", "state_fwd", "output_fwd", "state_bwd", "solve_bwd", "score_bwd"]
