"""Plain softmax-attention transformer baseline of K3-small (`k3_small_gpu.py`), same size and data.

Same d_model (768), layers (8), heads (6 x 128), data (32 x 2048 bytes of the Python stdlib corpus per
step), optimiser, schedule, steps and bf16 compute as K3-small; the architecture is the standard one:
causal softmax attention with RoPE in every layer, a dense SwiGLU MLP, PreNorm residuals.

"Same size" = same ACTIVE matmul parameters per token (hence the same 6·N training FLOPs per token):
K3-small has 59.4 M (6 KDA mixers x 2.76 M + 2 attention x 2.36 M + 8 MoE x (router + 2 experts) 4.73 M +
head); the dense MLP width d_ff = 2176 gives 8 x (2.36 M + 5.01 M) + head = 59.2 M (within 0.5%,
checked in tests/experiments/test_scripts.py). Total parameters differ (K3-small's 16 experts hold
~5x more), as they do for any MoE against a dense model of equal compute.
"""
import ml_collections

from experiments.configs import k3_small_gpu


def get_config() -> ml_collections.ConfigDict:
    cfg = k3_small_gpu.get_config()
    cfg.workdir = "runs/transformer_small_gpu"
    cfg.model.update(mixer_pattern="A", ffn="mlp", d_ff=2176)
    cfg.model.attention.rope = True
    cfg.model.residual.kind = "prenorm"
    return cfg
