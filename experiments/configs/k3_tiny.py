"""Default `make train` config: a small LM that trains on the Python stdlib corpus on a 2-core CPU.

Override any field from the command line, e.g.
  make train ARGS="--config.train.steps=50 --config.workdir=runs/try"
"""
import ml_collections

from experiments.configs.common import section

from k3jax.models.config import ModelConfig
from k3jax.train.config import DataConfig, TrainConfig


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        d_model=128, num_layers=4, num_heads=4, head_dim=32, d_ff=384,
        mixer_pattern="A", ffn="mlp", residual="prenorm", attention_rope=True, dtype="float32")
    data = DataConfig(source="python-stdlib", seq_len=256, batch_size=16)
    train = TrainConfig(steps=1200, learning_rate=3e-3, warmup_steps=100, eval_every=200, eval_batches=8,
                        checkpoint_every=200, log_every=10)
    return ml_collections.ConfigDict({
        "workdir": "runs/k3_tiny",
        "seed": 0,
        "model": section(model),
        "data": section(data),
        "train": section(train),
    })
