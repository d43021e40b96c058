"""K3-small on one GPU (issue 8): the K3 hybrid at a GPU size, for `experiments/k3_small_gpu.py`.

8 layers, d_model 768, 6 heads of 128: mixers 3 KDA : 1 attention ("KKKA", bounded gate with lower bound
-5, the best KDA op for the call (kda.implementation=None: the Pallas kernels on GPU); attention NoPE, as Kimi Linear / K3), MoE FFN (E = 16 routed SwiGLU experts of
width 1024, top-2, Quantile Balancing, exact quantile), Block AttnRes (4 blocks of 4 sublayers), bf16
compute with fp32 params. 32 sequences x 2048 bytes = 65,536 tokens per step on the Python stdlib corpus.

Size: 59.4 M matmul parameters active per token (k3jax.models.flops.matmul_params_per_token), about
330 M parameters in total (the 16 experts). The baseline (`transformer_small_gpu.py`) matches the ACTIVE
matmul parameters, i.e. the 6·N FLOPs per token.

  python -m experiments.k3_small_gpu --out=$OUT/results
  python -m experiments.train --config=experiments/configs/k3_small_gpu.py      # the model alone
"""
import ml_collections

from experiments.configs.common import section
from k3jax.models.config import AttentionConfig, KDAConfig, ModelConfig, MoEConfig, ResidualConfig
from k3jax.ops.balancing import QuantileBalancing
from k3jax.train.config import DataConfig, TrainConfig


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        d_model=768, num_layers=8, num_heads=6, head_dim=128, d_ff=2176,
        mixer_pattern="KKKA", attention=AttentionConfig(rope=False),
        kda=KDAConfig(gate="bounded", lower_bound=-5.0, chunk_size=64, implementation=None),
        ffn="moe", moe=MoEConfig(num_experts=16, top_k=2, d_ff=1024,
                                 balancing=QuantileBalancing(quantile_estimator="exact")),
        residual=ResidualConfig(kind="block_attnres", blocks=4), dtype="bfloat16")
    data = DataConfig(source="python-stdlib", seq_len=2048, batch_size=32)
    train = TrainConfig(steps=300, learning_rate=1e-3, warmup_steps=30, eval_every=50, eval_batches=4,
                        checkpoint_every=300, keep_checkpoints=1, log_every=10, sample_tokens=0)
    return ml_collections.ConfigDict({
        "workdir": "runs/k3_small_gpu",
        "seed": 0,
        "model": section(model),
        "data": section(data),
        "train": section(train),
    })
