"""experiments/gate_in_training.py: the tile span of a gate and the recording of every KDA layer's g."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments import gate_in_training as git
from k3jax.nn.kda import KimiDeltaAttention


def test_tile_span_is_the_largest_channel_decay_over_the_tile():
    rng = np.random.default_rng(0)
    g = -rng.exponential(1.0, (2, 37, 3, 4))  # 37 tokens: two 16-token tiles, 5 tokens left out
    spans = git.tile_spans(g, 16)
    assert spans.shape == (2, 2, 3)
    for b in range(2):
        for n in range(2):
            for h in range(3):
                expected = max(-g[b, 16 * n:16 * (n + 1), h, k].sum() for k in range(4))
                assert spans[b, n, h] == pytest.approx(expected)
    # the bounded gate's span never passes tile * |lower_bound|, so 16-token tiles never overflow at -5
    assert git.tile_spans(np.full((1, 32, 1, 2), -5.0), 16).max() == pytest.approx(80.0)
    assert git.span_stats([git.tile_spans(np.full((1, 32, 1, 2), -5.0), 16)])["overflow_fraction"] == 0.0
    assert git.span_stats([git.tile_spans(np.full((1, 32, 1, 2), -6.0), 16)])["overflow_fraction"] == 1.0
    with pytest.raises(ValueError, match="tile"):
        git.tile_spans(g, 0)
    with pytest.raises(ValueError, match="g must be"):
        git.tile_spans(g[0], 16)


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_recording_gates_sees_the_layers_g(gate):
    layer = KimiDeltaAttention(16, 2, 8, gate=gate, chunk_size=16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, 32, 16))
    with git.recording_gates() as gs:
        out = layer(x, segment_ids=jnp.ones((1, 32), jnp.int32), positions=jnp.zeros((1, 32), jnp.int32))
    assert len(gs) == 1 and gs[0].shape == (1, 32, 2, 8) and np.all(gs[0] <= 0)
    g, _, _ = layer._gates(x.astype(jnp.bfloat16))
    np.testing.assert_allclose(gs[0], np.asarray(g), rtol=1e-6, atol=1e-6)
    assert out.shape == x.shape
    if gate == "bounded":
        assert gs[0].min() >= -5.0


def test_merge_joins_one_result_per_gate_at_equal_steps():
    def doc(gate, step, base=None):
        return {"env": {"device": "x"}, "config_file": "c.py", "tiny": False, "base_config": base or {"a": 1},
                "runs": {gate: {"step": step, "val_loss": 1.0}}}
    merged = git.merge_results([doc("softplus", 10), doc("bounded", 10)])
    assert list(merged["runs"]) == ["bounded", "softplus"] and merged["processes_sharing_device"] == 2
    with pytest.raises(ValueError, match="different steps"):
        git.merge_results([doc("softplus", 10), doc("bounded", 9)])
    with pytest.raises(ValueError, match="more than one"):
        git.merge_results([doc("bounded", 10), doc("bounded", 10)])
    with pytest.raises(ValueError, match="base configs differ"):
        git.merge_results([doc("bounded", 10), doc("softplus", 10, {"a": 2})])
    with pytest.raises(ValueError, match="at least two"):
        git.merge_results([doc("bounded", 10)])


def test_finished_run_summary_reads_the_last_training_record(tmp_path):
    import dataclasses
    import json

    from experiments.configs.k3_tiny import get_config
    from k3jax.train.config import run_config_from_dict
    d = get_config().to_dict()
    d["train"].update(steps=20, warmup_steps=2)
    d["workdir"] = str(tmp_path)
    cfg = run_config_from_dict(d)
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        git.finished_run_summary(cfg)
    header = {"config": dataclasses.asdict(cfg), "train_tokens": 1000, "val_tokens": 50}
    (tmp_path / "run_header.json").write_text(json.dumps(header))
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "val_loss": 2.0}\n')
    with pytest.raises(ValueError, match="no training record"):
        git.finished_run_summary(cfg)
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "ce": 1.0, "tokens_per_s": 100.0}\n')
    with pytest.raises(ValueError, match="stopped at step 10 of 20"):
        git.finished_run_summary(cfg)
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "ce": 1.0, "tokens_per_s": 100.0}\n'
                                            '{"step": 20, "ce": 0.5, "tokens_per_s": 250.5}\n'
                                            '{"step": 20, "val_loss": 1.5}\n')
    assert git.finished_run_summary(cfg) == {"step": 20, "tokens_per_s": 250.5, "train_tokens": 1000, "val_tokens": 50}
    other = run_config_from_dict({**d, "model": {**d["model"], "d_model": 2 * d["model"]["d_model"]}})
    with pytest.raises(ValueError, match="another model config"):
        git.finished_run_summary(other)
    with pytest.raises(ValueError, match="run for 20 steps"):
        git.finished_run_summary(run_config_from_dict({**d, "train": {**d["train"], "steps": 30}}))
