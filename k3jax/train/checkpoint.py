"""Checkpointing with orbax `CheckpointManager`: model, optimizer, data-iterator state and run metadata.

Each save is one orbax step folder written atomically (orbax writes to a temporary folder and renames
it on completion), so a run killed mid-save never leaves a half checkpoint that a restart would read.
Synchronous saves: when `save` returns, the checkpoint is on disk.

A finished checkpoint can still be damaged later (a truncated array file, an emptied `_METADATA` or
data-iterator JSON). `restore_latest` reads the newest checkpoint in full; if any item of it cannot be
read it falls back to the newest readable one, moves each damaged step folder aside to
`<step>.corrupt` (orbax lists only folders named by a bare step number, so it never reads, counts or
deletes them) and logs one line per damaged checkpoint: path, step, the item and error, and the step
the run resumed from. Single-process runs (one writer of the checkpoint folder).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from k3jax.data.pipeline import iterator_restore_args, iterator_save_args

log = logging.getLogger("k3jax")

CORRUPT_SUFFIX = ".corrupt"


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """Why checkpoint `step` could not be read: its `item` ("model", "optimizer", "data" or "meta")
    at `path` raised `error` (the root cause's type and first line)."""

    step: int
    path: str
    item: str
    error: str

    def describe(self) -> str:
        return f"checkpoint step {self.step} at {self.path} is unreadable ({self.item}: {self.error})"


class _UnreadableError(Exception):
    def __init__(self, item: str, exc: BaseException):
        super().__init__(item)
        self.item, self.exc = item, exc


def _error_summary(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line` of the innermost exception of `exc`'s chain (tensorstore's OUT_OF_RANGE sits
    under orbax's generic 'Encountered error while reading array'), on one line, at most `limit` chars."""
    root, seen = exc, set()
    while id(root) not in seen:  # the chain a traceback prints: __cause__, else an unsuppressed __context__
        seen.add(id(root))
        below = root.__cause__ if root.__cause__ is not None else (
            None if root.__suppress_context__ else root.__context__)
        if below is None:
            break
        root = below
    text = next((line.strip() for line in str(root).splitlines() if line.strip()), "")
    text = f"{type(root).__name__}: {text}" if text else type(root).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _shapes(tree) -> dict[str, tuple]:
    """{"a/b/0/c": shape} of every leaf (orbax metadata and pure dicts alike; list indices as strings)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): tuple(getattr(leaf, "shape", ())) for path, leaf in leaves}


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
        self._metadata_reader = ocp.StandardCheckpointHandler()  # array metadata of one item, for _check_fits

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

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

    # -- reading -----------------------------------------------------------------------------------
    def _check_fits(self, step: int, item: str, target: dict) -> None:
        """Stored shapes of `item` must be `target`'s: a readable checkpoint of another config is no
        damage (never moved aside) but a ValueError. Unreadable metadata is damage (_UnreadableError)."""
        try:
            stored = _shapes(self._metadata_reader.metadata(epath.Path(self.step_path(step)) / item))
        except Exception as e:  # noqa: BLE001 (any failure to read is damage, reported with its cause)
            raise _UnreadableError(item, e) from e
        wanted = _shapes(target)
        if stored == wanted:
            return
        diff = sorted(set(stored) ^ set(wanted))
        if diff:
            where = "checkpoint" if diff[0] in stored else "model"
            detail = f"{item}/{diff[0]} is only in the {where} ({len(diff)} leaves differ)"
        else:
            name = next(k for k in sorted(stored) if stored[k] != wanted[k])
            detail = f"{item}/{name} is stored as {stored[name]}, this run's is {wanted[name]}"
        raise ValueError(f"checkpoint step {step} at {self.step_path(step)} does not fit this run: {detail}. "
                         "It was written with another model/optimizer config; resume with that config or "
                         "use a new workdir")

    def _read(self, step: int, model_target: dict, opt_target: dict | None, data_iterator,
              check_meta: Callable[[int, dict], None] | None = None) -> dict:
        """Every item of checkpoint `step` read in full (the data iterator's state is set in place).

        The meta JSON is read first and given to `check_meta(step, meta)`, which may refuse the
        checkpoint with a ValueError (e.g. another tokenizer) before any array is compared or read.

        Raises:
          _UnreadableError: an item that cannot be read (which one, and the exception).
          ValueError: the checkpoint is readable but holds another model/optimizer structure, or
            `check_meta` refused it.
        """
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # noqa: BLE001
            raise _UnreadableError("meta", e) from e
        if check_meta is not None:
            check_meta(step, dict(meta))
        items = {"model": model_target, "optimizer": opt_target}
        for item, target in items.items():
            if target is not None:
                self._check_fits(step, item, target)
        args = {"model": ocp.args.StandardRestore(model_target)}
        if opt_target is not None:
            args["optimizer"] = ocp.args.StandardRestore(opt_target)
        if data_iterator is not None:
            args["data"] = iterator_restore_args(data_iterator)
        restored = {}
        for item, item_args in args.items():  # one item at a time, so that a failure names its item
            try:
                restored[item] = self.manager.restore(step, args=ocp.args.Composite(**{item: item_args}))[item]
            except Exception as e:  # noqa: BLE001
                raise _UnreadableError(item, e) from e
        restored["meta"] = meta
        return restored

    @staticmethod
    def _apply(restored: dict, model, optimizer) -> dict:
        model_state = nnx.state(model)
        nnx.replace_by_pure_dict(model_state, restored["model"])
        nnx.update(model, model_state)
        if optimizer is not None:
            opt_state = nnx.state(optimizer)
            nnx.replace_by_pure_dict(opt_state, restored["optimizer"])
            nnx.update(optimizer, opt_state)
        return dict(restored["meta"])

    def _targets(self, model, optimizer):
        return (nnx.to_pure_dict(nnx.state(model)),
                None if optimizer is None else nnx.to_pure_dict(nnx.state(optimizer)))

    def restore(self, step: int, model, optimizer, data_iterator, *,
                check_meta: Callable[[int, dict], None] | None = None) -> dict:
        """Load checkpoint `step` into `model`, `optimizer` and `data_iterator` in place; return its meta.

        Raises:
          ValueError: the checkpoint cannot be read (message: path, step, item, error), does not fit
            the model/optimizer, or `check_meta` (see `_read`) refused it.
        """
        try:
            restored = self._read(step, *self._targets(model, optimizer), data_iterator, check_meta)
        except _UnreadableError as e:
            raise ValueError(self._unreadable(step, e).describe()) from e.exc
        return self._apply(restored, model, optimizer)

    def restore_model(self, step: int, model, *, check_meta: Callable[[int, dict], None] | None = None) -> dict:
        """Load only the model parameters of checkpoint `step` into `model` (for eval/sampling); return meta.

        Raises:
          ValueError: as `restore`.
        """
        return self.restore(step, model, None, None, check_meta=check_meta)

    def _unreadable(self, step: int, e: _UnreadableError) -> Unreadable:
        return Unreadable(step=step, path=self.step_path(step), item=e.item, error=_error_summary(e.exc))

    def _move_aside(self, step: int) -> str:
        """Rename step folder `step` to `<step>.corrupt` (`.corrupt.1`, ... if taken); return the new path."""
        src = self.step_path(step)
        dst, n = src + CORRUPT_SUFFIX, 0
        while os.path.exists(dst):
            n += 1
            dst = f"{src}{CORRUPT_SUFFIX}.{n}"
        os.rename(src, dst)
        return dst

    def restore_latest(self, model, optimizer=None, data_iterator=None, *, move_aside: bool = True,
                       check_meta: Callable[[int, dict], None] | None = None) -> dict | None:
        """Restore the newest checkpoint that reads in full; return its meta, or None if there is none.

        Each checkpoint, newest first, is read in full (array metadata, every array, the data-iterator
        state, the meta JSON); the first that reads is loaded into `model` (and `optimizer`,
        `data_iterator` when given) in place. Every newer one that could not be read is moved aside to
        `<step>.corrupt` (with `move_aside`; never deleted) and reported in one warning line on the
        "k3jax" logger: its path and step, the item and error, the new path, the step resumed from.

        Args:
          model, optimizer, data_iterator: restored in place; optimizer/data_iterator None = skip them
            (eval and sampling read the model only).
          move_aside: False leaves damaged folders where they are (readers that are not the run's writer).
          check_meta: called with (step, meta) of each readable checkpoint before its arrays are read; a
            ValueError it raises refuses the checkpoint and propagates (the trainer refuses another
            tokenizer this way). Not damage: nothing is moved.

        Returns:
          The restored checkpoint's meta dict ({"step", "seed"} from the trainer), or None when the folder
          holds no checkpoint.

        Raises:
          ValueError: checkpoints exist but none is readable (names the folder and each failure; nothing
            is moved), a readable one was written for another model/optimizer structure, or
            `check_meta` refused it.
        """
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        targets = self._targets(model, optimizer)
        damaged: list[Unreadable] = []
        for step in steps:
            try:
                restored = self._read(step, *targets, data_iterator, check_meta)
            except _UnreadableError as e:
                damaged.append(self._unreadable(step, e))
                continue
            meta = self._apply(restored, model, optimizer)
            for bad in damaged:
                if move_aside:
                    moved = self._move_aside(bad.step)
                    log.warning("%s; moved it aside to %s; resuming from step %d", bad.describe(), moved, step)
                else:
                    log.warning("%s; left in place; using step %d", bad.describe(), step)
            if damaged and move_aside:
                self.manager.reload()
            return meta
        raise ValueError(f"no readable checkpoint under {self.directory} (nothing was moved or deleted): "
                         + "; ".join(bad.describe() for bad in damaged)
                         + ". Move the damaged step folders away to start the run from scratch")

    def close(self):
        self._metadata_reader.close()
        self.manager.close()
