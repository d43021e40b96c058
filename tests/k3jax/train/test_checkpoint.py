"""Checkpoint fallback (issue 23): a damaged newest checkpoint is moved aside to `<step>.corrupt`, the
run resumes from the newest readable one and says so in one line; none readable -> ValueError naming
the folder; a checkpoint of another config is no damage (ValueError, nothing moved)."""
import gc
import glob
import logging
import os
import shutil

import numpy as np
import pytest
from flax import nnx

from k3jax.data.pipeline import make_train_loader
from k3jax.models.config import ModelConfig
from k3jax.models.lm import LanguageModel
from k3jax.train.checkpoint import Checkpointer
from k3jax.train.config import TrainConfig
from k3jax.train.optimizer import make_optimizer

# orbax stops reading a damaged checkpoint at its first failed shard; the other shard reads' coroutines are
# closed later and report that as an ignored exception, and TensorStore's late callbacks find asyncio's loop
# closed (orbax's cleanup; the asserts check our behaviour). Every test here that reads a damaged checkpoint
# can leave them: the filters cover the module and the fixture below collects them after each test, so none
# reports inside a later test of another module.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Exception ignored in. <coroutine object _read_array_index_and_device_put"
                               ":pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:(?s)Exception ignored in. None.*Event loop is closed"
                               ":pytest.PytestUnraisableExceptionWarning"),
]


@pytest.fixture(autouse=True)
def _collect_orbax_shard_reads():
    yield
    gc.collect()


STEPS = (20, 40, 60)
TINY = dict(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64)


def _fresh(seed=0, **model_kw):
    model = LanguageModel(ModelConfig(**{**TINY, **model_kw}), rngs=nnx.Rngs(seed))
    opt = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=10, warmup_steps=1)), wrt=nnx.Param)
    it = make_train_loader(np.arange(4000, dtype=np.uint16) % 256, batch_size=2, seq_len=16, seed=3)
    return model, opt, it


def _marker(model) -> float:
    return float(model.embed.embedding.get_value()[0, 0])


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A workdir with checkpoints 20, 40, 60; checkpoint s has embedding[0, 0] = s and its iterator
    advanced s // 20 batches. Returns (workdir, {step: next batch's inputs after restoring it})."""
    workdir = tmp_path_factory.mktemp("pristine")
    model, opt, it = _fresh()
    ck = Checkpointer(str(workdir), keep=5)
    next_inputs = {}
    for step in STEPS:
        next(it)
        model.embed.embedding.set_value(model.embed.embedding.get_value().at[0, 0].set(float(step)))
        ck.save(step, model, opt, it, {"step": step, "seed": 0})
        probe = make_train_loader(np.arange(4000, dtype=np.uint16) % 256, batch_size=2, seq_len=16, seed=3)
        probe.set_state(it.get_state())
        next_inputs[step] = next(probe)["inputs"]
    ck.close()
    return workdir, next_inputs


@pytest.fixture
def workdir(pristine, tmp_path):
    src, _ = pristine
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def _damage(step_dir, how):
    if how == "array":  # truncate the largest array file of the model's OCDBT store
        path = max(glob.glob(f"{step_dir}/model/ocdbt.process_0/d/*"), key=os.path.getsize)
        os.truncate(path, os.path.getsize(path) // 2)
        return "model", "OUT_OF_RANGE"
    if how == "metadata":
        open(f"{step_dir}/model/_METADATA", "w").close()
        return "model", "JSONDecodeError"
    if how == "data":
        open(f"{step_dir}/data/process_0-of-1.json", "w").close()
        return "data", "JSONDecodeError"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["array", "metadata", "data"])
def test_damaged_newest_checkpoint_falls_back_moves_it_aside_and_says_so(workdir, pristine, how, caplog):
    _, next_inputs = pristine
    ckdir = workdir / "checkpoints"
    item, error = _damage(ckdir / "60", how)
    model, opt, it = _fresh(seed=1)
    ck = Checkpointer(str(workdir), keep=5)
    with caplog.at_level(logging.WARNING, logger="k3jax"):
        meta = ck.restore_latest(model, opt, it)
    assert meta == {"step": 40, "seed": 0}
    assert _marker(model) == 40.0  # step 40's parameters, not 60's, not the fresh init
    np.testing.assert_array_equal(next(it)["inputs"], next_inputs[40])  # step 40's data position
    # k3jax's own warnings (orbax's failed async reads may add asyncio's "Task exception was never retrieved")
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("k3jax")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "\n" not in line and len(line) < 800
    assert f"checkpoint step 60 at {ckdir / '60'} is unreadable ({item}: " in line
    assert error in line and f"moved it aside to {ckdir / '60.corrupt'}; resuming from step 40" in line
    # moved, not deleted; orbax no longer lists it and leaves it alone on later saves and cleanups
    assert not (ckdir / "60").exists() and (ckdir / "60.corrupt" / "model").is_dir()
    assert ck.manager.all_steps() == [20, 40] and ck.latest_step() == 40
    for step in (60, 80, 100, 120):  # keep=5: 20 is cleaned up at 120, the .corrupt folder stays
        ck.save(step, model, opt, it, {"step": step, "seed": 0})
    assert ck.manager.all_steps() == [40, 60, 80, 100, 120]
    assert (ckdir / "60.corrupt" / "model").is_dir()
    ck.close()
    ck = Checkpointer(str(workdir), keep=5)
    assert ck.restore_latest(*_fresh(seed=2)) == {"step": 120, "seed": 0}
    ck.close()


def test_two_damaged_checkpoints_fall_back_two_steps(workdir, caplog):
    ckdir = workdir / "checkpoints"
    _damage(ckdir / "60", "data")
    _damage(ckdir / "40", "metadata")
    (ckdir / "60.corrupt").mkdir()  # an earlier quarantine of step 60 is kept too
    model, opt, it = _fresh(seed=1)
    ck = Checkpointer(str(workdir), keep=5)
    with caplog.at_level(logging.WARNING, logger="k3jax"):
        assert ck.restore_latest(model, opt, it)["step"] == 20
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 2 and "step 60" in lines[0] and "step 40" in lines[1]
    assert all(line.endswith("resuming from step 20") for line in lines)
    assert (ckdir / "60.corrupt.1").is_dir() and (ckdir / "40.corrupt").is_dir()
    assert _marker(model) == 20.0
    ck.close()


def test_no_readable_checkpoint_raises_naming_the_folder_and_moves_nothing(workdir):
    ckdir = workdir / "checkpoints"
    for step, how in zip(STEPS, ["array", "metadata", "data"]):
        _damage(ckdir / str(step), how)
    ck = Checkpointer(str(workdir), keep=5)
    with pytest.raises(ValueError, match=f"no readable checkpoint under {ckdir}") as e:
        ck.restore_latest(*_fresh(seed=1))
    for step in STEPS:
        assert f"checkpoint step {step} at {ckdir / str(step)} is unreadable" in str(e.value)
    assert sorted(os.listdir(ckdir)) == ["20", "40", "60"]
    ck.close()


def test_checkpoint_of_another_config_is_not_damage(workdir):
    ck = Checkpointer(str(workdir), keep=5)
    with pytest.raises(ValueError, match=r"checkpoint step 60 .* does not fit this run: model/embed/embedding "
                                         r"is stored as \(320, 32\), this run's is \(320, 48\)"):
        ck.restore_latest(*_fresh(d_model=48))
    with pytest.raises(ValueError, match=r"does not fit this run: model/ffn_norms/1/scale is only in the model"):
        ck.restore_latest(*_fresh(num_layers=2))
    assert sorted(os.listdir(workdir / "checkpoints")) == ["20", "40", "60"]
    ck.close()


def test_explicit_step_restore_of_a_damaged_checkpoint_names_path_and_item(workdir):
    ckdir = workdir / "checkpoints"
    _damage(ckdir / "40", "metadata")
    ck = Checkpointer(str(workdir), keep=5)
    model = _fresh(seed=1)[0]
    with pytest.raises(ValueError, match=rf"checkpoint step 40 at {ckdir / '40'} is unreadable \(model: "
                                         r"JSONDecodeError: Expecting value"):
        ck.restore_model(40, model)
    assert ck.restore_model(60, model)["step"] == 60 and _marker(model) == 60.0
    assert ck.restore_latest(model, move_aside=False)["step"] == 60  # the reader path
    ck.close()


def test_reader_skips_a_damaged_newest_checkpoint_and_leaves_it_in_place(workdir, caplog):
    """load_trained_model's path (eval, sampling): fall back with one line, move nothing."""
    ckdir = workdir / "checkpoints"
    _damage(ckdir / "60", "array")
    ck = Checkpointer(str(workdir), keep=5)
    model = _fresh(seed=1)[0]
    with caplog.at_level(logging.WARNING, logger="k3jax"):
        assert ck.restore_latest(model, move_aside=False)["step"] == 40
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint step 60 at {ckdir / '60'} is unreadable (model: ")
    assert lines[0].endswith("; left in place; using step 40")
    assert _marker(model) == 40.0 and sorted(os.listdir(ckdir)) == ["20", "40", "60"]
    ck.close()
