"""The experiment recipe: one YAML file loaded into dataclasses, with dotted overrides (docs/TRAINING.md).

Every key is checked: an unknown key is an error that names the closest valid key. Command-line
overrides are `section.key=value`, values parsed as YAML (`train.lr=3e-4`, `model.tie_embeddings=true`,
`data.task_args.n_pairs=8`).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.constants import DEFAULT_SEED, REPO_ROOT
from common.errors import RecipeError, did_you_mean
from data_pipeline.config import DataSource, parse_data
from model import PRESETS, ModelConfig, preset

from .recipe_checks import NanPolicy, check_name, check_profile, check_task, check_types, check_value

DS_CONFIG_DIR = REPO_ROOT / "ds_configs"
Decay = typing.Literal["cosine", "linear", "constant", "wsd"]
Checkpointing = typing.Literal["none", "selective", "full", "auto"]


@dataclass
class TrainConfig:
    seq_len: int = 64
    global_batch_sequences: int | None = None  # exactly one of these two
    global_batch_tokens: int | None = None
    micro_batch_sequences: int = 4  # per data-parallel rank, per forward pass
    max_steps: int | None = None  # exactly one of max_steps / max_tokens
    max_tokens: int | None = None
    precision: str = "fp32"  # fp32 | bf16 (fp16 is not supported)
    grad_clip: float = 1.0  # 0 disables clipping
    # none | selective | full | auto (pretrain/parallelize.py; auto: the least recomputation that fits the
    # device by pretrain/memory.py's estimate); a recipe's true/false read as full/none
    activation_checkpointing: Checkpointing = "none"
    compile: bool = False  # torch.compile each decoder block (pretrain/parallelize.py)
    device: typing.Literal["auto", "cpu", "cuda"] = "auto"
    init_seed: int | None = None  # model init seed; None -> top-level seed
    eval_every_steps: int = 0  # 0: no periodic validation
    eval_batches: int = 4  # validation batches (of global_batch_sequences) per evaluation
    nan_policy: NanPolicy = "stop"  # a non-finite loss (pretrain/loop.py)
    max_nan_skips: int = 5  # more non-finite steps than this in one process stop the run

    def __post_init__(self):
        if isinstance(self.activation_checkpointing, bool):  # the key's earlier form
            self.activation_checkpointing = "full" if self.activation_checkpointing else "none"


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    decay: Decay = "cosine"  # wsd: warmup-stable-decay (pretrain/loop.py lr_at)
    decay_steps: int | None = None  # cosine/linear: None -> max_steps - warmup_steps
    decay_fraction: float = 0.2  # wsd: the last share of max_steps that decays (1-sqrt) to min_lr
    decay_start: int | None = None  # wsd: the first decaying step; None -> max_steps * (1 - decay_fraction)
    # resume under a schedule that changes the rate of a step already trained (pretrain/resume.py check_schedule)
    allow_schedule_change: bool = False
    no_decay: list[str] = field(default_factory=lambda: ["bias", "norm", "embed"])  # names without weight decay
    torch_adam: bool = True  # torch.optim.AdamW (no JIT build); false -> DeepSpeed's fused Adam
    fused: bool = True  # torch AdamW's fused kernel (CPU and CUDA: ~4x its foreach step on CPU)


@dataclass
class ParallelConfig:
    ds_config: str = "zero1"  # a name in ds_configs/ or a path to a JSON file
    pipeline_stages: int = 1
    partition_method: str = "parameters"  # PipelineModule partitioning: parameters | uniform | type:Block
    # How long a collective waits for the slowest rank before every rank stops with a message (a dead or hung
    # peer): a number bounds every collective from the start; null derives the bound from the measured step
    # time, max(min_timeout_s, 20x the median step), once the first steps are timed (pretrain/bounds.py)
    timeout_s: float | None = None
    min_timeout_s: float = 300.0  # the least a derived step bound waits
    startup_timeout_s: float = 1800.0  # the bound while the run is built, before the steps are timed (timeout_s null)
    rendezvous_timeout_s: float = 300.0  # how long ranks wait for each other to arrive (pretrain/rendezvous.py)


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # 0: no step-based saves
    every_minutes: float = 30.0  # also save when this long has passed since the last save; 0: off
    keep_last: int = 3  # 0 keeps all
    save_final: bool = True
    save_on_signal: bool = True
    load_universal: bool = False  # resume from a universal checkpoint (pretrain.universal)
    background: bool = False  # write, fsync and mark saves on a writer thread (pretrain/checkpoint_writer.py)
    # How long a save's collectives wait for the slowest rank's writes (at least parallel.timeout_s): a
    # save's length is set by the filesystem, not by the step, and a timeout short enough to catch a hung
    # step would stop a healthy save to a slow shared filesystem (docs/TRAINING.md, "Checkpoint timeout").
    timeout_s: float = 3600.0


@dataclass
class LoggingConfig:
    every_steps: int = 1
    tensorboard: bool = True
    progress_bar: typing.Literal["auto", "on", "off"] = "auto"  # auto: on a tty only
    peak_tflops: float | None = None  # per-device peak for MFU; None -> measured, or a table (model/mfu.py)
    measure_peak: bool = False  # measure a matmul peak at start when peak_tflops is None
    wandb: dict[str, Any] | None = None  # pretrain/trackers.py: project, group, name, tags, mode, entity
    mlflow: dict[str, Any] | None = None  # pretrain/trackers.py: tracking_uri, experiment, group, name
    # a tracker that does not start (server unreachable, no API key): fail (one error line, before training)
    # or warn (the run goes on logging locally: metrics.jsonl, TensorBoard)
    on_tracker_error: typing.Literal["fail", "warn"] = "fail"

    def __post_init__(self):
        if isinstance(self.progress_bar, bool):  # YAML reads an unquoted off/on as a boolean
            self.progress_bar = "on" if self.progress_bar else "off"


@dataclass
class EvalConfig:
    """Downstream evaluations during training (pretrain/eval_tasks.py), run at the validation cadence
    (`train.eval_every_steps` and the last step) and logged under `eval/...`."""

    tasks: list[str] = field(default_factory=list)  # bits_per_byte | induction | exact_match:FILE.jsonl
    induction_lengths: list[int] = field(default_factory=lambda: [16, 32, 64])  # repeated-segment lengths
    n: int = 32  # induction sequences per length
    batch_size: int = 8


@dataclass
class ProfileConfig:
    """A torch profiler trace of some optimizer steps (pretrain/profiling.py)."""

    steps: list[int] = field(default_factory=list)  # [start, end], 1-based, inclusive; [] profiles nothing
    ranks: str = "0"  # "0" or "all"
    record_shapes: bool = False
    with_stack: bool = False
    memory: bool = False  # CUDA memory snapshot of the same steps


@dataclass
class ModelSection:
    """The recipe's `model` section: a preset of the size ladder (model/config.py) and the ModelConfig
    fields the recipe sets over it, names and types checked at load. The ModelConfig itself is made
    when the data's vocabulary is known (pretrain/task_model.py): an unset vocab_size takes the data's,
    and a classifier's pretrained backbone takes only the fields set here."""

    preset: str = "tiny"
    fields: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, d: dict[str, Any]) -> "ModelSection":
        d = dict(d)
        name = d.pop("preset", "tiny")
        if name not in PRESETS:
            hint = did_you_mean(str(name), PRESETS)
            raise RecipeError(f"model.preset: unknown preset {name!r}. Fix: {hint}choose one of {list(PRESETS)}")
        hints = typing.get_type_hints(ModelConfig)
        for k, v in d.items():
            if k not in hints:
                raise _unknown("model.", k, set(hints) | {"preset"})
            if k == "vocab_size" and v is None:  # null: the data's vocabulary, even over a preset's own
                continue
            default = next(f.default for f in dataclasses.fields(ModelConfig) if f.name == k)
            check_value(f"model.{k}", v, hints[k], default)
        return cls(name, d)

    @property
    def variant(self) -> str:
        return self.fields.get("variant", "standard")

    def to_dict(self) -> dict[str, Any]:
        """The section as a recipe writes it."""
        return {"preset": self.preset, **copy.deepcopy(self.fields)}

    def check(self, seq_len: int) -> None:
        """The values together make a model (heads divide the width, ...): checked at load with a stand-in
        vocabulary where the data gives it, so a bad shape is one error line before any data is read."""
        fields = {"max_seq_len": seq_len, **self.fields}
        if fields.get("vocab_size", PRESETS[self.preset].get("vocab_size")) is None:  # the data gives it
            fields["vocab_size"] = 256
        preset(self.preset, **fields)


@dataclass
class RunConfig:
    name: str = "run"
    seed: int = DEFAULT_SEED
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSource | None = None  # data_pipeline.config.parse_data: shards, mixture, synthetic, text or classify
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    task: str = "lm"  # lm | classification (pretrain/classification.py)
    classification: dict[str, Any] = field(default_factory=dict)  # num_labels, pooling, init_from

    # ---- derived ----------------------------------------------------------------------
    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across all data-parallel ranks."""
        t = self.train
        if t.global_batch_sequences is not None:
            return t.global_batch_sequences
        return t.global_batch_tokens // t.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.train.seq_len

    @property
    def max_steps(self) -> int:
        t = self.train
        if t.max_steps is not None:
            return t.max_steps
        return -(-t.max_tokens // self.tokens_per_step)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "model": self.model.to_dict()}

    def validate(self) -> None:
        t, o, p, c = self.train, self.optim, self.parallel, self.checkpoint
        if (t.global_batch_sequences is None) == (t.global_batch_tokens is None):
            raise RecipeError(
                "train: give exactly one of global_batch_sequences or global_batch_tokens "
                f"(got {t.global_batch_sequences!r} and {t.global_batch_tokens!r})"
            )
        if t.global_batch_tokens is not None and t.global_batch_tokens % t.seq_len:
            raise RecipeError(
                f"train.global_batch_tokens={t.global_batch_tokens} is not a multiple of "
                f"train.seq_len={t.seq_len}. Fix: use e.g. {t.seq_len * max(1, t.global_batch_tokens // t.seq_len)}"
            )
        if (t.max_steps is None) == (t.max_tokens is None):
            raise RecipeError(
                f"train: give exactly one of max_steps or max_tokens (got {t.max_steps!r} and {t.max_tokens!r})"
            )
        for name in ("seq_len", "micro_batch_sequences"):
            if getattr(t, name) < 1:
                raise RecipeError(f"train.{name} must be >= 1")
        if self.global_batch_size < 1 or self.max_steps < 1:
            raise RecipeError("train: the global batch and the number of steps must be >= 1")
        if t.precision not in ("fp32", "bf16"):
            hint = " (fp16 needs loss scaling and is not supported; use bf16)" if t.precision == "fp16" else ""
            raise RecipeError(f"train.precision must be fp32 or bf16, got {t.precision!r}{hint}")
        if not (0.0 <= o.decay_fraction <= 1.0):
            raise RecipeError(f"optim.decay_fraction={o.decay_fraction} must be in [0, 1]. Fix: e.g. 0.2")
        if o.decay_start is not None and o.decay_start < o.warmup_steps:
            raise RecipeError(
                f"optim.decay_start={o.decay_start} is inside the warmup (optim.warmup_steps={o.warmup_steps}). "
                "Fix: a step >= warmup_steps, or null for max_steps * (1 - decay_fraction)"
            )
        if not (0 <= o.min_lr <= o.lr):
            raise RecipeError(f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
        if len(o.betas) != 2:
            raise RecipeError(f"optim.betas must be two numbers, got {o.betas!r}")
        if o.warmup_steps < 0:
            raise RecipeError("optim.warmup_steps must be >= 0")
        if p.pipeline_stages < 1:
            raise RecipeError("parallel.pipeline_stages must be >= 1")
        if p.pipeline_stages > 1 and getattr(self.data, "return_doc_ids", False):
            raise RecipeError(
                "data.return_doc_ids: per-document masking does not reach pipeline stages. "
                "Fix: set parallel.pipeline_stages=1, or drop data.return_doc_ids"
            )
        if c.keep_last < 0 or c.every_steps < 0 or c.every_minutes < 0:
            raise RecipeError("checkpoint.keep_last, checkpoint.every_steps and checkpoint.every_minutes must be >= 0")
        check_name(self.name)
        bounds = (
            1 if p.timeout_s is None else p.timeout_s,
            p.min_timeout_s,
            p.startup_timeout_s,
            p.rendezvous_timeout_s,
            c.timeout_s,
        )
        if t.max_nan_skips < 0 or min(bounds) <= 0:
            raise RecipeError(
                "train.max_nan_skips must be >= 0; parallel.timeout_s (or null), parallel.min_timeout_s, "
                "parallel.startup_timeout_s, parallel.rendezvous_timeout_s and checkpoint.timeout_s > 0"
            )
        check_task(self)
        check_profile(self.profile)
        if not (self.task == "classification" and self.classification.get("init_from")):
            self.model.check(t.seq_len)  # a pretrained backbone gives the fields the section leaves unset


SECTIONS = {
    "train": TrainConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "eval": EvalConfig,
    "profile": ProfileConfig,
}
TOP_KEYS = ("name", "seed", "task", "classification", "model", "data") + tuple(SECTIONS)


# Common names from other trainers -> where the setting lives here.
SYNONYMS = {
    "learning_rate": "optim.lr",
    "lr": "optim.lr",
    "zero_stage": "parallel.ds_config (pick zero0..zero3)",
    "stage": "parallel.ds_config (pick zero0..zero3)",
    "batch_size": "train.global_batch_sequences",
    "global_batch_size": "train.global_batch_sequences",
    "micro_batch_size": "train.micro_batch_sequences",
    "steps": "train.max_steps",
    "wd": "optim.weight_decay",
    "warmup": "optim.warmup_steps",
    "grad_accum": "train.micro_batch_sequences (grad-accum = global / (micro x data-parallel))",
    "gradient_accumulation_steps": "train.micro_batch_sequences (grad-accum = global / (micro x data-parallel))",
    "bf16": "train.precision=bf16",
    "fp16": "train.precision (fp32 | bf16)",
    "pp": "parallel.pipeline_stages",
}


def _unknown(where: str, key: str, valid) -> RecipeError:
    valid = sorted(valid)
    hint = did_you_mean(key, valid, 3).strip()
    if not hint:
        everywhere = {f"{sec}.{f.name}": f.name for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
        other = [
            q for q, n in everywhere.items() if n in difflib.get_close_matches(key, list(everywhere.values()), n=2)
        ]
        if key in SYNONYMS:
            other = [SYNONYMS[key]] + other
        hint = (
            f"did you mean {', '.join(repr(o) for o in other[:3])}? " if other else ""
        ) + f"valid keys here: {valid}"
    return RecipeError(f"{where}{key}: unknown key. Fix: {hint}")


def from_dict(d: dict[str, Any]) -> RunConfig:
    """Build a RunConfig from a plain mapping; unknown keys are errors with close matches."""
    d = copy.deepcopy(d or {})
    if not isinstance(d, dict):
        raise RecipeError(f"a recipe must be a mapping of sections, got {type(d).__name__}")
    for k in d:
        if k not in TOP_KEYS:
            raise _unknown("", k, TOP_KEYS)
    kwargs: dict[str, Any] = {k: d[k] for k in ("name", "seed", "task") if k in d}
    for sec in ("model", "data", "classification"):
        if sec in d:
            if not isinstance(d[sec], dict):
                raise RecipeError(f"{sec}: must be a mapping, got {d[sec]!r}")
            kwargs[sec] = d[sec]
    if "model" in kwargs:
        kwargs["model"] = ModelSection.parse(kwargs["model"])
    for sec, cls in SECTIONS.items():
        if sec not in d:
            continue
        body = d[sec] or {}
        if not isinstance(body, dict):
            raise RecipeError(f"{sec}: must be a mapping, got {body!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        for k in body:
            if k not in names:
                raise _unknown(f"{sec}.", k, names)
        kwargs[sec] = cls(**body)
        check_types(sec, kwargs[sec])
    if "data" in kwargs:
        kwargs["data"] = parse_data(kwargs["data"], kwargs.get("seed", RunConfig.seed))
    cfg = RunConfig(**kwargs)
    cfg.validate()
    return cfg


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise RecipeError(f"override {item!r} must look like section.key=value (e.g. train.lr=3e-4)")
    key, _, raw = item.partition("=")
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise RecipeError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError as e:
        raise RecipeError(f"override {item!r}: value is not valid YAML ({e})") from None
    # YAML 1.1 reads 3e-4 as a string; accept it as the number it obviously is.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return path, value


# Short aliases so `train.lr=3e-4` works as written in the issue (lr lives in optim).
ALIASES = {("train", k): ("optim", k) for k in ("lr", "min_lr", "warmup_steps", "weight_decay")}


def apply_overrides(d: dict[str, Any], overrides: list[str] | tuple[str, ...] | dict | None) -> dict[str, Any]:
    d = copy.deepcopy(d or {})
    if isinstance(overrides, dict):
        items = [(k.split("."), v) for k, v in overrides.items()]
    else:
        items = [parse_override(o) for o in (overrides or [])]
    for path, value in items:
        if len(path) >= 2 and tuple(path[:2]) in ALIASES:
            path = list(ALIASES[tuple(path[:2])]) + path[2:]
        if path[0] not in TOP_KEYS:
            raise _unknown("", path[0], TOP_KEYS)
        node = d
        for p in path[:-1]:
            if node.get(p) is None:
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise RecipeError(f"override {'.'.join(path)}: {p} is not a section")
        node[path[-1]] = value
    return d


def load_recipe(recipe: str | Path | dict | None, overrides=None) -> RunConfig:
    """A recipe path (or mapping) plus dotted overrides -> a validated RunConfig."""
    if recipe is None:
        d: dict[str, Any] = {}
    elif isinstance(recipe, dict):
        d = recipe
    else:
        path = Path(recipe)
        if not path.is_file() and (REPO_ROOT / path).is_file():
            path = REPO_ROOT / path
        if not path.is_file():
            raise RecipeError(f"recipe {recipe} not found")
        d = parse_yaml_file(path)
    return from_dict(apply_overrides(d, overrides))


def parse_yaml_file(path: Path) -> Any:
    """`yaml.safe_load` of a recipe file; malformed YAML (or a tag asking to build a Python object)
    is a RecipeError naming the file, the line and column, and the problem."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.MarkedYAMLError as e:
        mark, ctx = e.problem_mark or e.context_mark, e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = e.context and (f"{e.context} from line {ctx.line + 1}" if ctx is not None else e.context)
        what = "; ".join(x for x in (context, e.problem) if x)
        raise RecipeError(
            f"{where}: not valid recipe YAML ({what}). Fix: correct the YAML at that line (indentation, "
            "a missing ':' or an unclosed quote or bracket are the usual causes); only plain values, "
            "lists and mappings are allowed"
        ) from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"{path}: not valid recipe YAML ({e}). Fix: save the recipe as UTF-8 YAML text") from None


def resolve_ds_config_path(name: str) -> Path:
    p = Path(name)
    for cand in (p, REPO_ROOT / p, DS_CONFIG_DIR / p, DS_CONFIG_DIR / f"{name}.json"):
        if cand.is_file():
            return cand
    names = sorted(x.stem for x in DS_CONFIG_DIR.glob("*.json"))
    hint = did_you_mean(name, names, 3)
    raise RecipeError(
        f"parallel.ds_config: {name!r} is neither a file nor a name in ds_configs/. Fix: {hint}choose one of {names}"
    )
