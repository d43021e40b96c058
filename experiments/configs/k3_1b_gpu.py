"""The "1b" shape of `experiments/bench_train.py` as a run config (issue 26), for `profile_step.py`.

24 layers "KKKA", d_model 2048, KDA / NoPE attention 16 heads x 128, MoE 64 experts x 128 top-8 (1.63B
parameters, 0.56B active), Block AttnRes (4 blocks), exact Quantile Balancing, scanned layers with remat
"full" (unrolled does not fit one H200), bf16 compute; 16 x 4096 bytes per step of the Python stdlib corpus.
The model is bench_train's row at that shape (k3_default unless the config string names another:
`--config=experiments/configs/k3_1b_gpu.py:like_for_like`), so the two cannot drift apart.

Its step peaks at 114 GiB (2026-12-04, with the fused depth-attention kernels), more than the 104 GiB that
JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION (0.75) lets it take on an H200, so set the fraction:

  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m experiments.profile_step \
      --config=experiments/configs/k3_1b_gpu.py --out=$OUT/profile_1b
"""
import ml_collections

from experiments.bench_train import SHAPES, model_config
from experiments.configs.common import section
from k3jax.train.config import DataConfig, TrainConfig


def get_config(row: str = "k3_default") -> ml_collections.ConfigDict:
    """The run config of bench_train's `row` ("k3_default" or "like_for_like") at the 1b shape."""
    model = model_config("1b", row or "k3_default", scan_layers=True, remat="full")
    data = DataConfig(source="python-stdlib", seq_len=SHAPES["1b"]["seq_len"], batch_size=SHAPES["1b"]["batch_size"])
    train = TrainConfig(steps=300, learning_rate=3e-4, warmup_steps=30, eval_every=100, eval_batches=2,
                        checkpoint_every=300, keep_checkpoints=1, log_every=10, sample_tokens=0)
    return ml_collections.ConfigDict({
        "workdir": "runs/k3_1b_gpu",
        "seed": 0,
        "model": section(model),
        "data": section(data),
        "train": section(train),
    })
