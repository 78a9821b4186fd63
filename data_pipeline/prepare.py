"""Tokenise a corpus into verified, resumable token shards.

CLI::

    python -m data_pipeline.prepare --source data/*.txt --tokenizer tok/ --out shards/ \
        [--workers K] [--shard-tokens N] [--text-field text] [--where FIELD=VALUE ...]
    python -m data_pipeline.prepare --source hf:NAME[:CONFIG][:SPLIT] ...   # streaming=True

Why it looks like this:
* Shard boundaries depend only on the document sequence and the tokenizer (a shard is
  closed after the first document that brings it to >= ``shard_tokens`` tokens), so the
  output is byte-identical for any ``--workers`` and across interruptions.
* Each finished shard is recorded in ``progress.json`` (atomically) after it is renamed
  into place; a re-run skips those documents without tokenising them again.
* Inputs are checked (exist, non-empty, reachable) before the tokenizer or any worker starts.
* ``--where source=gcide`` keeps only the records whose field has that value: one corpus file gives
  a validation set per source (the filter is part of the output's identity).
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common.cli import CliParser, run_cli
from common.constants import free_space
from common.errors import DataError

from .progress import progress_bar
from .shards import FORMAT_VERSION, MANIFEST, PROGRESS, atomic_write_json, dtype_for_vocab, shard_name, write_shard
from .tokenizer import load_tokenizer

DEFAULT_SHARD_TOKENS = 1 << 26  # 64M tokens = 128 MiB of uint16 per shard
EXT_BUILDER = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# For tests of crash safety only: seconds to sleep between writing a shard and renaming it.
DELAY_ENV = "DATA_PIPELINE_PREPARE_DELAY_S"


@dataclass
class SourceSpec:
    kind: str  # "local" or "hf"
    builder: str = ""  # text / json / parquet for local files
    files: list[str] = field(default_factory=list)
    hf_name: str = ""
    hf_config: str | None = None
    hf_split: str = "train"

    def fingerprint(self) -> dict:
        if self.kind == "hf":
            return {"hf": [self.hf_name, self.hf_config, self.hf_split]}
        return {"builder": self.builder, "files": [[f, os.path.getsize(f)] for f in self.files]}


def resolve_source(sources: list[str] | str) -> SourceSpec:
    """Turn ``--source`` arguments into a checked list of files (or an HF dataset spec)."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [str(sources)]
    sources = [str(s) for s in sources]
    if not sources:
        raise DataError("prepare: --source is empty. Fix: pass local text/jsonl/parquet files or hf:NAME")
    if any(s.startswith("hf:") for s in sources):
        if len(sources) != 1:
            raise DataError(
                "prepare: an hf:NAME source cannot be combined with other sources. Fix: prepare them separately and use a mixture"
            )
        parts = sources[0][3:].split(":")
        if not parts[0]:
            raise DataError("prepare: hf source needs a dataset name: hf:NAME[:CONFIG][:SPLIT]")
        return SourceSpec(
            kind="hf",
            hf_name=parts[0],
            hf_config=(parts[1] or None) if len(parts) > 1 else None,
            hf_split=parts[2] if len(parts) > 2 and parts[2] else "train",
        )
    files: list[str] = []
    for s in sources:
        p = Path(s)
        if any(c in s for c in "*?["):
            matched = sorted(glob.glob(s, recursive=True))
            if not matched:
                raise DataError(f"prepare: --source pattern {s!r} matches no files. Fix: check the path")
            files += matched
        elif p.is_dir():
            matched = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in EXT_BUILDER)
            if not matched:
                raise DataError(
                    f"prepare: --source directory {s} has no .txt/.jsonl/.json/.parquet files. Fix: point --source at the files"
                )
            files += matched
        elif not p.exists():
            raise DataError(
                f"prepare: input file {s} does not exist. Fix: check the path (for a HuggingFace dataset write hf:NAME)"
            )
        else:
            files.append(s)
    builders = set()
    for f in files:
        ext = Path(f).suffix.lower()
        if ext not in EXT_BUILDER:
            raise DataError(
                f"prepare: input file {f} has unsupported extension {ext!r}. Fix: use .txt, .jsonl/.json or .parquet"
            )
        if os.path.getsize(f) == 0:
            raise DataError(f"prepare: input file {f} is empty. Fix: remove it from --source or regenerate it")
        builders.add(EXT_BUILDER[ext])
    if len(builders) > 1:
        raise DataError(
            f"prepare: --source mixes file types {sorted(builders)}. Fix: prepare each type into its own --out and combine them with a mixture"
        )
    return SourceSpec(kind="local", builder=builders.pop(), files=[str(Path(f).resolve()) for f in files])


def _hf_offline_error(spec: SourceSpec, e: Exception) -> DataError:
    return DataError(
        f"prepare: HuggingFace dataset {spec.hf_name!r} cannot be reached ({type(e).__name__}: {e}). "
        "Offline or without network access, download the data elsewhere and pass local files instead, e.g. "
        "--source /data/corpus/*.parquet (or .jsonl/.txt); they are read with the datasets "
        "parquet/json/text builders."
    )


def parse_where(items: list[str] | dict | None) -> dict[str, str]:
    """``["source=gcide"]`` -> ``{"source": "gcide"}``: records kept only where every field has its value."""
    if not items:
        return {}
    if isinstance(items, dict):
        return {str(k): str(v) for k, v in items.items()}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DataError(f"prepare: --where {item!r} must look like FIELD=VALUE. Fix: e.g. --where source=gcide")
        out[key] = value
    return out


def open_dataset(spec: SourceSpec, text_field: str, where: dict[str, str] | None = None):
    """A streaming ``datasets.IterableDataset`` of the source (only records matching ``where``);
    fails fast on unusable input."""
    import datasets  # deferred: heavy

    if spec.kind == "hf":
        try:
            ds = datasets.load_dataset(spec.hf_name, spec.hf_config, split=spec.hf_split, streaming=True)
        except Exception as e:  # noqa: BLE001 - any failure to reach the dataset gets the same advice
            raise _hf_offline_error(spec, e) from e
    else:
        kwargs = {"sample_by": "line"} if spec.builder == "text" else {}
        ds = datasets.load_dataset(spec.builder, data_files=spec.files, split="train", streaming=True, **kwargs)
    try:
        first = next(iter(ds))
    except StopIteration:
        raise DataError(
            f"prepare: source {spec.files or spec.hf_name} yields no records. Fix: check the input"
        ) from None
    except Exception as e:  # noqa: BLE001
        if spec.kind == "hf":
            raise _hf_offline_error(spec, e) from e
        raise DataError(f"prepare: cannot read {spec.files}: {type(e).__name__}: {e}") from e
    if text_field not in first:
        origin = spec.files[0] if spec.files else spec.hf_name
        raise DataError(
            f"prepare: records of {origin} have no field {text_field!r} (fields: {sorted(first)}). "
            "Fix: pass --text-field NAME"
        )
    if where:
        missing = sorted(set(where) - set(first))
        if missing:
            raise DataError(
                f"prepare: --where names field(s) {missing} that the records do not have (fields: {sorted(first)}). "
                "Fix: a field of the records, e.g. --where source=gcide"
            )
        ds = ds.filter(lambda r: all(str(r[k]) == v for k, v in where.items()))
        try:
            next(iter(ds))
        except StopIteration:
            raise DataError(
                f"prepare: no record of {spec.files or spec.hf_name} has {where}. Fix: check the value of --where"
            ) from None
    return ds


def _iter_text_batches(ds, text_field: str, skip: int, batch_docs: int):
    """Yield (index of first doc, list of texts), skipping the first ``skip`` documents cheaply."""
    idx = 0
    for batch in ds.iter(batch_size=batch_docs):
        texts = batch[text_field]
        n = len(texts)
        if idx + n <= skip:
            idx += n
            continue
        start = max(0, skip - idx)
        yield idx + start, [t if isinstance(t, str) else ("" if t is None else str(t)) for t in texts[start:]]
        idx += n


class ShardWriter:
    """Cuts a stream of tokenised documents into shards of at least `shard_tokens` tokens at document
    boundaries, writing each shard and then the progress file that lets an interrupted run resume after
    it (`shards` and `state` are that file's lists, extended in place)."""

    def __init__(self, out: Path, dtype, shard_tokens: int, shards: list[dict], state: dict, delay: float):
        self.out, self.dtype, self.shard_tokens, self.delay = out, dtype, shard_tokens, delay
        self.shards, self.state = shards, state
        self.tokens: list[np.ndarray] = []
        self.lengths: list[np.ndarray] = []
        self.count = 0  # tokens buffered for the next shard

    def add(self, first_doc: int, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Buffer a batch of documents (`first_doc` is the first one's index in the source), writing a shard
        each time the buffer reaches `shard_tokens` at the end of a document."""
        cum = np.cumsum(lengths)
        pos_doc, pos_tok = 0, 0  # position inside this batch
        while pos_doc < len(lengths):
            base = int(cum[pos_doc - 1]) if pos_doc else 0
            need = self.shard_tokens - self.count
            # first doc j >= pos_doc whose end brings the shard to >= shard_tokens tokens
            j = int(np.searchsorted(cum, base + need, side="left"))
            if j >= len(lengths):
                self.tokens.append(flat[pos_tok:])
                self.lengths.append(lengths[pos_doc:])
                self.count += int(cum[-1]) - base
                return
            end_tok = int(cum[j])
            self.tokens.append(flat[pos_tok:end_tok])
            self.lengths.append(lengths[pos_doc : j + 1])
            self.count += end_tok - base
            self.flush(first_doc + j + 1)
            pos_doc, pos_tok = j + 1, end_tok

    def finish(self) -> int:
        """Write the last, partial shard; the number of source documents read (whitespace-only ones
        included: every document of the source counts)."""
        total_docs = int(self.state["next_doc"]) + sum(len(x) for x in self.lengths)
        if self.count > 0:
            self.flush(total_docs)
        return total_docs

    def flush(self, next_doc: int) -> None:
        toks = np.concatenate(self.tokens) if self.tokens else np.zeros(0, dtype=np.int64)
        lens = np.concatenate(self.lengths) if self.lengths else np.zeros(0, dtype=np.int64)
        lens = lens[lens > 0]
        offsets = np.zeros(len(lens) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        out, n = self.out, len(self.shards)
        try:
            info = write_shard(out, n, toks.astype(self.dtype), offsets, delay_s=self.delay)
            atomic_write_json(out / PROGRESS, {**self.state, "shards": self.shards + [info], "next_doc": int(next_doc)})
        except OSError as e:  # e.g. no space left: keep what is done, free the partial files, say how to go on
            for stray in out.glob("*.tmp"):
                stray.unlink(missing_ok=True)
            raise DataError(
                f"prepare: could not write {shard_name(n)} into {out} ({e.strerror or e}; "
                f"{free_space(out)} free there); the {n} shards already written are kept. Fix: free space "
                f"(or use another --out), then re-run the same command: it resumes at shard {n}"
            ) from e
        self.shards.append(info)
        self.state["next_doc"] = int(next_doc)
        self.tokens, self.lengths, self.count = [], [], 0


def prepare(
    source,
    tokenizer,
    out,
    *,
    workers: int = 1,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    text_field: str = "text",
    batch_docs: int = 512,
    progress: bool = True,
    where: list[str] | dict | None = None,
) -> dict:
    """Tokenise ``source`` into shards under ``out`` and return the manifest (see module doc)."""
    if workers < 1:
        raise DataError(f"prepare: --workers must be >= 1, got {workers}")
    if shard_tokens < 1:
        raise DataError(f"prepare: --shard-tokens must be >= 1, got {shard_tokens}")

    def say(text: str) -> None:
        if progress:
            print(f"[prepare] {text}", file=sys.stderr, flush=True)

    spec = resolve_source(source)
    where = parse_where(where)
    tok = load_tokenizer(tokenizer)
    out = Path(out)
    config = {
        "format_version": FORMAT_VERSION,
        "source": spec.fingerprint(),
        "tokenizer_id": tok.identity,
        "shard_tokens": int(shard_tokens),
        "text_field": text_field,
        "append_eos": True,
        "skip_whitespace_docs": True,
    }
    if where:  # only when given: manifests written before --where existed keep their identity
        config["where"] = where
    mpath, ppath = out / MANIFEST, out / PROGRESS
    if mpath.is_file():
        m = json.loads(mpath.read_text())
        if m.get("config") == config and m.get("complete"):
            say(f"{out} is already complete ({m['num_tokens']} tokens in {len(m['shards'])} shards)")
            return m
        raise DataError(
            f"prepare: {mpath} was written by a different prepare run (source, tokenizer or shard size differ). "
            "Fix: use a new --out directory or delete this one"
        )
    state = {"config": config, "shards": [], "next_doc": 0}
    if ppath.is_file():
        state = json.loads(ppath.read_text())
        if state.get("config") != config:
            raise DataError(
                f"prepare: {ppath} belongs to an interrupted run with different settings. Fix: re-run that exact command "
                "to finish it, or use a new --out directory (or delete this one)"
            )
    ds = open_dataset(spec, text_field, where)  # after the cheap checks, before any worker starts
    out.mkdir(parents=True, exist_ok=True)
    for stray in out.glob("*.tmp"):
        stray.unlink()
    dtype = dtype_for_vocab(tok.vocab_size)
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    shards: list[dict] = list(state["shards"])
    done_tokens = sum(s["num_tokens"] for s in shards)
    if shards:
        say(f"resuming at shard {len(shards)} (document {state['next_doc']}, {done_tokens} tokens done)")

    writer = ShardWriter(out, dtype, shard_tokens, shards, state, delay)
    pbar = progress_bar(
        initial=done_tokens,
        unit="tok",
        desc="prepare",
        enabled=progress,
        file=sys.stderr,
        unit_scale=True,
        mininterval=0.5,
        smoothing=0.1,
    )
    batches = _iter_text_batches(ds, text_field, int(state["next_doc"]), batch_docs)
    t0 = time.time()
    new_tokens = 0
    for first, (flat, lengths, mx) in _encoded(batches, tok, workers):
        if mx >= tok.vocab_size:
            raise DataError(f"prepare: tokenizer {tok.path} produced id {mx} >= its vocab size {tok.vocab_size}")
        writer.add(first, flat, lengths)
        new_tokens += len(flat)
        pbar.update(len(flat))
    pbar.close()
    total_docs = writer.finish()
    num_tokens = sum(s["num_tokens"] for s in shards)
    if num_tokens == 0:
        where = ", ".join(spec.files) if spec.files else spec.hf_name
        raise DataError(f"prepare: {where} contains no non-empty documents. Fix: check --source and --text-field")
    manifest = {
        "format_version": FORMAT_VERSION,
        "complete": True,
        "config": config,
        "tokenizer_id": tok.identity,
        "tokenizer_path": tok.path,
        "vocab_size": tok.vocab_size,
        "dtype": dtype.name,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "bos_id": tok.bos_id,
        "num_tokens": num_tokens,
        "num_docs": sum(s["num_docs"] for s in shards),
        "source_docs": total_docs,
        "shards": shards,
    }
    atomic_write_json(mpath, manifest)
    ppath.unlink(missing_ok=True)
    rate = new_tokens / max(time.time() - t0, 1e-9)
    say(f"wrote {len(shards)} shards, {num_tokens} tokens ({rate:,.0f} tok/s this run) -> {out}")
    return manifest


_TOK = None  # a worker process's tokenizer (workers are spawned: each imports this module afresh)


def init_worker(tokenizer_path: str) -> None:
    global _TOK
    _TOK = load_tokenizer(tokenizer_path)


def encode_docs(texts: list[str], tok=None, num_threads: int = 1) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens with EOS after each kept doc, per-doc lengths incl. EOS, max id). Whitespace-only documents
    get length 0 and no tokens: skipping them by a fixed rule keeps shards identical however the work is split.
    """
    tok = tok or _TOK
    lengths = np.zeros(len(texts), dtype=np.int64)
    keep = [i for i, t in enumerate(texts) if t and not t.isspace()]
    if not keep:
        return np.zeros(0, dtype=np.int64), lengths, -1
    encoded = tok.encode_batch([texts[i] for i in keep], num_threads=num_threads)
    for i, ids in zip(keep, encoded):
        ids.append(tok.eos_id)
        lengths[i] = len(ids)
    flat = np.fromiter((t for ids in encoded for t in ids), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths, int(flat.max())


def _encoded(batches, tok, workers: int):
    """(first doc, `encode_docs` of its batch) in order; with `workers` > 1, tokenised in spawned processes."""
    if workers == 1:
        for first, texts in batches:
            yield first, encode_docs(texts, tok, num_threads=os.cpu_count() or 1)
        return
    # Ended by close + join, not the context manager's terminate(): a consumer that stops early (a full disk)
    # closes this generator, and terminate() can hang for good joining its task thread while that thread is
    # blocked writing a batch to a worker. The batches in flight are bounded, so joining waits seconds.
    pool = mp.get_context("spawn").Pool(workers, initializer=init_worker, initargs=(tok.path,))
    try:
        pending: deque = deque()
        for first, texts in batches:
            pending.append((first, pool.apply_async(encode_docs, (texts,))))
            if len(pending) >= 2 * workers:  # bounded: memory stays flat
                first, res = pending.popleft()
                yield first, res.get()
        while pending:
            first, res = pending.popleft()
            yield first, res.get()
    finally:
        pool.close()
        pool.join()


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(
        prog="python -m data_pipeline.prepare",
        description="Tokenise local text/jsonl/parquet files or hf:NAME into token shards.",
    )
    ap.add_argument(
        "--source",
        nargs="+",
        required=True,
        help="files, globs or directories (.txt: one document per line; .jsonl/.parquet: --text-field), "
        "or hf:NAME[:CONFIG][:SPLIT]",
    )
    ap.add_argument("--tokenizer", required=True, help="tokenizer directory (SentencePiece or HuggingFace)")
    ap.add_argument("--out", required=True, help="output directory for shards and manifest.json")
    ap.add_argument("--workers", type=int, default=1, help="tokeniser processes")
    ap.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="target tokens per shard")
    ap.add_argument("--text-field", default="text", help="field holding the text in jsonl/parquet/hf records")
    ap.add_argument(
        "--where",
        nargs="+",
        default=None,
        metavar="FIELD=VALUE",
        help="keep only records whose FIELD equals VALUE (jsonl/parquet/hf), e.g. --where source=gcide",
    )
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)

    def body() -> None:
        prepare(
            args.source,
            args.tokenizer,
            args.out,
            workers=args.workers,
            shard_tokens=args.shard_tokens,
            text_field=args.text_field,
            progress=not args.quiet,
            where=args.where,
        )

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
