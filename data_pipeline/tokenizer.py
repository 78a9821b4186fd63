"""Tokenizers: train a SentencePiece BPE model, or load one (SentencePiece, a local HF dir, or `bytes`).

Why a wrapper: shards, manifests and checkpoints all record the tokenizer *identity*
(a content hash), so data made with one tokenizer can never silently be trained with another.

`bytes` is the one byte-level tokenizer of the repository (`text:` sources, classification data,
evaluation probes): UTF-8 bytes as ids, vocabulary 256, identity `bytes`, EOS = 255 (see ByteTokenizer).

CLI::

    python -m data_pipeline.tokenizer train --input a.txt b.txt --vocab-size 8000 --out tok/
    python -m data_pipeline.tokenizer train --input corpus/train.jsonl --text-field text --vocab-size 4096 --out tok/
    python -m data_pipeline.tokenizer info tok/
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from pathlib import Path

from common.cli import CliParser, run_cli
from common.constants import file_sha256
from common.errors import DataError

SP_MODEL = "tokenizer.model"
SP_SPACE = "\u2581"  # SentencePiece's mark for a space
META = "tokenizer_meta.json"
# Files that define an HF tokenizer; hashed (in this order, when present) for its identity.
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


_PROBES = ("Hello, World!  12345 \u00e9\u4e2d\n\ttabs", " leading space", "UPPER lower 3.14")


def _sp_identity(sp) -> str:
    """Hash of what decides the encoding: every piece, score and type, plus probe encodings.

    Not the raw .model bytes: those embed the trainer's input paths, so the same training
    run in another directory would get another identity.
    """
    h = hashlib.sha256()
    for i in range(sp.get_piece_size()):
        h.update(
            f"{sp.id_to_piece(i)}\0{sp.get_score(i)!r}\0{int(sp.is_control(i))}{int(sp.is_unknown(i))}"
            f"{int(sp.is_byte(i))}{int(sp.is_unused(i))}\n".encode()
        )
    for text in _PROBES:
        h.update(repr(sp.encode(text, out_type=int)).encode())
    return h.hexdigest()[:16]


BYTES = "bytes"  # the byte tokenizer's name wherever a tokenizer is given (recipes, --tokenizer), and its identity


class ByteTokenizer:
    """UTF-8 bytes as token ids, vocabulary 256, EOS (end of document) = 255, no BOS; pad = EOS.

    UTF-8 never contains the byte 0xFF, so EOS needs no 257th id and a model trained before EOS existed
    reads text as it did (docs/TRAINING.md, "Raw text"). Text with a 0xFF byte is refused where it is read.
    """

    kind = BYTES
    identity = BYTES
    vocab_size = 256
    eos_id = 255
    bos_id = -1
    pad_id = 255
    path = BYTES

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        """Text of the ids; EOS (and any id outside 0..254) is skipped."""
        return bytes(i for i in (int(x) for x in ids) if 0 <= i < self.eos_id).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab=256, eos=255)"


BYTE_TOKENIZER = ByteTokenizer()


TIKTOKEN_FILE = "tokenizer.tiktoken"
EOT = "<|endoftext|>"
# The pre-tokenizer split Llama 3 uses with its tiktoken file (meta-llama/llama3 tokenizer.py).
TIKTOKEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


class Tokenizer:
    """Common face of a SentencePiece, HF or tiktoken tokenizer.

    Attributes: ``identity`` (e.g. ``"sp:3fa2...")``, ``vocab_size``, ``eos_id``, ``bos_id``,
    ``pad_id`` (may equal ``eos_id`` when the tokenizer has none), ``path``, ``kind``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(Path(path).resolve())
        p = Path(self.path)
        self._sp = self._hf = self._tt = None
        if p.is_dir() and (p / TIKTOKEN_FILE).is_file():
            p = p / TIKTOKEN_FILE
        if p.is_file() and p.suffix == ".tiktoken":
            self._load_tiktoken(p)
            return
        if p.is_file() and p.suffix == ".model":
            p = p.parent
            self.path = str(p)
        if (p / SP_MODEL).is_file() and not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            import sentencepiece as spm  # deferred: heavy

            self.kind = "sentencepiece"
            self._sp = spm.SentencePieceProcessor(model_file=str(p / SP_MODEL))
            self.identity = "sp:" + _sp_identity(self._sp)
            self.vocab_size = int(self._sp.get_piece_size())
            self.eos_id = int(self._sp.eos_id())
            self.bos_id = int(self._sp.bos_id())
            pad = int(self._sp.pad_id())
            self.pad_id = pad if pad >= 0 else self.eos_id
            if self.eos_id < 0:
                raise DataError(
                    f"{p / SP_MODEL}: the SentencePiece model has no EOS piece. Fix: retrain it with eos_id set"
                )
        elif any((p / f).is_file() for f in HF_FILES):
            from transformers import AutoTokenizer  # deferred: heavy

            self.kind = "hf"
            try:
                self._hf = AutoTokenizer.from_pretrained(self.path, trust_remote_code=False, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - re-raised with the directory and fix
                raise DataError(
                    f"{self.path}: could not load as a HuggingFace tokenizer directory ({type(e).__name__}: {e}). "
                    "Fix: a directory holding tokenizer.json or tokenizer_config.json written by save_pretrained()"
                ) from e
            h = hashlib.sha256()
            for name in HF_FILES:
                if (p / name).is_file():
                    h.update(name.encode() + b"\0")
                    file_sha256(p / name, h)
            self.identity = "hf:" + h.hexdigest()[:16]
            self.vocab_size = int(len(self._hf))
            eos = self._hf.eos_token_id if self._hf.eos_token_id is not None else self._hf.sep_token_id
            if eos is None:
                raise DataError(
                    f"{self.path}: this HF tokenizer defines no eos_token (nor sep_token), and documents are separated "
                    "by EOS. Fix: set tokenizer.eos_token and save_pretrained() again"
                )
            self.eos_id = int(eos)
            self.bos_id = -1 if self._hf.bos_token_id is None else int(self._hf.bos_token_id)
            self.pad_id = self.eos_id if self._hf.pad_token_id is None else int(self._hf.pad_token_id)
        else:
            if not p.exists():
                raise DataError(
                    f"tokenizer directory {self.path} does not exist. Fix: train one with "
                    "'python -m data_pipeline.tokenizer train --input FILES --vocab-size N --out DIR' "
                    "or point at a local HuggingFace tokenizer directory (or use 'bytes')"
                )
            raise DataError(
                f"{self.path}: no tokenizer found. Fix: point at a directory with {SP_MODEL} from 'python -m "
                "data_pipeline.tokenizer train', or with tokenizer.json/tokenizer_config.json of a HuggingFace tokenizer"
            )

    def _load_tiktoken(self, path: Path) -> None:
        """A tiktoken BPE file (lines of base64 token and rank, as Llama 3 and OpenAI ship them): the
        ranks are the ids, `EOT` is added after them as the end-of-document token, and text is split by
        the Llama 3 / cl100k pre-tokenizer pattern (a BPE file does not record its pattern)."""
        try:
            import tiktoken  # deferred: optional (pip install tiktoken)
            from tiktoken.load import load_tiktoken_bpe  # deferred: optional
        except ImportError:
            raise DataError(
                f"{path} is a tiktoken BPE file and tiktoken is not installed. Fix: pip install tiktoken"
            ) from None

        try:
            ranks = load_tiktoken_bpe(str(path))
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: not a tiktoken BPE file ({e}). Fix: lines of '<base64 token> <rank>'") from None
        self.kind = "tiktoken"
        self.eos_id = self.pad_id = len(ranks)
        self.bos_id = -1
        self._tt = tiktoken.Encoding(
            name=path.stem, pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: self.eos_id}
        )
        self.vocab_size = self._tt.n_vocab
        h = hashlib.sha256(TIKTOKEN_PATTERN.encode() + b"\0" + EOT.encode() + b"\0")
        self.identity = "tiktoken:" + file_sha256(path, h).hexdigest()[:16]
        self.path = str(path)

    def hf_tokenizer(self):
        """This tokenizer as a transformers tokenizer (for an exported model that `AutoTokenizer` and
        lm-eval's `hf` model load), or None where there is no faithful one (tiktoken: none is built here).

        A SentencePiece model becomes a generic `tokenizers` BPE tokenizer with SentencePiece's own pipeline:
        one `▁` before the whole text (its dummy prefix, where the model adds one), every space made `▁`, no
        pre-tokenizer, no BOS/EOS added, and special pieces' text read as text (`split_special_tokens`), as
        SentencePiece reads it. So it gives SentencePiece's ids, and decode(encode(text)) == text also where
        the text starts with a space: transformers' Llama conversion (Metaspace) adds no `▁` to text that
        already begins with one, and its decoder then drops that space."""
        if self._hf is not None:
            return self._hf
        if self._sp is None:
            return None
        from tokenizers import decoders, normalizers  # deferred: heavy (transformers' backend)
        from transformers import LlamaTokenizer, PreTrainedTokenizerFast  # deferred: heavy (transformers)

        # the vocabulary and merges, as transformers reads them from the SentencePiece model; the pipeline ours
        backend = LlamaTokenizer.from_pretrained(self.path, legacy=True).backend_tokenizer
        prefix = self._sp.encode("a", out_type=str)[0].startswith(SP_SPACE)  # the model's add_dummy_prefix
        backend.normalizer = normalizers.Sequence(
            [normalizers.Prepend(SP_SPACE)] * prefix + [normalizers.Replace(" ", SP_SPACE)]
        )
        backend.pre_tokenizer = None
        backend.decoder = decoders.Sequence(
            [decoders.Replace(SP_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            + [decoders.Strip(content=" ", left=1, right=0)] * prefix
        )
        backend.post_processor = None
        piece = self._sp.id_to_piece
        bos = {"bos_token": piece(self.bos_id)} if self.bos_id >= 0 else {}
        return PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token=piece(self.eos_id),
            pad_token=piece(self.pad_id),
            unk_token=piece(self._sp.unk_id()),
            clean_up_tokenization_spaces=False,
            split_special_tokens=True,
            **bos,
        )

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of each text, without BOS/EOS (the shard writer appends EOS).

        ``num_threads`` > 1 lets SentencePiece use threads (for the single-process path);
        worker processes keep 1 so K workers use K cores, not K * cores.
        """
        if self._sp is not None:
            return self._sp.encode(texts, out_type=int, num_threads=num_threads)
        if self._tt is not None:
            return self._tt.encode_ordinary_batch(texts, num_threads=num_threads)
        return self._hf(texts, add_special_tokens=False)["input_ids"]

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        if self._tt is not None:
            return self._tt.decode([i for i in ids if i != self.eos_id])
        return self._hf.decode(ids)

    def __repr__(self) -> str:
        return f"Tokenizer({self.kind}, {self.identity}, vocab={self.vocab_size})"


_CACHE: dict[str, Tokenizer] = {}


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | ByteTokenizer:
    """Load a tokenizer directory (SentencePiece ``tokenizer.model`` or a local HF tokenizer), or
    the byte tokenizer for ``"bytes"``.

    Never runs remote code and never touches the network.
    """
    if str(path) == BYTES:
        return BYTE_TOKENIZER
    key = str(Path(path).resolve())
    tok = _CACHE.get(key)
    if tok is None:
        tok = _CACHE[key] = Tokenizer(key)
    return tok


def train_sentencepiece(
    inputs: list[str],
    vocab_size: int,
    out: str | os.PathLike,
    *,
    max_sentences: int = 2_000_000,
    character_coverage: float = 0.9995,
    quiet: bool = False,
    text_field: str = "text",
) -> Tokenizer:
    """Train a byte-fallback BPE SentencePiece model on local text files (or .jsonl documents,
    their `text_field`).

    Special ids: unk=0, bos=1, eos=2, pad=3.
    The input is read in file order and not shuffled, so training is deterministic.
    """
    import sentencepiece as spm  # deferred: heavy

    files = [Path(f) for f in inputs]
    if not files:
        raise DataError("tokenizer train: no --input files given. Fix: pass one or more local text files")
    for f in files:
        if not f.is_file():
            raise DataError(f"tokenizer train: input file {f} does not exist. Fix: check the path (local files only)")
    if any(f.suffix == ".jsonl" for f in files):
        Path(out).mkdir(parents=True, exist_ok=True)
        lines_file = Path(out) / "tokenizer_input.tmp.txt"
        try:
            jsonl_lines(files, text_field, max_sentences, lines_file)
            return train_sentencepiece(
                [str(lines_file)],
                vocab_size,
                out,
                max_sentences=max_sentences,
                character_coverage=character_coverage,
                quiet=quiet,
            )
        finally:
            lines_file.unlink(missing_ok=True)
    for f in files:
        if f.stat().st_size == 0:
            raise DataError(
                f"tokenizer train: input file {f} is empty. Fix: remove it from --input or fill it with text"
            )
    if vocab_size < 1:
        raise DataError(
            f"tokenizer train: --vocab-size {vocab_size} must be positive. Fix: pass e.g. --vocab-size 8000"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(f.stat().st_size for f in files)
    t0 = time.time()
    _say(quiet, f"training BPE vocab={vocab_size} on {len(files)} file(s), {total / 1e6:.1f} MB ...")
    prefix = out / "tokenizer.tmp"
    try:
        _train(spm, files, prefix, vocab_size, character_coverage, max_sentences)
    except RuntimeError as e:
        if "required_chars" not in str(e):
            raise DataError(f"tokenizer train: SentencePiece failed on {[str(f) for f in files]}: {e}") from e
        raise _vocab_range_error(
            vocab_size, _probe_vocab_range(spm, files, character_coverage, max_sentences), character_coverage
        ) from None
    trained = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    if trained.get_piece_size() < vocab_size:  # BPE ran out of merges (the limit is soft, see _train)
        bounds = _piece_bounds(trained, saturated=True)
        for suffix in (".model", ".vocab"):
            Path(f"{prefix}{suffix}").unlink(missing_ok=True)
        raise _vocab_range_error(vocab_size, bounds, character_coverage)
    os.replace(f"{prefix}.model", out / SP_MODEL)
    if Path(f"{prefix}.vocab").exists():
        os.replace(f"{prefix}.vocab", out / "tokenizer.vocab")
    _CACHE.pop(str(out.resolve()), None)
    tok = load_tokenizer(out)
    meta = {
        "identity": tok.identity,
        "vocab_size": tok.vocab_size,
        "kind": "sentencepiece",
        "model_type": "bpe",
        "byte_fallback": True,
        "eos_id": tok.eos_id,
        "bos_id": tok.bos_id,
        "pad_id": tok.pad_id,
        "inputs": [str(f) for f in files],
    }
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    _say(quiet, f"done in {time.time() - t0:.1f}s: {tok.identity} vocab={tok.vocab_size} -> {out}")
    return tok


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(f"[tokenizer] {text}", file=sys.stderr, flush=True)


def jsonl_lines(files: list[Path], text_field: str, max_lines: int, out: Path) -> int:
    """The non-empty lines of every document's `text_field`, evenly thinned to at most `max_lines`
    (every k-th line, in file order), written to `out`. Thinning rather than the first lines:
    a corpus sorted by source would otherwise train the tokenizer on its first source only."""
    lines: list[str] = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    text = json.loads(raw)[text_field]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise DataError(
                        f"tokenizer train: {f}:{n} is not a JSON object with a {text_field!r} field. "
                        "Fix: --text-field NAME, or one JSON document per line"
                    ) from None
                lines += [ln for ln in str(text).splitlines() if ln.strip()]
    if not lines:
        raise DataError(f"tokenizer train: {[str(f) for f in files]} hold no text in {text_field!r}")
    stride = -(-len(lines) // max_lines)
    kept = lines[::stride]
    out.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return len(kept)


# Pieces every model has besides characters and merges: unk, bos, eos, pad and the 256 byte-fallback pieces.
FIXED_PIECES = 4 + 256


def _piece_bounds(sp, saturated: bool) -> tuple[int, int | None]:
    """The valid --vocab-size range a model trained with a soft limit shows: its single-character pieces
    (what character_coverage requires) plus the fixed pieces, up to its size when BPE ran out of merges."""
    chars = sum(
        1
        for i in range(sp.get_piece_size())
        if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)) and len(sp.id_to_piece(i)) == 1
    )
    return FIXED_PIECES + chars, sp.get_piece_size() if saturated else None


def _probe_vocab_range(spm, files, character_coverage, max_sentences) -> tuple[int, int | None]:
    """Train once, in memory, with a soft limit above the minimum, to read the range off the result.

    The limit is twice what every distinct character (plus the whitespace marker) would need, so the
    probe always clears the minimum; on a small alphabet or little text BPE runs out of merges below it,
    which gives the maximum too (on a large corpus the maximum is beyond the limit and stays open)."""
    distinct: set[str] = set()
    lines = 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                distinct.update(line.rstrip("\n"))
                lines += 1
                if lines >= max_sentences:
                    break
        if lines >= max_sentences:
            break
    limit = 2 * (FIXED_PIECES + len(distinct) + 1)
    model = io.BytesIO()
    _train(spm, files, None, limit, character_coverage, max_sentences, model_writer=model)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return _piece_bounds(sp, saturated=sp.get_piece_size() < limit)


def _vocab_range_error(vocab_size: int, bounds: tuple[int, int | None], character_coverage: float) -> DataError:
    low, high = bounds
    if high is not None:
        valid = f"the valid range is [{low}, {high}]"
        fix = f"pass --vocab-size between {low} and {high}"
    else:
        valid = f"the valid range starts at {low}"
        fix = f"pass --vocab-size {low} or more"
    if vocab_size < low:
        why = (
            f"too small for this data: {low - FIXED_PIECES} characters need their own piece at "
            f"--character-coverage {character_coverage} besides {FIXED_PIECES} special and byte pieces"
        )
        fix += " (or lower --character-coverage, so rare characters go through byte fallback)"
    else:
        why = f"too large for this data: BPE runs out of merges at {high} pieces"
        fix += " (or train on more text)"
    return DataError(f"tokenizer train: --vocab-size {vocab_size} is {why}, so {valid}. Fix: {fix}")


def _train(spm, files, prefix, vocab_size, character_coverage, max_sentences, model_writer=None):
    """vocab_size is a soft limit (hard_vocab_limit=False): when BPE runs out of merges the model is simply
    smaller, so the caller can report the range instead of SentencePiece's bare failure. With enough
    merges the pieces are the same as under the hard limit."""
    out = {"model_writer": model_writer} if model_writer is not None else {"model_prefix": str(prefix)}
    spm.SentencePieceTrainer.train(
        input=",".join(str(f) for f in files),
        **out,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=character_coverage,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )


def main(argv: list[str] | None = None) -> int:
    ap = CliParser(prog="python -m data_pipeline.tokenizer", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a SentencePiece BPE tokenizer (byte fallback) on local text files")
    t.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="local text files, one sentence/paragraph per line, or .jsonl documents (--text-field)",
    )
    t.add_argument("--text-field", default="text", help="the text of a .jsonl input's records")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True, help="output directory (gets tokenizer.model + tokenizer_meta.json)")
    t.add_argument("--max-sentences", type=int, default=2_000_000, help="lines read for training")
    t.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="share of characters given their own piece; the rest use byte fallback",
    )
    i = sub.add_parser("info", help="print identity and special ids of a tokenizer directory (or 'bytes')")
    i.add_argument("path")
    args = ap.parse_args(argv)

    def body() -> None:
        if args.cmd == "train":
            train_sentencepiece(
                args.input,
                args.vocab_size,
                args.out,
                max_sentences=args.max_sentences,
                character_coverage=args.character_coverage,
                text_field=args.text_field,
            )
        else:
            tok = load_tokenizer(args.path)
            keys = ("identity", "kind", "vocab_size", "eos_id", "bos_id", "pad_id")
            print(json.dumps({k: getattr(tok, k) for k in keys}, indent=2))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
