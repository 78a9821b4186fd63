"""Every rank agrees on the run before step 1. Each gathers every rank's fingerprint of what must be equal (the
recipe, the code with its uncommitted edits, the versions of the packages that compute and communicate, the
device type and world size) and a difference stops every rank with the same line naming the nodes and the keys,
where nodes that differ would otherwise train apart silently or fail in a collective later (docs/TRAINING.md,
"Before step 1"). The code's identity is also what `python -m pretrain.preflight` compares, and what the run dir
records (code.json)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.constants import REPO_ROOT, atomic_write, file_sha256
from common.errors import NodesDisagree

from .config import RunConfig, resolve_ds_config_path
from .rendezvous import where

CODE = ("*.py", "*.sh", "*.json", "*.yaml", "*.toml")  # local edits that change what runs (not data, not docs)
SOURCES = ("common", "model", "data_pipeline", "checkpoint", "eval", "pretrain", "ds_configs")  # what a rank runs
# Recipe keys that may differ between nodes: where a node caches remote shards and how much, its credentials
# (never printed), how long it waits for the others to arrive, and rank 0's own logging and trackers
NODE_LOCAL = (
    "data.cache_dir",
    "data.cache_max_gb",
    "data.cache_block_kb",
    "data.storage_options",
    "parallel.rendezvous_timeout_s",
    "logging.",
)
SHOWN = 4  # keys named in the error line


def git(*args: str) -> str:
    """git's output in this checkout; empty where git fails (not a checkout), which the commit shows."""
    return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, timeout=60).stdout


def commit() -> str:
    """This checkout's HEAD, plus a hash of its uncommitted edits to code: every node must run the same."""
    try:
        head, diff = git("rev-parse", "HEAD").strip(), git("diff", "HEAD", "--", *CODE)
        new = sorted(filter(None, git("ls-files", "--others", "--exclude-standard", "-z", "--", *CODE).split("\0")))
    except (OSError, subprocess.TimeoutExpired):
        return "no git"
    h = hashlib.sha256(diff.encode())
    for name in new:
        h.update(name.encode())
        with contextlib.suppress(OSError):  # a dangling link: its name is what differs
            h.update((REPO_ROOT / name).read_bytes())
    return (head[:12] or "no git") + (f"+edits {h.hexdigest()[:8]}" if diff or new else "")


def sources_sha256() -> str:
    """A hash of the trainer's code files as they are on disk: the code's identity where there is no git
    checkout too (a copied tree), and whatever git says."""
    h = hashlib.sha256()
    files = [REPO_ROOT / "launch.sh"]
    for top in SOURCES:
        files += [p for pattern in CODE for p in (REPO_ROOT / top).rglob(pattern) if "__pycache__" not in p.parts]
    for path in sorted(set(files)):
        if path.is_file():
            h.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0")
            file_sha256(path, h)
    return h.hexdigest()


def versions() -> dict[str, str]:
    """What ranks must share to agree on kernels, collectives and checkpoint formats (read from the packages'
    metadata: importing DeepSpeed takes seconds)."""

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "deepspeed": version("deepspeed"),
        "transformers": version("transformers"),
    }


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 3e-3}} -> {"optim.lr": 3e-3}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fingerprint(cfg: RunConfig, device: torch.device, world: int, sources: str) -> dict[str, str]:
    """What must be equal on every rank, key -> value as the error line shows it. The code is compared by its
    files (sources_sha256), not by its commit: two commits that differ in docs only run the same code."""
    recipe = {k: v for k, v in flat(cfg.to_dict()).items() if not k.startswith(NODE_LOCAL)}
    out = {k: json.dumps(v, sort_keys=True, default=str) for k, v in recipe.items()}
    with contextlib.suppress(Exception):  # a name the layout refuses later, with its own line
        out["parallel.ds_config's file"] = file_sha256(resolve_ds_config_path(cfg.parallel.ds_config)).hexdigest()[:12]
    out["code"] = f"sources {sources[:12]}"
    out.update({f"version of {k}": v for k, v in versions().items()})
    out.update({"device": device.type, "world size": str(world)})
    return out


def differences(prints: list[tuple[str, dict[str, str], str]]) -> list[str]:
    """'KEY: VALUE on NODE, VALUE on NODE' for every key whose value is not the same on every rank (the code
    shown with each node's commit)."""
    out = []
    for key in sorted({k for _, fp, _ in prints for k in fp}):
        seen: dict[str, list[str]] = {}
        for who, fp, head in prints:
            value = fp.get(key, "(none)") + (f" (commit {head})" if key == "code" else "")
            nodes = seen.setdefault(value, [])
            if who not in nodes:
                nodes.append(who)
        if len(seen) > 1:
            out.append(f"{key}: " + ", ".join(f"{value} on {' and '.join(nodes)}" for value, nodes in seen.items()))
    return out


def gathered(mine: tuple[str, dict[str, str], str], world: int) -> list[tuple[str, dict[str, str], str]]:
    """Collective: every rank's (where, fingerprint, commit)."""
    if world == 1:
        return [mine]
    prints: list = [None] * world
    dist.all_gather_object(prints, mine)
    return prints


def refuse_differences(prints: list[tuple[str, dict[str, str], str]], what: str, fix: str) -> None:
    """The same NodesDisagree on every rank where the gathered fingerprints differ."""
    diffs = differences(prints)
    if diffs:
        more = f" (and {len(diffs) - SHOWN} more)" if len(diffs) > SHOWN else ""
        raise NodesDisagree(
            f"the ranks of this job were not given the same {what}: {'; '.join(diffs[:SHOWN])}{more}. {fix}"
        )


def agree(cfg: RunConfig, device: torch.device, rank: int, world: int) -> dict[str, Any]:
    """Collective: every rank's fingerprint gathered and compared; a difference is the same NodesDisagree on every
    rank. Returns what code.json records."""
    sources = sources_sha256()
    mine = (where(), fingerprint(cfg, device, world, sources), commit())
    prints = gathered(mine, world)
    refuse_differences(
        prints,
        "run",
        "Fix: start every node with the same recipe, overrides, checkout and environment (python -m pretrain.preflight "
        "compares the checkouts and versions of the nodes)",
    )
    return {
        "commit": mine[2],
        "sources_sha256": sources,
        "versions": versions(),
        "fingerprint_sha256": hashlib.sha256(json.dumps(mine[1], sort_keys=True).encode()).hexdigest(),
        "nodes": list(dict.fromkeys(who for who, _, _ in prints)),
    }


def agree_on_data(probe: Any, world: int) -> None:
    """Collective, once each rank has read its training data: the same data on every rank (its manifest's hash,
    vocabulary and tokenizer). A recipe names a path; node-local copies at that path may hold other data, whose
    vocabulary would size another model (a collective of mismatched sizes later) or train apart silently."""
    mine = {
        "the data's manifest": str(getattr(probe, "fingerprint", None)),
        "the data's vocabulary size": str(getattr(probe, "vocab_size", None)),
        "the data's tokenizer": str(getattr(probe, "tokenizer_id", None)),
    }
    refuse_differences(
        gathered((where(), mine, ""), world),
        "data",
        "Fix: give every node the same prepared data (one shared directory, or node-local copies of the same "
        "data_pipeline.prepare output)",
    )


def write_code(run_dir: Path, agreed: dict[str, Any]) -> None:
    """RUN/code.json: the code, versions and fingerprint every rank of the latest start agreed on."""
    atomic_write(Path(run_dir) / "code.json", json.dumps(agreed, indent=1) + "\n")
