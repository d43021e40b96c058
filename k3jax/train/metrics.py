"""Metrics writers: JSON lines (one object per logged step) and TensorBoard (tensorboardX)."""
from __future__ import annotations

import json
import os

from tensorboardX import SummaryWriter


class MetricsWriter:
    """Appends `{"step": s, **scalars}` lines to `<workdir>/metrics.jsonl` and TensorBoard scalars.

    On resume pass `resume_step`: lines logged after that step by an interrupted run are dropped first,
    so the file holds one history with no duplicated steps.
    """

    def __init__(self, workdir: str, *, resume_step: int | None = None):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        if resume_step is not None and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.path)
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, scalars: dict):
        clean = {k: float(v) for k, v in scalars.items()}
        self._file.write(json.dumps({"step": int(step), **clean}) + "\n")
        self._file.flush()
        for k, v in clean.items():
            self._tb.add_scalar(k, v, int(step))

    def close(self):
        self._file.close()
        self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
    """All JSON lines of `<workdir>/metrics.jsonl`."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
