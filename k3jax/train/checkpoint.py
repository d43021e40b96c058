"""Checkpointing with orbax `CheckpointManager`: model, optimizer, data-iterator state and run metadata.

Each save is one orbax step folder written atomically (orbax writes to a temporary folder and renames
it on completion), so a run killed mid-save never leaves a half checkpoint that a restart would read.
Synchronous saves: when `save` returns, the checkpoint is on disk.
"""
from __future__ import annotations

import os

import orbax.checkpoint as ocp
from flax import nnx

from k3jax.data.pipeline import iterator_restore_args, iterator_save_args


class Checkpointer:
    """Saves/restores `{model, optimizer, data iterator, meta}` under `<workdir>/checkpoints/<step>`.

    Args:
      workdir: run folder. keep: how many most recent checkpoints to keep.
    """

    def __init__(self, workdir: str, *, keep: int):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                 enable_async_checkpointing=False))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, model, optimizer, data_iterator, meta: dict) -> None:
        """Write checkpoint `step` (no-op if it already exists)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.Composite(
            model=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(model))),
            optimizer=ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(optimizer))),
            data=iterator_save_args(data_iterator),
            meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, step: int, model, optimizer, data_iterator) -> dict:
        """Load checkpoint `step` into `model`, `optimizer` and `data_iterator` in place; return its meta."""
        model_state, opt_state = nnx.state(model), nnx.state(optimizer)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.to_pure_dict(model_state)),
            optimizer=ocp.args.StandardRestore(nnx.to_pure_dict(opt_state)),
            data=iterator_restore_args(data_iterator),
            meta=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(model_state, restored["model"])
        nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
        nnx.update(model, model_state)
        nnx.update(optimizer, opt_state)
        return dict(restored["meta"])

    def restore_model(self, step: int, model) -> dict:
        """Load only the model parameters of checkpoint `step` into `model` (for eval/sampling); return meta."""
        model_state = nnx.state(model)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            model=ocp.args.StandardRestore(nnx.to_pure_dict(model_state)), meta=ocp.args.JsonRestore()))
        nnx.replace_by_pure_dict(model_state, restored["model"])
        nnx.update(model, model_state)
        return dict(restored["meta"])

    def close(self):
        self.manager.close()
