"""Default `make train` config: a K3-style hybrid that trains on the Python stdlib corpus on a 2-core CPU.

3 KDA : 1 attention layers (bounded gate, lower_bound -5; attention without positional encoding, as in
Kimi Linear/K3), MoE FFN with Quantile Balancing, Block Attention Residuals. Override any field:
  make train ARGS="--config.train.steps=50 --config.workdir=runs/try"
  make train ARGS="--config.model.mixer_pattern=A --config.model.ffn=mlp --config.model.residual.kind=prenorm"
  make train ARGS="--config.model.moe.top_k=4 --config.model.kda.lower_bound=-3"   (paths: docs/config.md)
"""
import ml_collections

from experiments.configs.common import section
from k3jax.models.config import AttentionConfig, KDAConfig, ModelConfig, MoEConfig, ResidualConfig
from k3jax.ops.balancing import QuantileBalancing
from k3jax.train.config import DataConfig, TrainConfig


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        d_model=128, num_layers=4, num_heads=4, head_dim=32, d_ff=384,
        mixer_pattern="KKKA", attention=AttentionConfig(rope=False), kda=KDAConfig(gate="bounded", lower_bound=-5.0),
        ffn="moe", moe=MoEConfig(num_experts=8, top_k=2, d_ff=192, balancing=QuantileBalancing()),
        residual=ResidualConfig(kind="block_attnres", blocks=4), dtype="float32")
    data = DataConfig(source="python-stdlib", seq_len=256, batch_size=16)
    train = TrainConfig(steps=400, learning_rate=3e-3, warmup_steps=40, eval_every=100, eval_batches=8,
                        checkpoint_every=100, log_every=10)
    return ml_collections.ConfigDict({
        "workdir": "runs/k3_tiny",
        "seed": 0,
        "model": section(model),
        "data": section(data),
        "train": section(train),
    })
