"""Default `make train` config: a K3-style hybrid that trains on the Python stdlib corpus on a 2-core CPU.

3 KDA : 1 attention layers (bounded gate, lower_bound -5; attention without positional encoding, as in
Kimi Linear/K3), MoE FFN with Quantile Balancing, Block Attention Residuals. Override any field:
  make train ARGS="--config.train.steps=50 --config.workdir=runs/try"
  make train ARGS="--config.model.mixer_pattern=A --config.model.ffn=mlp --config.model.residual=prenorm"
"""
import ml_collections

from experiments.configs.common import section
from k3jax.models.config import ModelConfig
from k3jax.train.config import DataConfig, TrainConfig


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        d_model=128, num_layers=4, num_heads=4, head_dim=32, d_ff=384,
        mixer_pattern="KKKA", attention_rope=False, kda_gate="bounded", kda_lower_bound=-5.0,
        ffn="moe", moe_num_experts=8, moe_top_k=2, moe_d_ff=192, moe_balancing="quantile",
        residual="block_attnres", residual_blocks=4, dtype="float32")
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
