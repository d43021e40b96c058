"""experiments/moe_balance.py machinery: executable reuse across seeds, merging result files."""
import jax
import pytest

from experiments import moe_balance
from experiments.configs.common import section
from k3jax.models.config import ModelConfig
from k3jax.train import trainer as trainer_lib
from k3jax.train.config import DataConfig, TrainConfig

_BACKEND_COMPILES = []


def _on_duration(name, duration, **kwargs):
    if name == "/jax/core/compile/backend_compile_duration":
        _BACKEND_COMPILES.append(duration)


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def _tiny_base() -> dict:
    model = ModelConfig(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64, mixer_pattern="A",
                        attention_rope=True, ffn="moe", moe_num_experts=4, moe_top_k=2, moe_d_ff=32,
                        residual="prenorm", dtype="float32")
    data = DataConfig(source="python-stdlib", seq_len=32, batch_size=2)
    train = TrainConfig(steps=2, learning_rate=1e-3, warmup_steps=1, eval_every=2, eval_batches=1,
                        checkpoint_every=2, log_every=1, sample_tokens=0)
    return {"workdir": "unused", "seed": 0, "model": section(model).to_dict(), "data": section(data).to_dict(),
            "train": section(train).to_dict()}


def _backend_compiles_of_run(cfg) -> int:
    before = len(_BACKEND_COMPILES)
    trainer_lib.train(cfg, show_progress=False)
    return len(_BACKEND_COMPILES) - before


def test_second_seed_reuses_the_first_seeds_executables(tmp_path):
    base = _tiny_base()
    kw = dict(num_experts=4, top_k=2, steps=2, workdir_root=str(tmp_path))
    compiles = []
    for seed in (0, 1):  # one block per run, as in main()
        with moe_balance.shared_optimizer_transforms():
            compiles.append(_backend_compiles_of_run(moe_balance.run_config(base, "quantile_exact", seed, **kw)))
    first, second = compiles
    assert first >= 2  # train step + eval step (the counter sees compiles)
    assert second == 0
    # Without the shared optax object the optimizer's graph definition differs and the train step
    # re-traces and compiles again (the cause this fixes; persistent cache off so a hit cannot hide it).
    assert trainer_lib.make_optimizer is moe_balance.make_optimizer
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        third = _backend_compiles_of_run(moe_balance.run_config(base, "quantile_exact", 2, **kw))
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert third >= 1


def test_run_config_rejects_unknown_method(tmp_path):
    with pytest.raises(ValueError, match="method"):
        moe_balance.run_config(_tiny_base(), "quantile_bogus", 0, num_experts=4, top_k=2, steps=2,
                               workdir_root=str(tmp_path))
