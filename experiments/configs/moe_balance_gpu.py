"""Base config of the MoE balancing table on one GPU (`experiments/moe_balance.py`, issue 5).

A small attention-only MoE LM: 4 layers of causal softmax attention (RoPE) + MoE FFN (E = 32 routed
SwiGLU experts, top-4, expert width 256), Block AttnRes residuals, bf16 compute, 32 x 512 bytes per step.

Why attention-only and not the K3 hybrid (KKKA): the table needs one fresh compilation per method
(9 methods; seeds 1, 2 load seed 0's executables from the persistent cache), and on this codebase the
KDA chunked op doubles the train-step compile: measured on CPU at this size, a KKKA train step compiles
in ~25 s of backend time against ~12 s for attention-only. The question the table answers is about the
router (loads, MaxVio, loss at equal data), which the mixer feeds but does not change; the same methods
on the hybrid are one flag away (--config.model.mixer_pattern=KKKA --config.model.attention_rope=False).

  python -m experiments.moe_balance --config=experiments/configs/moe_balance_gpu.py --num_experts=32 \
      --top_k=4 --steps=400 --time_budget_s=400 --out=$OUT/results --workdir_root=/tmp/moe_balance_runs
"""
import ml_collections

from experiments.configs.common import section
from k3jax.models.config import ModelConfig
from k3jax.train.config import DataConfig, TrainConfig


def get_config() -> ml_collections.ConfigDict:
    model = ModelConfig(
        d_model=256, num_layers=4, num_heads=4, head_dim=64, d_ff=768,
        mixer_pattern="A", attention_rope=True,
        ffn="moe", moe_num_experts=32, moe_top_k=4, moe_d_ff=256, moe_balancing="quantile",
        residual="block_attnres", residual_blocks=4, dtype="bfloat16")
    data = DataConfig(source="python-stdlib", seq_len=512, batch_size=32)
    train = TrainConfig(steps=400, learning_rate=3e-3, warmup_steps=40, eval_every=400, eval_batches=8,
                        checkpoint_every=400, log_every=10, sample_tokens=0)
    return ml_collections.ConfigDict({
        "workdir": "runs/moe_balance_gpu",
        "seed": 0,
        "model": section(model),
        "data": section(data),
        "train": section(train),
    })
