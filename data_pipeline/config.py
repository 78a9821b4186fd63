"""`DataConfig`: what data to train on, validated up front.

Why: a typo in a mixture weight or a task name should fail in the first second of a job,
not after the model has been built and sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from common.constants import DEFAULT_SEED
from common.errors import DataError

from .foreign import check_foreign, is_foreign
from .synthetic import TASKS

VERIFY_MODES = ("full", "size")
VAL_FRACTION = 0.05  # the one default held-out share: a shard or text stream's tail, a classification file's share
TEXT_PREFIX, CLASSIFY_PREFIX = "text:", "classify:"
DOCUMENTS = ("stream", "lines")  # TextData.documents
WINDOWS = ("stream", "documents")  # TextData.windows


def check_val_fraction(value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise DataError(f"data.val_fraction must be a number in [0, 0.5], got {value!r}") from None
    if not (0.0 <= value <= 0.5):
        raise DataError(f"data.val_fraction must be in [0, 0.5], got {value}")
    return value


def parse_mixture_string(spec: str) -> list[dict]:
    """Parse ``"path_a=0.7,path_b=0.3"`` (the text after ``mixture:``) into mixture entries."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" not in part:
            raise DataError(
                f"DataConfig.source: mixture entry {part!r} has no weight. Fix: write it as PATH=WEIGHT, "
                "e.g. 'mixture:/data/web=0.7,/data/code=0.3'"
            )
        path, _, weight = part.rpartition("=")
        out.append({"path": path, "weight": weight})
    return out


def normalize_mixture(mixture: Any) -> list[dict]:
    """Check mixture entries and return them with float weights (not yet normalised)."""
    if not isinstance(mixture, (list, tuple)) or not mixture:
        raise DataError(
            "DataConfig.mixture must be a non-empty list of {path, weight} dicts, "
            f"got {mixture!r}. Fix: e.g. mixture=[{{'path': 'data/web', 'weight': 0.7}}, ...]"
        )
    out = []
    for i, entry in enumerate(mixture):
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            raise DataError(f"DataConfig.mixture[{i}] = {entry!r} must be a dict with keys 'path' and 'weight'")
        extra = set(entry) - {"path", "weight"}
        if extra:
            raise DataError(
                f"DataConfig.mixture[{i}] has unknown keys {sorted(extra)}; only 'path' and 'weight' are allowed"
            )
        raw = entry["weight"]
        try:
            if isinstance(raw, bool):
                raise TypeError
            weight = float(raw)
        except (TypeError, ValueError):
            raise DataError(
                f"DataConfig.mixture[{i}] (path {entry['path']!r}): weight {raw!r} is not a number. "
                "Fix: use a non-negative number such as 0.3"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise DataError(f"DataConfig.mixture[{i}] (path {entry['path']!r}): weight {raw!r} must be finite and >= 0")
        if not isinstance(entry["path"], str) or not entry["path"]:
            raise DataError(f"DataConfig.mixture[{i}]: path must be a non-empty string, got {entry['path']!r}")
        out.append({"path": entry["path"], "weight": weight})
    total = sum(e["weight"] for e in out)
    if total <= 0:
        raise DataError(
            f"DataConfig.mixture weights sum to {total}; at least one weight must be > 0 "
            "(weights are relative and are normalised to sum to 1)"
        )
    return out


def check_val_sets(val_sets: Any, source: str) -> None:
    """`data.val_sets` is a non-empty mapping of simple names to shard directories, beside shard data."""
    if val_sets is None:
        return
    if not isinstance(val_sets, dict) or not val_sets:
        raise DataError(
            f"data.val_sets must be a mapping of names to prepared shard dirs, got {val_sets!r}. "
            "Fix: e.g. {linux-doc: shards/valid-linux-doc, gcide: shards/valid-gcide}"
        )
    if source.startswith("synthetic:"):
        raise DataError(
            "data.val_sets names prepared shard dirs; a synthetic task has its own test split. Fix: remove it"
        )
    for name, path in val_sets.items():
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_." for c in name):
            raise DataError(
                f"data.val_sets: name {name!r} must be letters, digits, '-', '_' or '.' (it names the metric "
                "val_loss/<name>). Fix: e.g. python-doc"
            )
        if not isinstance(path, str) or not path.strip():
            raise DataError(f"data.val_sets.{name} must be a prepared shard dir, got {path!r}")


@dataclass
class DataConfig:
    """Where training sequences come from (docs/TRAINING.md lists the keys; "Data at scale" the remote ones).

    source: a prepared shard directory or URL (``python -m data_pipeline.prepare``), ``"mixture"`` (entries
        in ``mixture``: ``{"path", "weight"}``, weights relative) or ``"mixture:PATH=W,PATH=W"``, a foreign
        token dataset (``megatron:``/``olmo:``, data_pipeline/foreign.py), or ``"synthetic:<task>"`` with its
        ``task_args``. ``seed`` fixes the global order (and a synthetic task's content); ``val_fraction`` is
        the held-out tail of every shard dataset, unless ``val_sets`` names validation sets to read whole.
    tokenizer, vocab_size: what the model was configured with; checked against the manifests.
    verify: ``"full"`` (sha256 + token ids of every shard at start, skipped where a verification record
        says these exact files were checked) or ``"size"``. Remote shards are always size-checked, and
        sha256-checked when cached whole.
    storage_options .. retry_backoff_s: fsspec options, the node-local block cache and retries of remote reads.
    prefetch: batches prepared ahead by a background thread (0: in the training step).
    """

    source: str
    mixture: list[dict] | None = None
    task_args: dict = field(default_factory=dict)
    seed: int = DEFAULT_SEED
    val_fraction: float = VAL_FRACTION
    return_doc_ids: bool = False
    tokenizer: str | None = None
    vocab_size: int | None = None
    verify: str = "full"
    storage_options: dict | None = None
    cache_dir: str | None = None
    cache_max_gb: float = 20.0
    cache_block_kb: int = 1024
    retries: int = 5
    retry_backoff_s: float = 1.0
    prefetch: int = 2
    val_sets: dict[str, str] | None = None
    eos_id: int | None = None  # megatron:/olmo: sources (data_pipeline/foreign.py): the end-of-document token
    token_dtype: str | None = None  # olmo: raw arrays without a .npy header: uint16 | uint32

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise DataError(
                f"DataConfig.source must be a shard directory, 'mixture' or 'synthetic:<task>', got {self.source!r}"
            )
        self.source = self.source.strip()
        if self.source.startswith("mixture:"):
            if self.source != "mixture:":
                if self.mixture:
                    raise DataError(
                        "DataConfig: give the mixture either in source='mixture:...' or in mixture=[...], not both"
                    )
                self.mixture = parse_mixture_string(self.source[len("mixture:") :])
            self.source = "mixture"
        if self.source == "mixture":
            self.mixture = normalize_mixture(self.mixture)
        elif self.mixture is not None:
            raise DataError(
                f"DataConfig.mixture is set but source={self.source!r}. Fix: set source='mixture' to train on the mixture"
            )
        if self.source.startswith("synthetic:"):
            name = self.source.split(":", 1)[1]
            if name not in TASKS:
                raise DataError(
                    f"DataConfig.source: unknown synthetic task {name!r}. Fix: choose one of {sorted(TASKS)}"
                )
        if not isinstance(self.task_args, dict):
            raise DataError(f"DataConfig.task_args must be a dict, got {type(self.task_args).__name__}")
        if self.task_args and not self.source.startswith("synthetic:"):
            raise DataError("DataConfig.task_args only applies to source='synthetic:<task>'. Fix: remove it")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DataError(f"DataConfig.seed must be a non-negative int, got {self.seed!r}")
        self.val_fraction = check_val_fraction(self.val_fraction)
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size <= 0):
            raise DataError(f"DataConfig.vocab_size must be a positive int or None, got {self.vocab_size!r}")
        if self.verify not in VERIFY_MODES:
            raise DataError(f"DataConfig.verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        self.return_doc_ids = bool(self.return_doc_ids)
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise DataError(
                f"DataConfig.storage_options must be a mapping of fsspec options, got {self.storage_options!r}"
            )
        if self.cache_dir is not None and (not isinstance(self.cache_dir, str) or not self.cache_dir):
            raise DataError(f"DataConfig.cache_dir must be a directory path, got {self.cache_dir!r}")
        for name, lo in (("cache_max_gb", 0.0), ("retry_backoff_s", 0.0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
                raise DataError(f"DataConfig.{name} must be a number >= {lo:g}, got {v!r}")
        for name, lo in (("cache_block_kb", 1), ("retries", 0), ("prefetch", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise DataError(f"DataConfig.{name} must be an int >= {lo}, got {v!r}")
        check_val_sets(self.val_sets, self.source)
        paths = [e["path"] for e in self.mixture] if self.source == "mixture" else [self.source]
        for path in filter(is_foreign, paths):
            check_foreign(path, self.vocab_size, self.eos_id, self.token_dtype)

    @property
    def kind(self) -> str:
        """``"synthetic"``, ``"mixture"`` or ``"shards"`` (also megatron:/olmo: token files)."""
        if self.source.startswith("synthetic:"):
            return "synthetic"
        if self.source == "mixture":
            return "mixture"
        return "shards"

    @property
    def task_name(self) -> str | None:
        return self.source.split(":", 1)[1] if self.kind == "synthetic" else None


@dataclass
class TextData:
    """`text:PATH`: UTF-8 text files read by the byte tokenizer, no preparation step (data_pipeline.text).

    documents: stream (the files' bytes are one stream) | lines (every non-empty line a document, ended by EOS).
    windows: stream (cut anywhere) | documents (windows start at a document and hold whole ones, padded).
    return_doc_ids: batches carry each position's document (documents: lines), for document masking."""

    source: str
    seed: int = DEFAULT_SEED
    val_fraction: float = VAL_FRACTION
    documents: str = "stream"
    windows: str = "stream"
    return_doc_ids: bool = False

    def __post_init__(self) -> None:
        self.val_fraction = check_val_fraction(self.val_fraction)
        if self.documents not in DOCUMENTS:
            raise DataError(f"data.documents={self.documents!r} must be one of {DOCUMENTS}")
        if self.windows not in WINDOWS:
            raise DataError(f"data.windows={self.windows!r} must be one of {WINDOWS}")
        if not isinstance(self.return_doc_ids, bool):
            raise DataError(f"data.return_doc_ids must be true or false, got {self.return_doc_ids!r}")
        for key, on in (("windows=documents", self.windows == "documents"), ("return_doc_ids", self.return_doc_ids)):
            if on and self.documents != "lines":
                raise DataError(
                    f"data.{key} needs document boundaries. Fix: set data.documents=lines (every line a document)"
                )


@dataclass
class ClassifyData:
    """`classify:FILE.jsonl|FILE.csv|hf:NAME`: (text, label) examples (data_pipeline.classification).

    tokenizer: "bytes" (default) or a tokenizer dir; pad_id: default 0 for bytes, else the tokenizer's;
    val_source: a separate validation file instead of the held-out `val_fraction`; max_examples: a cap
    on examples read per split."""

    source: str
    seed: int = DEFAULT_SEED
    val_fraction: float = VAL_FRACTION
    text_field: str = "text"
    label_field: str = "label"
    tokenizer: str | None = None
    pad_id: int | None = None
    val_source: str | None = None
    max_examples: int | None = None

    def __post_init__(self) -> None:
        self.val_fraction = check_val_fraction(self.val_fraction)


# The recipe's `data` section: one of these, chosen by the prefix of `source`.
DataSource = DataConfig | TextData | ClassifyData


def parse_data(data: Any, seed: int = DEFAULT_SEED) -> DataSource:
    """A recipe's `data` mapping as its typed source; `seed` (the run's) is the default data seed.
    Unknown keys are errors naming the keys that source takes."""
    if isinstance(data, (DataConfig, TextData, ClassifyData)):
        return data
    if not isinstance(data, dict) or not str(data.get("source") or "").strip():
        raise DataError(
            "data.source is required. Fix: give a prepared shard dir, 'mixture:PATH=W,...', "
            "'synthetic:<task>', 'text:PATH' or 'classify:FILE'"
        )
    source = str(data["source"]).strip()
    cls = {TEXT_PREFIX: TextData, CLASSIFY_PREFIX: ClassifyData}.get(source.split(":", 1)[0] + ":", DataConfig)
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        what = {TextData: "a text:", ClassifyData: "a classify:", DataConfig: "a shard, mixture or synthetic"}[cls]
        raise DataError(f"data: unknown keys {sorted(unknown)} for {what} source. Fix: use keys from {sorted(known)}")
    return cls(**{"seed": seed, **data})
