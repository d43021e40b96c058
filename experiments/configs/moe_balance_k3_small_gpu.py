"""Base config of the GPU-scale balancing study (`experiments/moe_balance.py`, issue 27, part 1).

The MoE of K3-small (`k3_small_gpu.py`): d_model 768, E = 16 routed SwiGLU experts of width 1024, top-2
(the top-8-of-64 variant: `--num_experts=64 --top_k=8`), Block AttnRes (2 blocks), bf16 compute;
4 layers of causal softmax attention (6 heads of 128, RoPE) instead of K3-small's 8 "KKKA" layers, so
that 7 methods x 3 seeds x 1000 steps fit one device call (moe_balance_gpu.py says why the router study
does not need the KDA mixer); 16 x 1024 bytes = 16,384 tokens per step (the batch of MaxVio_batch and of
its sampling floor); validation MaxVio_global over 16 batches at the end.

  python -m experiments.moe_balance --config=experiments/configs/moe_balance_k3_small_gpu.py \
      --num_experts=16 --top_k=2 --steps=1000 --out=$OUT/results --workdir_root=/tmp/mb_k3s
"""
import ml_collections

from experiments.configs.common import section
from k3jax.models.config import AttentionConfig, ModelConfig, MoEConfig, ResidualConfig
from k3jax.ops.balancing import QuantileBalancing
from k3jax.train.config import DataConfig, TrainConfig


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        d_model=768, num_layers=4, num_heads=6, head_dim=128, d_ff=2176,
        mixer_pattern="A", attention=AttentionConfig(rope=True),
        ffn="moe", moe=MoEConfig(num_experts=16, top_k=2, d_ff=1024, balancing=QuantileBalancing()),
        residual=ResidualConfig(kind="block_attnres", blocks=2), dtype="bfloat16")
    data = DataConfig(source="python-stdlib", seq_len=1024, batch_size=16)
    train = TrainConfig(steps=1000, learning_rate=1e-3, warmup_steps=100, eval_every=1000, eval_batches=16,
                        checkpoint_every=1000, keep_checkpoints=1, log_every=10, sample_tokens=0)
    return ml_collections.ConfigDict({
        "workdir": "runs/moe_balance_k3_small_gpu",
        "seed": 0,
        "model": section(model),
        "data": section(data),
        "train": section(train),
    })
