"""`text:PATH` sources: UTF-8 text files read by the byte tokenizer, with no preparation step.

For quick runs on raw text (WikiText-2, a lab's own file of prompts and answers). PATH is a file
(a .jsonl file: each record's "text", as in data/sample/) or a directory of `*.txt` files (sorted);
a relative PATH that does not exist is taken relative to the repository. `text:hf:NAME[:CONFIG][:SPLIT+SPLIT]`
names a HuggingFace dataset instead (`text:hf:Salesforce/wikitext:wikitext-2-raw-v1:validation+test`):
each split's "text" column, one row per line, is written once to the node's data cache and read as a file. The `data` keys
(`documents`, `windows`, `return_doc_ids`, `val_fraction`) are described in docs/TRAINING.md,
"Raw text"; the defaults (`stream`, `stream`) read the data exactly as earlier versions did, so
older runs resume unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from common.constants import IGNORE_INDEX, REPO_ROOT
from common.errors import DataError

from .config import TEXT_PREFIX, TextData
from .order import RankShare
from .storage import default_cache_dir
from .tokenizer import BYTE_TOKENIZER

HUB_PREFIX = "hf:"


def text_files(source: str) -> list[Path]:
    """The files of a `text:PATH` source, checked to exist (of a `text:hf:...` source, its cached splits)."""
    spec = source[len(TEXT_PREFIX) :] if source.startswith(TEXT_PREFIX) else source
    if spec.startswith(HUB_PREFIX):
        return hub_text_files(spec)
    path = Path(spec)
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise DataError(
            f"data.source={source!r}: no .txt files found at {path}. Fix: point text: at a UTF-8 text "
            "file or a directory of .txt files"
        )
    return files


def hub_text_files(spec: str) -> list[Path]:
    """`hf:NAME[:CONFIG][:SPLIT+SPLIT]` (split default train) as one cached .txt file per split, in the
    order named: a row ends with a newline (one is added where the dataset stores none), so a dataset of
    lines (WikiText's raw configs) comes back as the file it was made from. Written once, atomically."""
    name, config, splits = (spec[len(HUB_PREFIX) :].split(":") + ["", ""])[:3]
    if not name:
        raise DataError(f"data.source=text:{spec!r} names no dataset. Fix: text:hf:NAME[:CONFIG][:SPLIT+SPLIT]")
    folder = default_cache_dir() / "text" / hashlib.sha1(spec.encode()).hexdigest()[:16]
    files = [folder / f"{i}-{split}.txt" for i, split in enumerate((splits or "train").split("+"))]
    missing = [f for f in files if not f.is_file()]
    if missing:
        import datasets  # deferred: heavy (pyarrow, pandas), and only hub sources need it

        folder.mkdir(parents=True, exist_ok=True)
        for f in missing:
            split = f.stem.split("-", 1)[1]
            try:
                rows = datasets.load_dataset(name, config or None, split=split)
            except Exception as e:  # noqa: BLE001 - network, cache or name errors: say what to do
                raise DataError(
                    f"data.source=text:{spec}: could not load {name!r} (config {config or None!r}, split "
                    f"{split!r}): {str(e).splitlines()[0] if str(e) else type(e).__name__}. Fix: run once with "
                    "network access (the text is cached), or point data.source at a local copy: "
                    "data.source=text:DIR_OF_TXT_FILES"
                ) from e
            if "text" not in rows.column_names:
                raise DataError(
                    f"data.source=text:{spec}: split {split!r} has no 'text' column (columns: "
                    f"{rows.column_names}). Fix: name a dataset of text rows"
                )
            tmp = f.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "w", encoding="utf-8") as out:
                for row in rows["text"]:
                    out.write(row if row.endswith("\n") else row + "\n")
            os.replace(tmp, f)
    return files


def jsonl_texts(f: Path, field: str = "text") -> list[str]:
    """The `field` of every record of a JSON-lines file (the docs corpus's and data/sample's format)."""
    out = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            out.append(rec[field] if isinstance(rec[field], str) else None)
        except (ValueError, KeyError, TypeError):
            out.append(None)
        if out[-1] is None:
            raise DataError(
                f'{f}:{n}: expected a JSON object with a string "{field}". Fix: one {{"{field}": ...}} per line'
            )
    return out


def file_bytes(f: Path) -> bytes:
    """A text file's bytes, or a .jsonl file's texts joined by blank lines."""
    if f.suffix == ".jsonl":
        return "\n\n".join(jsonl_texts(f)).encode("utf-8")
    return f.read_bytes()


def _read_checked(f: Path) -> bytes:
    raw = file_bytes(f)
    at = raw.find(b"\xff")
    if at >= 0:
        raise DataError(
            f"{f}: byte 0xFF at offset {at}, so the file is not UTF-8 text (UTF-8 never contains 0xFF; "
            f"the byte tokenizer uses id {BYTE_TOKENIZER.eos_id} as end-of-document). Fix: convert the "
            "file to UTF-8, e.g. iconv -f latin1 -t utf-8"
        )
    return raw


def read_documents(files: list[Path]) -> list[bytes]:
    """Every non-blank line of the files as one document (without its newline or a trailing CR); of a
    .jsonl file, every record's text."""
    docs = []
    for f in files:
        if f.suffix == ".jsonl":
            _read_checked(f)  # the 0xFF check
            docs += [t.encode("utf-8") for t in jsonl_texts(f) if t.strip()]
            continue
        for line in _read_checked(f).split(b"\n"):
            line = line.rstrip(b"\r")
            if line.strip():
                docs.append(line)
    return docs


def _split_part(items, val_fraction: float, split: str):
    """The held-out tail (`val_fraction` of `items`) for split "val", the rest for "train"."""
    cut = len(items) - int(len(items) * val_fraction)
    return items[cut:] if split == "val" else items[:cut]


def pack_windows(doc_lengths: np.ndarray, span: int) -> np.ndarray:
    """(start, end) token offsets of windows of at most `span` tokens that begin at a document start
    and hold whole documents; a document longer than `span` is cut into windows that overlap by one
    token (as stream windows do), so every token after a document's first is a target once."""
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]).astype(np.int64)
    out: list[tuple[int, int]] = []
    i, n = 0, len(doc_lengths)
    while i < n:
        s, e = int(starts[i]), int(starts[i] + doc_lengths[i])
        if e - s > span:  # a long document: consecutive windows
            b = s
            while b + 1 < e:
                out.append((b, min(b + span, e)))
                b += span - 1
            i += 1
            continue
        j = i + 1
        while j < n and starts[j] + doc_lengths[j] - s <= span:
            j += 1
        out.append((s, int(starts[j - 1] + doc_lengths[j - 1])))
        i = j
    return np.asarray(out, dtype=np.int64).reshape(-1, 2)


def eos_document_ids(x: np.ndarray) -> np.ndarray:
    """Per-position document index of each row of token ids (int64), counted from 0 at the row's
    start: a document ends with its EOS, which belongs to it."""
    ends = (x == BYTE_TOKENIZER.eos_id).astype(np.int64)
    return np.cumsum(ends, axis=1) - ends


class TextLoader(RankShare):
    """Batches of {input_ids, labels} [B // W, T] from a `text:` source (see the module docstring)."""

    vocab_size = BYTE_TOKENIZER.vocab_size
    tokenizer_id = BYTE_TOKENIZER.identity

    def __init__(
        self,
        data: TextData,
        split: str,
        seq_len: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
    ):
        super().__init__(data.source, data.seed, seq_len, global_batch_size, dp_rank, dp_world_size)
        self.documents, self.windows, self.return_doc_ids = data.documents, data.windows, data.return_doc_ids
        self.split = split
        files = text_files(self.source)
        self.spans = None
        if self.documents == "stream":
            tokens = np.frombuffer(b"".join(_read_checked(f) for f in files), dtype=np.uint8)
            self.tokens = _split_part(tokens, data.val_fraction, split)
        else:
            docs = _split_part(read_documents(files), data.val_fraction, split)
            eos = bytes([BYTE_TOKENIZER.eos_id])
            self.tokens = np.frombuffer(b"".join(d + eos for d in docs), dtype=np.uint8)
            if self.windows == "documents":
                self.spans = pack_windows(np.asarray([len(d) + 1 for d in docs], dtype=np.int64), self.T + 1)
        self.n_windows = len(self.spans) if self.spans is not None else (len(self.tokens) - 1) // self.T
        if self.n_windows < 1:
            raise DataError(
                f"{self.source}: split {self.split!r} is shorter than one sequence of {self.T}. Fix: use "
                "more text, a shorter train.seq_len or another data.val_fraction"
            )
        self.fingerprint = self._fingerprint()
        self._perm_epoch, self._perm = -1, None

    def _fingerprint(self) -> str:
        key = f"{self.source}|{self.seed}|{self.T}"
        if (self.documents, self.windows) != ("stream", "stream"):
            key += f"|{self.documents}|{self.windows}"
        return hashlib.sha1(key.encode()).hexdigest()[:12]

    def _window(self, j: int) -> int:
        epoch, k = divmod(j, self.n_windows)
        if self.split == "val":
            return k
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[k])

    def _sample(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        w = self._window(j)
        if self.spans is None:
            seg = self.tokens[w * self.T : w * self.T + self.T + 1].astype(np.int64)
            return seg[:-1], seg[1:]
        b, e = self.spans[w]
        seg = self.tokens[b:e].astype(np.int64)
        x = np.full(self.T, BYTE_TOKENIZER.pad_id, dtype=np.int64)
        y = np.full(self.T, IGNORE_INDEX, dtype=np.int64)
        x[: len(seg) - 1] = seg[:-1]
        y[: len(seg) - 1] = seg[1:]
        return x, y

    def _batch(self, ks: np.ndarray) -> dict:
        xs, ys = zip(*(self._sample(int(j)) for j in ks))
        x = np.stack(xs)
        batch = {"input_ids": torch.from_numpy(x), "labels": torch.from_numpy(np.stack(ys))}
        if self.return_doc_ids:
            batch["doc_ids"] = torch.from_numpy(eos_document_ids(x))
        return batch
