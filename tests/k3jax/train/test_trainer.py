"""The training spine: loss goes down, checkpoints round-trip, a killed run resumes identically,
config overrides and validation."""
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax.train.config import RunConfig, run_config_from_dict
from k3jax.train.metrics import read_metrics
from k3jax.train.trainer import train

from tests.repo import REPO
SMALL_CORPUS = "text:" + os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")


def _cfg(workdir, cache, **train_overrides):
    train_cfg = dict(steps=20, learning_rate=3e-3, warmup_steps=2, eval_every=10, eval_batches=2,
                     log_every=1, checkpoint_every=10, keep_checkpoints=5, sample_tokens=0)
    train_cfg.update(train_overrides)
    return run_config_from_dict({
        "workdir": str(workdir), "seed": 0,
        "model": dict(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64),
        "data": dict(source=SMALL_CORPUS, seq_len=32, batch_size=4, cache_dir=str(cache)),
        "train": train_cfg,
    })


def _losses(workdir):
    by_step = {}
    for row in read_metrics(workdir):
        if "ce" in row:
            by_step[row["step"]] = row["ce"]
    return by_step


def test_training_reduces_loss_on_a_fixed_batch():
    from k3jax.models.config import ModelConfig, MoEConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.config import TrainConfig
    from k3jax.train.optimizer import make_optimizer
    from k3jax.train.step import train_step

    model = LanguageModel(ModelConfig(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64),
                          rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=30, warmup_steps=0, learning_rate=1e-2)),
                        wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((4, 32), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(32), (4, 32)), "loss_mask": jnp.ones((4, 32), bool)}
    losses = [float(train_step(model, opt, batch)["ce"]) for _ in range(30)]
    assert losses[0] > 5.0  # ~ln(320) at init
    assert losses[-1] < 0.5 * losses[0]


def test_nonfinite_update_is_skipped_and_counted():
    from k3jax.models.config import ModelConfig, MoEConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.config import TrainConfig
    from k3jax.train.optimizer import make_optimizer
    from k3jax.train.step import train_step

    model = LanguageModel(ModelConfig(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64),
                          rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=10, warmup_steps=0)), wrt=nnx.Param)
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    batch = {"inputs": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32),
             "segment_ids": jnp.ones((1, 8), jnp.int32), "positions": jnp.zeros((1, 8), jnp.int32),
             "loss_mask": jnp.ones((1, 8), bool)}
    model.embed.embedding.set_value(model.embed.embedding.get_value().at[0, 0].set(jnp.nan))
    m = train_step(model, opt, batch)
    assert not bool(m["finite"]) and int(m["nonfinite_count"]) == 1
    m = train_step(model, opt, batch)
    assert int(m["nonfinite_count"]) == 2
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(after["head"]["kernel"], before["head"]["kernel"])  # update skipped


def _nan_batch():
    return {"inputs": jnp.zeros((1, 8), jnp.int32), "targets": jnp.zeros((1, 8), jnp.int32),
            "segment_ids": jnp.ones((1, 8), jnp.int32), "positions": jnp.zeros((1, 8), jnp.int32),
            "loss_mask": jnp.ones((1, 8), bool)}


@pytest.mark.parametrize("where,expected,scan_layers", [
    ("embed", "first non-finite activation after embed", False),
    ("mixers/1", "first non-finite activation after mixers/1 (attention)", False),
    ("mixers/1", "first non-finite activation after mixers/1 (attention)", True),
    ("ffns/0", "first non-finite activation after ffns/0 (mlp)", False),
    ("head", "first non-finite activation after final_norm/head", False),
])
def test_nonfinite_step_reports_the_layer_that_produced_it(where, expected, scan_layers):
    """Issue 23: a skipped step said nothing about where the NaN came from (scanned layers too)."""
    from k3jax.models.config import ModelConfig, MoEConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.config import TrainConfig
    from k3jax.train.optimizer import make_optimizer
    from k3jax.train.step import finiteness_names, nonfinite_report, train_step

    model = LanguageModel(ModelConfig(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64,
                                      scan_layers=scan_layers), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=10, warmup_steps=0)), wrt=nnx.Param)
    m = train_step(model, opt, _nan_batch())
    assert bool(m["finite"]) and np.asarray(m["finite_activations"]).all() and np.asarray(m["finite_grads"]).all()
    activations, groups = finiteness_names(model)
    assert activations == ("embed", "mixers/0 (attention)", "ffns/0 (mlp)", "mixers/1 (attention)", "ffns/1 (mlp)",
                           "final_norm/head", "loss")
    assert "mixers/1" in groups and "ffn_norms/0" in groups and len(groups) == 11
    module = {"embed": model.embed, "mixers/1": model.mixers[1], "ffns/0": model.ffns[0], "head": model.head}[where]
    param = next(v for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Param))
    param.set_value(param.get_value().at[(0,) * param.get_value().ndim].set(jnp.nan))
    m = train_step(model, opt, _nan_batch())
    assert not bool(m["finite"])
    report = nonfinite_report(model, jax.device_get(m))
    assert report == f"{expected}; non-finite gradients in 11 of 11 parameter groups", report


def test_nonfinite_report_of_a_finite_forward_lists_gradients_deepest_first():
    from k3jax.models.config import ModelConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.step import finiteness_names, nonfinite_report

    model = LanguageModel(ModelConfig(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=64),
                          rngs=nnx.Rngs(0))
    activations, groups = finiteness_names(model)
    bad = {"embed", "mixer_norms/0", "mixers/0", "ffns/0", "mixers/1"}  # a NaN born in mixers/1's backward
    metrics = {"finite_activations": np.ones(len(activations), bool),
               "finite_grads": np.array([g not in bad for g in groups])}
    assert nonfinite_report(model, metrics) == ("forward finite; non-finite gradients in 5 of 11 parameter groups, "
                                                "deepest first: mixers/1, ffns/0, mixers/0, mixer_norms/0, ...")


def test_trainer_names_the_layer_when_it_stops_on_nonfinite_steps(tmp_path, monkeypatch, caplog):
    import logging

    import k3jax.train.trainer as trainer_lib
    from k3jax.train.trainer import NonFiniteError
    real_bind, calls = trainer_lib.bind_train_step, []

    def bind(model, optimizer, **kwargs):
        real_step = real_bind(model, optimizer, **kwargs)

        def poisoned_step(batch):  # from the 3rd step on, mixers/1 holds a NaN weight (the bound step sees it)
            calls.append(1)
            if len(calls) == 3:
                kernel = model.mixers[1].o.kernel
                kernel.set_value(kernel.get_value().at[0, 0].set(jnp.nan))
            return real_step(batch)
        return poisoned_step

    monkeypatch.setattr(trainer_lib, "bind_train_step", bind)
    cfg = _cfg(tmp_path / "nan", tmp_path / "cache", max_nonfinite_steps=2, checkpoint_every=100)
    with caplog.at_level(logging.WARNING, logger="k3jax"), pytest.raises(NonFiniteError) as e:
        train(cfg, show_progress=False)
    assert str(e.value).startswith("2 consecutive non-finite steps at step 4: first non-finite activation after "
                                   "mixers/1 (attention);")
    lines = [r.getMessage() for r in caplog.records if "non-finite step" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["step 3", "step 4"]
    assert all("first non-finite activation after mixers/1 (attention)" in line for line in lines)
    assert "1 in a row" in lines[0] and "2 in a row" in lines[1]



def _synchronous_metrics(cfg):
    """The metrics.jsonl rows of `cfg` from a plain loop that reads every step's metrics at once."""
    from k3jax.data.corpus import load_corpus
    from k3jax.data.pipeline import eval_batches, make_train_loader
    from k3jax.models.lm import LanguageModel
    from k3jax.train.optimizer import learning_rate_schedule, make_optimizer
    from k3jax.train.step import train_step
    from k3jax.train.trainer import evaluate
    corpus = load_corpus(cfg.data.source, "train", cache_dir=cfg.data.cache_dir)
    model = LanguageModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    opt = nnx.Optimizer(model, make_optimizer(cfg.train), wrt=nnx.Param)
    it = make_train_loader(corpus.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len, seed=cfg.seed)
    val = eval_batches(corpus.tokens, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                       max_batches=cfg.train.eval_batches)  # the tiny corpus has no validation split
    schedule, rows = learning_rate_schedule(cfg.train), []
    for step in range(1, cfg.train.steps + 1):
        m = jax.device_get(train_step(model, opt, {k: jnp.asarray(v) for k, v in next(it).items()}))
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            rows.append({"step": step, **{k: float(v) for k, v in m.items() if np.ndim(v) == 0},
                         "lr": float(schedule(step - 1)),
                         "tokens": float(step * cfg.data.batch_size * cfg.data.seq_len)})
        if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
            rows.append({"step": step, **evaluate(model, val)})
    return rows


def test_metrics_read_one_step_late_are_those_of_a_synchronous_loop(tmp_path):
    """The trainer reads step N's metrics after dispatching step N + 1; metrics.jsonl (every value but
    the measured tokens/s) equals a loop that waits for every step, log / eval boundaries included."""
    cfg = _cfg(tmp_path / "run", tmp_path / "cache", steps=7, log_every=2, eval_every=3, checkpoint_every=5)
    train(cfg, show_progress=False)
    rows = read_metrics(tmp_path / "run")
    assert all(r.pop("tokens_per_s") >= 0 for r in rows if "ce" in r)
    expected = _synchronous_metrics(cfg)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == [2, 3, 4, 6, 6, 7, 7]
    assert rows == expected


def test_trainer_reads_metrics_after_the_next_dispatch_and_prefetches_batches(tmp_path, monkeypatch):
    import k3jax.train.trainer as trainer_lib
    real_bind, real_host, events, outs = trainer_lib.bind_train_step, trainer_lib._to_host, [], []
    number = lambda metrics: next(i for i, o in enumerate(outs) if o is metrics) + 1  # noqa: E731 (ids get reused)

    def bind(model, optimizer, **kwargs):
        real_step = real_bind(model, optimizer, **kwargs)

        def step_fn(batch):
            assert all(isinstance(v, jax.Array) for v in batch.values())  # already on the device
            out = real_step(batch)
            outs.append(out)
            events.append(("dispatch", number(out)))
            return out
        return step_fn

    def to_host(metrics):
        events.append(("read", number(metrics)))
        return real_host(metrics)

    monkeypatch.setattr(trainer_lib, "bind_train_step", bind)
    monkeypatch.setattr(trainer_lib, "_to_host", to_host)
    cfg = _cfg(tmp_path / "run", tmp_path / "cache", steps=9, log_every=1, eval_every=4, checkpoint_every=6)
    summary = train(cfg, show_progress=False)
    assert [n for kind, n in events if kind == "read"] == list(range(1, 10))  # each once, in order
    at_once = {1, 4, 6, 8, 9}  # the first step, eval (4, 8), checkpoint (6), last (9)
    for n in range(1, 9):
        read, next_dispatch = events.index(("read", n)), events.index(("dispatch", n + 1))
        assert (read < next_dispatch) == (n in at_once), (n, events)
    assert summary["step"] == 9 and summary["tokens_per_s"] > 0


def test_checkpoint_round_trip(tmp_path):
    from k3jax.data.pipeline import make_train_loader
    from k3jax.models.config import ModelConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.checkpoint import Checkpointer
    from k3jax.train.config import TrainConfig
    from k3jax.train.optimizer import make_optimizer

    def fresh(seed):
        m = LanguageModel(ModelConfig(d_model=32, num_layers=1, num_heads=2, head_dim=16, d_ff=64),
                          rngs=nnx.Rngs(seed))
        o = nnx.Optimizer(m, make_optimizer(TrainConfig(steps=10, warmup_steps=1)), wrt=nnx.Param)
        it = make_train_loader(np.arange(4000, dtype=np.uint16) % 256, batch_size=2, seq_len=16, seed=3)
        return m, o, it

    m1, o1, it1 = fresh(1)
    for _ in range(3):
        next(it1)
    ck = Checkpointer(str(tmp_path), keep=2)
    ck.save(7, m1, o1, it1, {"step": 7, "seed": 1})
    m2, o2, it2 = fresh(2)
    meta = ck.restore(ck.latest_step(), m2, o2, it2)
    assert meta == {"step": 7, "seed": 1}
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(m1)), nnx.to_pure_dict(nnx.state(m2)))
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(o1)), nnx.to_pure_dict(nnx.state(o2)))
    np.testing.assert_array_equal(next(it1)["inputs"], next(it2)["inputs"])


def test_resume_gives_identical_losses(tmp_path):
    cache = tmp_path / "cache"
    straight = train(_cfg(tmp_path / "a", cache), show_progress=False)
    first = train(_cfg(tmp_path / "b", cache), show_progress=False, stop_at_step=10)  # preempted at 10
    assert first["stopped_by_signal"] and first["step"] == 10
    resumed = train(_cfg(tmp_path / "b", cache), show_progress=False)
    assert resumed["start_step"] == 10
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(la) == sorted(lb) == list(range(1, 21))
    assert la == lb  # bit-identical per-step losses on CPU
    assert straight["val_bpb"] == resumed["val_bpb"]
    from k3jax.train.trainer import load_trained_model
    ma, step_a = load_trained_model(_cfg(tmp_path / "a", cache))
    mb, step_b = load_trained_model(_cfg(tmp_path / "b", cache))
    assert step_a == step_b == 20
    out = subprocess.run([sys.executable, "-m", "experiments.generate", f"--workdir={tmp_path / 'b'}",
                          "--prompt=import ", "--max_tokens=12", "--temperature=0", "--num_samples=2"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    samples = out.stdout.split("--- sample ")[1:]
    assert len(samples) == 2 and "checkpoint step 20" in samples[0]
    assert samples[0].split("\n", 1)[1] == samples[1].split("\n", 1)[1]  # greedy: identical
    assert samples[0].split("\n", 1)[1].startswith("import ")
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(ma)), nnx.to_pure_dict(nnx.state(mb)))


def test_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, caplog):
    """Issue 23, end to end: step 20's checkpoint truncated -> the rerun resumes from step 10, says so in
    one line, keeps the damaged folder as 20.corrupt and ends with the losses of an undisturbed run."""
    import glob
    import logging
    cache = tmp_path / "cache"
    first = train(_cfg(tmp_path / "run", cache), show_progress=False)
    assert first["step"] == 20
    before = _losses(tmp_path / "run")
    ckdir = tmp_path / "run" / "checkpoints"
    array = max(glob.glob(f"{ckdir}/20/model/ocdbt.process_0/d/*"), key=os.path.getsize)
    os.truncate(array, os.path.getsize(array) // 2)
    with caplog.at_level(logging.WARNING, logger="k3jax"):
        resumed = train(_cfg(tmp_path / "run", cache), show_progress=False)
    assert resumed["start_step"] == 10 and resumed["step"] == 20
    # k3jax's own records: asyncio may also log orbax's other failed reads ("Task exception was never
    # retrieved", when they are garbage-collected), which name the checkpoint path too
    lines = [r.getMessage() for r in caplog.records
             if r.name.split(".")[0] == "k3jax" and "checkpoint" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"checkpoint step 20 at {ckdir / '20'} is unreadable (model: ValueError: OUT_OF_RANGE: ")
    assert lines[0].endswith(f"; moved it aside to {ckdir / '20.corrupt'}; resuming from step 10")
    assert "OCDBT" in lines[0]
    assert sorted(os.listdir(ckdir)) == ["10", "20", "20.corrupt"]  # step 20 written again at the end
    header = json.loads((tmp_path / "run" / "run_header.json").read_text())
    assert header["resumed_from_step"] == 10
    assert _losses(tmp_path / "run") == before  # steps 11..20 redone bit-identically
    assert resumed["val_bpb"] == first["val_bpb"]


def test_sigterm_checkpoints_and_resume_matches(tmp_path):
    """A real process killed with SIGTERM mid-run saves; the rerun continues with identical losses."""
    cache = tmp_path / "cache"
    steps = 100  # ~0.06 s a step on 2 CPU cores: the signal, sent after 5 logged steps, lands ~6 s before the end
    # attention only (resume is not about the mixer): each process compiles in a fraction of the time
    args = ["--config.model.d_model=32", "--config.model.num_layers=2", "--config.model.mixer_pattern=A",
            "--config.model.num_heads=2",
            "--config.model.head_dim=16", "--config.model.d_ff=64", f"--config.data.source={SMALL_CORPUS}",
            "--config.data.seq_len=32", "--config.data.batch_size=4", f"--config.data.cache_dir={cache}",
            f"--config.train.steps={steps}", "--config.train.warmup_steps=2", "--config.train.eval_every=1000",
            "--config.train.eval_batches=1", "--config.train.log_every=1", "--config.train.checkpoint_every=1000",
            "--config.train.sample_tokens=0"]
    # one persistent compilation cache for the three processes: the later two load the step, not compile it
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    workdir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "experiments.train", f"--config.workdir={workdir}", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    saved = [int(p) for p in os.listdir(workdir / "checkpoints") if p.isdigit()]
    assert len(saved) == 1 and 5 <= saved[0] < steps
    stop = saved[0]
    # resume to the end, and compare with a straight run
    for wd in (workdir, tmp_path / "straight"):
        subprocess.run([sys.executable, "-m", "experiments.train", f"--config.workdir={wd}", *args],
                       cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lk, ls = _losses(workdir), _losses(tmp_path / "straight")
    assert sorted(lk) == list(range(1, steps + 1))
    assert lk == ls


def test_config_overrides_reach_the_run(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", "from experiments.configs.k3_tiny import get_config; "
         "from k3jax.train.config import run_config_from_dict; c = get_config(); c.train.steps = 77; "
         "print(run_config_from_dict(c).train.steps)"], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "77"
    from experiments.configs.k3_tiny import get_config
    cfg = run_config_from_dict(get_config())
    assert isinstance(cfg, RunConfig) and cfg.data.source == "python-stdlib"


@pytest.mark.parametrize("section,field,value", [
    ("train", "steps", -5), ("train", "steps", 0), ("data", "source", "wikipedia"),
    ("data", "seq_len", 0), ("data", "batch_size", -1), ("train", "learning_rate", 0.0),
    ("model", "num_heads", 0),
])
def test_bad_config_values_raise_naming_the_field(section, field, value):
    from experiments.configs.k3_tiny import get_config
    c = get_config().to_dict()
    c[section][field] = value
    with pytest.raises(ValueError, match=f"{section}.{field}"):
        run_config_from_dict(c)


@pytest.mark.parametrize("section,field,value,message", [
    ("train", "warmup_steps", 401, r"train\.warmup_steps must be <= train\.steps=400"),
    ("seed", None, -1, r"seed must be an int in \[0, 2\*\*32\)"),
    ("seed", None, 2**32, r"seed must be an int in \[0, 2\*\*32\)"),
    ("seed", None, True, r"seed must be an int"),
    ("data", "source", "text:/nonexistent-k3jax/**/*.txt", r"data\.source: source matches no files"),
    ("data", "source", "tokens:/nonexistent-k3jax/train.bin", r"data\.source: source must name a folder"),
])
def test_config_errors_come_when_the_config_is_built(section, field, value, message):
    """Issue 23: these passed construction and failed later (the schedule, the loader, the corpus load)."""
    from experiments.configs.k3_tiny import get_config
    c = get_config().to_dict()
    assert c["train"]["steps"] == 400
    if field is None:
        c[section] = value
    else:
        c[section][field] = value
    with pytest.raises(ValueError, match=message):
        run_config_from_dict(c)


def test_text_glob_that_matches_files_builds(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("hello")
    from k3jax.train.config import DataConfig
    assert DataConfig(source=f"text:{tmp_path}/**/*.txt").source.endswith("*.txt")
    with pytest.raises(ValueError, match="matches no files"):
        DataConfig(source=f"text:{tmp_path}/**/*.md")
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "train.bin").write_bytes(b"\0\0")
    with pytest.raises(ValueError, match="val.bin"):
        DataConfig(source=f"tokens:{tmp_path / 'ds'}")
    (tmp_path / "ds" / "val.bin").write_bytes(b"\0\0")
    DataConfig(source=f"tokens:{tmp_path / 'ds'}")


def test_unknown_config_field_raises():
    with pytest.raises(ValueError, match="stepz"):
        run_config_from_dict({"train": {"stepz": 3}})


def test_bad_override_on_the_command_line_fails_loudly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "experiments.train", "--config.train.steps=-3",
                          f"--config.workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode != 0 and "train.steps" in out.stderr


def test_moe_train_step_writes_next_bias_and_eval_leaves_it():
    """QB: the train step stores the layers' next bias (the optimizer never touches it); eval does not."""
    from k3jax.models.config import ModelConfig, MoEConfig
    from k3jax.models.lm import LanguageModel
    from k3jax.train.config import TrainConfig
    from k3jax.train.optimizer import make_optimizer
    from k3jax.train.step import eval_step, train_step

    cfg = ModelConfig(d_model=32, num_layers=2, num_heads=2, head_dim=16, d_ff=32, ffn="moe",
                      moe=MoEConfig(num_experts=4, top_k=1))  # Quantile Balancing by default
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, make_optimizer(TrainConfig(steps=10, warmup_steps=0)), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": jnp.ones((4, 32), jnp.int32),
             "positions": jnp.broadcast_to(jnp.arange(32), (4, 32)), "loss_mask": jnp.ones((4, 32), bool)}
    _, aux = model(batch["inputs"])  # what the layers propose from the current parameters
    expected = [np.asarray(a["next_bias"]) for a in aux["moe"]]
    metrics = train_step(model, opt, batch)
    biases = [np.asarray(f.router_bias.get_value()) for f in model.ffns]
    for got, want in zip(biases, expected):
        np.testing.assert_allclose(got, want, atol=1e-6)
        assert np.abs(got).max() > 0 and abs(got.sum()) < 1e-5  # moved, and centred (b = b_hat - mean)
    assert "moe/0/max_vio" in metrics
    eval_step(model, batch)
    for f, before in zip(model.ffns, biases):
        np.testing.assert_array_equal(np.asarray(f.router_bias.get_value()), before)

