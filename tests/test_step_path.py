"""The files one optimizer step passes through, traced (docs/ARCHITECTURE.md lists them): step 8 of a
standard run on a synthetic task (after the first steps that time the step bound), its batch built in the
step (data.prefetch=0), logged (TensorBoard on, as by default), and the save decision after it."""

from __future__ import annotations

import os
import sys
import threading

from pretrain import setup
from pretrain.bounds import TIMED_STEPS
from pretrain.callbacks import Callback
from pretrain.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_PATH = {
    "pretrain/loop.py",
    "pretrain/engine.py",
    "pretrain/metrics.py",
    "pretrain/trackers.py",
    "pretrain/periodic_save.py",
    "data_pipeline/loader.py",
    "data_pipeline/synthetic.py",
    "model/config.py",
    "model/transformer.py",
    "model/layers.py",
    "model/kernels/select.py",
    "model/kernels/loss.py",
}


STEP = TIMED_STEPS + 3  # a step of a run in its stride: the step bound is derived from the steps before it


class Trace(Callback):
    """Records every project file a Python call enters from before_step(STEP) to before_step(STEP + 1): the
    whole of that step, its record, its trackers and the save decision included."""

    def __init__(self):
        self.files: set[str] = set()

    def _profile(self, frame, event, arg):
        f = frame.f_code.co_filename
        if f.startswith(ROOT) and f"{os.sep}.venv{os.sep}" not in f and not f.endswith(__file__.split(os.sep)[-1]):
            self.files.add(os.path.relpath(f, ROOT))

    def before_step(self, step: int) -> None:
        if step == STEP:
            sys.setprofile(self._profile)
            threading.setprofile(self._profile)
        elif step == STEP + 1:
            sys.setprofile(None)
            threading.setprofile(None)


def test_one_step_passes_through_these_files(tmp_path, monkeypatch):
    trace = Trace()

    class TracedLoop(setup.TrainingLoop):
        def __init__(self, ctx, engine, loader, logger, checkpointer, callbacks, bounds):
            super().__init__(ctx, engine, loader, logger, checkpointer, [*callbacks, trace], bounds)

    monkeypatch.setattr(setup, "TrainingLoop", TracedLoop)
    over = [
        f"train.max_steps={STEP + 1}",
        "model.variant=standard",
        "train.eval_every_steps=0",
        "logging.every_steps=1",
    ]
    train("recipes/tiny_cpu.yaml", [*over, "data.prefetch=0", "checkpoint.save_final=false"], run_dir=tmp_path / "run")
    assert trace.files == STEP_PATH, sorted(trace.files)
