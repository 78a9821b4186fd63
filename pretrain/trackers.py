"""Experiment trackers, callbacks that receive every record the loop logs (rank 0): TensorBoard
(`logging.tensorboard`, RUN_DIR/tb), Weights & Biases (`logging.wandb`) and MLflow (`logging.mlflow`).

    logging:
      wandb: {project: variants, group: scaling, name: std-n27k, tags: [cpu], mode: offline}
      mlflow: {tracking_uri: file:./mlruns, experiment: variants, group: scaling}

What they receive, and resuming the same tracked run (RUN_DIR/trackers.json): docs/TRAINING.md.
MLflow 3 opens its local file store (`file:` URIs) only with MLFLOW_ALLOW_FILE_STORE=true; a `file:`
URI sets that. A tracker that does not start (an unreachable server: MLflow's HTTP retries are bounded
here to about 30 s unless MLFLOW_HTTP_REQUEST_* say otherwise; W&B online without an API key) is one
error line before training, or a warning with `logging.on_tracker_error: warn`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.constants import atomic_write
from common.errors import RecipeError

from .callbacks import Callback
from .metrics import named_scalars
from .recipe_checks import check_types

IDS = "trackers.json"
WANDB_MODES = ("online", "offline", "disabled")
# MLflow's defaults retry an unreachable server for minutes (7 retries, backoff factor 2, 120 s timeout);
# a run that cannot log should say so within about 30 s. The environment wins where it sets them.
MLFLOW_HTTP_BOUNDS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
FIXES = {
    "wandb": "run `wandb login` or set WANDB_API_KEY on this node, or logging.wandb.mode=offline",
    "mlflow": "check that logging.mlflow.tracking_uri is reachable from this node (or use file:./mlruns)",
}


@dataclass
class WandbSettings:
    project: str
    group: str | None = None  # studies set the study's name
    name: str | None = None  # default: the recipe's name (a study's cell)
    tags: list[str] = field(default_factory=list)
    mode: str = "online"  # online | offline (files under RUN_DIR/wandb, `wandb sync` later) | disabled
    entity: str | None = None


@dataclass
class MlflowSettings:
    tracking_uri: str  # http(s)://server, databricks, or file:PATH (a local store)
    experiment: str = "Default"
    group: str | None = None  # a `group` tag on the run
    name: str | None = None  # default: the recipe's name


def parse_settings(cls, section: str, body: dict[str, Any] | None):
    """A typed settings object from the recipe's mapping, or None when absent."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise RecipeError(f"{section}: must be a mapping, got {body!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(body) - names)
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [k for k in required if k not in body]
    if unknown or missing:
        what = f"unknown keys {unknown}" if unknown else f"missing {missing}"
        raise RecipeError(f"{section}: {what}. Fix: use the keys {sorted(names)} ({', '.join(required)} required)")
    settings = cls(**body)
    check_types(section, settings)
    return settings


def _require(package: str, key: str):
    try:
        return importlib.import_module(package)
    except ImportError:
        raise RecipeError(
            f"{key} is set but the {package} package is not installed. Fix: pip install {package}, "
            f"or remove {key} from the recipe"
        ) from None


def _settings(logging_cfg) -> tuple[WandbSettings | None, MlflowSettings | None]:
    """The recipe's tracker sections, typed (None where absent)."""
    wb = parse_settings(WandbSettings, "logging.wandb", logging_cfg.wandb)
    return wb, parse_settings(MlflowSettings, "logging.mlflow", logging_cfg.mlflow)


def check_trackers(logging_cfg) -> None:
    """Refuse bad tracker settings or a missing package before any work (every rank)."""
    wb, ml = _settings(logging_cfg)
    if wb is not None:
        if wb.mode not in WANDB_MODES:
            raise RecipeError(f"logging.wandb.mode must be one of {list(WANDB_MODES)}, got {wb.mode!r}")
        _require("wandb", "logging.wandb")
    if ml is not None:
        _require("mlflow", "logging.mlflow")


def _ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / IDS
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_id(run_dir: Path, key: str, value: str) -> None:
    atomic_write(run_dir / IDS, json.dumps({**_ids(run_dir), key: value}, indent=2))


def flat_config(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 3e-3}} -> {"optim.lr": "0.003"} (MLflow parameters are flat strings)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v)[:6000]
    return out


class WandbTracker(Callback):
    def __init__(self, settings: WandbSettings, run_dir: Path, run_name: str, config: dict[str, Any]):
        self.last: dict[str, Any] | None = None  # the last record: the final metrics at close
        self.exit_code = 0
        wandb = _require("wandb", "logging.wandb")
        run_id = _ids(run_dir).get("wandb") or uuid.uuid4().hex[:12]
        _save_id(run_dir, "wandb", run_id)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity,
            group=settings.group,
            name=settings.name or run_name,
            tags=settings.tags,
            mode=settings.mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
        )

    def on_record(self, rec: dict[str, Any]) -> None:
        self.run.log(named_scalars(rec), step=int(rec["step"]))
        self.last = rec

    def on_exception(self, error: BaseException) -> None:
        self.exit_code = 1

    def close(self) -> None:
        if self.last is not None:  # the final metrics, under their names, in the run's summary
            self.run.summary.update(named_scalars(self.last))
        self.run.finish(exit_code=self.exit_code)  # 1: the run is marked failed


class MlflowTracker(Callback):
    def __init__(self, settings: MlflowSettings, run_dir: Path, run_name: str, config: dict[str, Any]):
        self.last: dict[str, Any] | None = None  # the last record: the final metrics at close
        self.status = "FINISHED"
        if settings.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for key, value in MLFLOW_HTTP_BOUNDS.items():
            os.environ.setdefault(key, value)
        mlflow = _require("mlflow", "logging.mlflow")
        from mlflow.entities import Metric, Param  # deferred: heavy (mlflow)

        self.Metric = Metric
        self.client = mlflow.tracking.MlflowClient(settings.tracking_uri)
        run_id = _ids(run_dir).get("mlflow")
        if run_id is None:
            exp = self.client.get_experiment_by_name(settings.experiment)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(settings.experiment)
            tags = {"group": settings.group} if settings.group else {}
            run_id = self.client.create_run(exp_id, run_name=settings.name or run_name, tags=tags).info.run_id
            params = [Param(k, v) for k, v in flat_config(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(run_id, params=params[i : i + 100])
            self.client.log_dict(run_id, config, "resolved_recipe.yaml")  # the recipe as the run resolved it
            _save_id(run_dir, "mlflow", run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def on_record(self, rec: dict[str, Any]) -> None:
        step, now = int(rec["step"]), int(1000 * time.time())
        metrics = [self.Metric(k, v, now, step) for k, v in named_scalars(rec).items()]
        self.client.log_batch(self.run_id, metrics=metrics)
        self.last = rec

    def close(self) -> None:
        if self.last is not None:  # the final metrics as an artifact beside the recipe
            self.client.log_dict(
                self.run_id, {"step": self.last["step"], **named_scalars(self.last)}, "final_metrics.json"
            )
        self.client.set_terminated(self.run_id, status=self.status)

    def on_exception(self, error: BaseException) -> None:
        self.status = "FAILED"


class TensorBoardTracker(Callback):
    """RUN_DIR/tb; a resumed run's events after its resume step are dropped (they are recomputed)."""

    def __init__(self, run_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # deferred: heavy (tensorboard)

        self.writer = SummaryWriter(str(run_dir / "tb"), purge_step=start_step + 1 if start_step else None)

    def on_record(self, rec: dict[str, Any]) -> None:
        for k, v in named_scalars(rec).items():
            self.writer.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def build_trackers(
    logging_cfg, run_dir: Path, run_name: str, config: dict[str, Any], start_step: int, warn=print
) -> list[Callback]:
    """The recipe's trackers (rank 0 only calls this). TensorBoard is left out where it is not installed.
    Another that does not start is a RecipeError naming it and the fix, or, with
    `logging.on_tracker_error: warn`, a warning and no such tracker."""
    wb, ml = _settings(logging_cfg)
    out: list[Callback] = []
    if logging_cfg.tensorboard:
        with contextlib.suppress(ImportError):
            out.append(TensorBoardTracker(run_dir, start_step))
    for key, settings, cls in (("wandb", wb, WandbTracker), ("mlflow", ml, MlflowTracker)):
        if settings is None:
            continue
        try:
            out.append(cls(settings, run_dir, run_name, config))
        except RecipeError:
            raise  # the package is missing: its own line
        except Exception as e:  # noqa: BLE001 - the trackers raise their own types (UsageError, MlflowException, ...)
            why = (str(e).strip().splitlines() or [""])[0][:300]
            what = f"logging.{key}: the tracker did not start ({type(e).__name__}: {why})"
            if getattr(logging_cfg, "on_tracker_error", "fail") == "warn":
                warn(f"warning: {what}; the run goes on without it (metrics.jsonl and TensorBoard still log)")
                continue
            raise RecipeError(
                f"{what}. Fix: {FIXES[key]}, or logging.on_tracker_error=warn to train without it"
            ) from None
    return out
