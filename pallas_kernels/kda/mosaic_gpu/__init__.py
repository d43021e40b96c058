"""The sm_90 (Hopper) KDA kernels (Mosaic GPU: TMA, wgmma), by stage; interpret mode on CPU."""
from pallas_kernels.kda.mosaic_gpu.intra_bwd import score_bwd, solve_bwd
from pallas_kernels.kda.mosaic_gpu.intra_fwd import intra_fwd
from pallas_kernels.kda.mosaic_gpu.state_bwd import state_bwd
from pallas_kernels.kda.mosaic_gpu.state_fwd import state_fwd

__all__ = ["intra_fwd", "state_fwd", "state_bwd", "solve_bwd", "score_bwd"]
