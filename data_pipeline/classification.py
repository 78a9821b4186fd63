"""Sequence-classification data: (text, label) examples -> batches of {input_ids, labels}.

Sources (the recipe's `data.source`, after the `classify:` prefix the trainer routes on; the other
`data` keys: docs/CLASSIFICATION.md):

    classify:data/reviews.jsonl        one JSON object per line with a text and a label field
    classify:data/reviews.csv          a CSV with a header row naming those fields
    classify:hf:yelp_polarity          a HuggingFace dataset (train split; val = its test split)

Labels are integers 0..C-1; string labels (in a CSV, or names) are mapped to ids in sorted
order, or as integers when they all parse as integers. Texts are truncated to `seq_len` tokens
and padded on the right with `pad_id`; NUL bytes are dropped under the byte tokenizer (0 is
its pad).

`make_toy_dataset` writes a small local file whose label is learnable (sentiment words),
used by the tests and the CPU recipe:

    python -m data_pipeline.classification --out data/toy_sentiment.jsonl --n 2000
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.cli import CliParser, run_cli
from common.constants import repo_path
from common.errors import DataError

from .config import CLASSIFY_PREFIX, ClassifyData
from .order import Permutation, RankShare, derive_key
from .tokenizer import BYTES, load_tokenizer


def read_examples(
    source: str,
    text_field: str = "text",
    label_field: str = "label",
    split: str = "train",
    max_examples: int | None = None,
) -> list[tuple[str, Any]]:
    """(text, raw label) pairs of a local jsonl/csv file or of `hf:NAME` (split train or test)."""
    if source.startswith("hf:"):
        import datasets  # deferred: heavy (pyarrow, pandas)

        name = source[3:]
        hf_split = "train" if split == "train" else "test"
        if max_examples:
            hf_split = f"{hf_split}[:{int(max_examples)}]"
        try:
            ds = datasets.load_dataset(name, split=hf_split)
        except Exception as e:  # noqa: BLE001 - network / cache errors: say what to do
            raise DataError(
                f"could not load HuggingFace dataset {name!r} split {hf_split!r}: {e}. Fix: run once "
                "with network access (it is cached), or export it to jsonl and use a local file"
            ) from e
        for f in (text_field, label_field):
            if f not in ds.column_names:
                raise DataError(
                    f"dataset {name!r} has no column {f!r}; columns: {ds.column_names}. "
                    "Fix: set data.text_field / data.label_field"
                )
        return list(zip(ds[text_field], ds[label_field]))
    path = repo_path(source)
    if not path.is_file():
        raise DataError(f"classification data {source!r} not found (a .jsonl or .csv file, or hf:NAME)")
    out: list[tuple[str, Any]] = []
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = csv.DictReader(f)
            if rows.fieldnames is None or text_field not in rows.fieldnames or label_field not in rows.fieldnames:
                raise DataError(
                    f"{path}: CSV header {rows.fieldnames} lacks {text_field!r}/{label_field!r}. "
                    "Fix: set data.text_field / data.label_field"
                )
            out = [(r[text_field], r[label_field]) for r in rows]
    else:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    out.append((r[text_field], r[label_field]))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise DataError(
                        f"{path}:{n}: expected a JSON object with {text_field!r} and {label_field!r} ({e})"
                    ) from None
    if max_examples:
        out = out[: int(max_examples)]
    if not out:
        raise DataError(f"{source}: no examples")
    return out


def label_mapping(raw_labels) -> dict[Any, int]:
    """Raw label -> id: integers as themselves (when all parse), else sorted names."""
    uniq = sorted({str(x) for x in raw_labels})
    try:
        ints = {u: int(u) for u in uniq}
        if min(ints.values()) >= 0:
            return ints
    except ValueError:
        pass
    return {u: i for i, u in enumerate(uniq)}


def load_encoder(spec: str | None):
    """The tokenizer of `data.tokenizer`: the byte tokenizer by default, or a tokenizer directory."""
    spec = str(spec or BYTES)
    return load_tokenizer(spec if spec == BYTES else repo_path(spec))


def default_pad_id(enc) -> int:
    """Classification pads byte-level texts with 0 (NUL, dropped from the texts), as it always has, so
    classifiers trained before the byte tokenizer had an EOS keep their pad; others use their own pad id."""
    return 0 if enc.identity == BYTES else int(enc.pad_id)


def resolve_pad_id(data: ClassifyData) -> int:
    return data.pad_id if data.pad_id is not None else default_pad_id(load_encoder(data.tokenizer))


class ClassificationLoader(RankShare):
    """This rank's share [B // W, T] of each global batch: {"input_ids", "labels" (one per sequence)}."""

    def __init__(
        self,
        data: ClassifyData,
        split: str,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
    ):
        src = data.source.removeprefix(CLASSIFY_PREFIX)
        super().__init__(src, data.seed, seq_len, global_batch_size, dp_rank, dp_world_size)
        self.split = "train" if split == "train" else "val"
        tf, lf, cap = data.text_field, data.label_field, data.max_examples
        if self.source.startswith("hf:") or data.val_source:  # validation: the test split, or val_source
            train_rows = read_examples(self.source, tf, lf, "train", cap)
            val = self.source if self.source.startswith("hf:") else data.val_source
            rows = train_rows if self.split == "train" else read_examples(val, tf, lf, "test", cap)
            mapping = label_mapping([lab for _, lab in train_rows])
        else:
            every = read_examples(self.source, tf, lf, "train", cap)
            mapping = label_mapping([lab for _, lab in every])
            frac = data.val_fraction
            n_val = int(round(frac * len(every)))
            if not 0 < n_val < len(every):
                raise DataError(
                    f"{self.source}: val_fraction={frac} leaves {n_val} of {len(every)} examples for "
                    "validation. Fix: use a fraction that gives both splits examples, or data.val_source"
                )
            rank_of = Permutation(len(every), derive_key(self.seed, "classify-split"))(np.arange(len(every)))
            keep = rank_of < n_val if self.split == "val" else rank_of >= n_val
            rows = [r for r, k in zip(every, keep) if k]
        try:
            labels = [mapping[str(lab)] for _, lab in rows]
        except KeyError as e:
            raise DataError(f"{self.source}: validation label {e} does not occur in the training data") from None
        self.mapping = mapping
        self.num_labels = max(mapping.values()) + 1
        enc = load_encoder(data.tokenizer)
        self.tokenizer_id = enc.identity
        self.vocab_size = int(enc.vocab_size)
        self.pad_id = data.pad_id if data.pad_id is not None else default_pad_id(enc)
        ids = enc.encode_batch([t for t, _ in rows])
        if enc.identity == BYTES:  # NUL is the byte models' pad
            ids = [[b for b in t if b != 0] for t in ids]
        self.n = len(rows)
        self.input_ids = np.full((self.n, seq_len), self.pad_id, dtype=np.int64)
        for i, toks in enumerate(ids):
            toks = toks[:seq_len]
            self.input_ids[i, : len(toks)] = toks
        self.labels = np.asarray(labels, dtype=np.int64)
        self.fingerprint = hashlib.sha1(
            f"{self.source}|{self.seed}|{seq_len}|{self.n}|{self.tokenizer_id}".encode()
        ).hexdigest()[:12]

    def __len__(self) -> int:
        return self.n

    def _index(self, j: np.ndarray) -> np.ndarray:
        epoch, k = np.divmod(j, self.n)
        if self.split == "val":
            return k
        out = np.empty_like(k)
        for e in np.unique(epoch):
            sel = epoch == e
            out[sel] = Permutation(self.n, derive_key(self.seed, "classify-order", int(e)))(k[sel])
        return out

    def _batch(self, ks: np.ndarray) -> dict:
        idx = self._index(ks)
        return {"input_ids": torch.from_numpy(self.input_ids[idx]), "labels": torch.from_numpy(self.labels[idx])}


# ---- a small learnable data set ------------------------------------------------------------
POSITIVE = ["great", "excellent", "wonderful", "delicious", "friendly", "amazing", "lovely", "perfect"]
NEGATIVE = ["awful", "terrible", "rude", "bland", "dirty", "horrible", "slow", "broken"]
FILLER = "the food was and service staff place really our table very we ordered pizza coffee room night again".split()


def make_toy_dataset(path: str | Path, n: int = 2000, seed: int = 0) -> Path:
    """Write `n` jsonl examples {text, label}: label 1 iff the text holds positive (not negative) words."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n):
            label = int(rng.integers(2))
            words = list(rng.choice(FILLER, size=int(rng.integers(4, 9))))
            for w in rng.choice(POSITIVE if label else NEGATIVE, size=int(rng.integers(1, 3)), replace=False):
                words.insert(int(rng.integers(len(words) + 1)), str(w))
            f.write(json.dumps({"text": " ".join(words), "label": label}) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(
        prog="python -m data_pipeline.classification", description="write a small learnable sentiment data set (jsonl)"
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=_positive_int, default=2000, help="examples to write")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    return run_cli(lambda: print(make_toy_dataset(a.out, a.n, a.seed)))


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number of examples")
    return n


if __name__ == "__main__":
    raise SystemExit(main())
