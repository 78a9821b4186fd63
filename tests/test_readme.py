"""The README is a test: every shell command of README.md's and docs/TRAINING.md's ```bash blocks
runs, in order, in a scratch copy of the repository, and produces what the docs say it produces.

Commands run as written (through bash, with the virtual environment on PATH as after
`source .venv/bin/activate`), a command the docs repeat (or a plan two launch lines share) once; only
the budget changes: training gets dotted overrides appended (`train.max_steps=4 ...`), studies get smaller
sizes (the scaling sweep standard alone), and commands that need GPUs,
several nodes or a Slurm allocation print their plan (`launch.sh --dry-print`, plus a
`pretrain.train --dry-run` of the same training arguments). Every command must match exactly one
rule below, so a command added to the docs without a rule fails here, and so does a flag the code
no longer accepts. The scratch copy has nothing beside it, as on a user's machine. `./demo.sh` is run
by tests/test_demo.py (a tiny budget, the verdict's pair standard and mixit), not twice.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from checkpoint import tag_format
from pretrain.config import load_recipe

REPO = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/TRAINING.md")
TRAIN_BUDGET = ["train.max_steps=4", "checkpoint.every_steps=2", "logging.tensorboard=false"]
TIMEOUT_S = 600

pytestmark = pytest.mark.slow


# ---- reading the docs ---------------------------------------------------------------------


def doc_commands(text: str) -> list[str]:
    """The commands of every ```bash block: continuation lines joined, comments dropped, `a && b` split."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            cmd: list[str] = []
            for t in tokens + ["&&"]:
                if t == "&&":
                    if cmd:
                        out.append(_join(cmd))
                    cmd = []
                else:
                    cmd.append(t)
    return out


def _join(tokens: list[str]) -> str:
    """Tokens back to a bash line; globs stay unquoted so bash expands them as the docs intend."""
    return " ".join(t if re.fullmatch(r"[\w@%+=:,./*?~-]+", t) else shlex.quote(t) for t in tokens)


# ---- how each command runs in the test, and what it must produce ----------------------------


@dataclass
class Rule:
    pattern: str  # regex on the command line
    what: str  # what the docs say it produces
    budget: Callable[[list[str]], list[str]] = lambda t: t
    check: Callable[[Path, str, list[str]], None] = lambda root, out, t: None
    also: Callable[[list[str]], list[str] | None] = lambda t: None  # a second command that must pass too
    run: bool = True


def _arg(tokens: list[str], flag: str) -> str | None:
    return tokens[tokens.index(flag) + 1] if flag in tokens else None


def _recipe_run_dir(root: Path, tokens: list[str]) -> Path:
    """The run dir a training command writes: --run-dir, else runs/<name> (an override or the recipe's)."""
    if _arg(tokens, "--run-dir"):
        return root / _arg(tokens, "--run-dir")
    name = next((t.split("=", 1)[1] for t in tokens if t.startswith("name=")), None)
    if name is None:
        name = re.search(r"^name:\s*(\S+)", (root / _arg(tokens, "--recipe")).read_text(), re.M).group(1)
    return root / "runs" / name


def _trained(root: Path, out: str, tokens: list[str]) -> None:
    run = _recipe_run_dir(root, tokens)
    latest = tag_format.latest_checkpoint(run)
    assert latest is not None and tag_format.read_state(latest)["step"] == 4, f"{run}: no complete checkpoint at step 4"
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4


def _train_args(tokens: list[str]) -> list[str]:
    return tokens[tokens.index("--") + 1 :]


def _launch_dry(tokens: list[str]) -> list[str]:
    i = tokens.index("--")
    return tokens[:i] + ["--dry-print"] + tokens[i:]


def _plan_of_launch(tokens: list[str]) -> list[str]:
    """The same training arguments as a --dry-run on the world size the launch line asks for, without the
    data (a GPU cluster's shards are not in the clone)."""
    gpus = int(_arg(tokens, "--gpus") or 8)
    nodes = 2 if "--hostfile" in tokens else 1
    plan = ["--dry-run", "--without-data", "--world-size", str(gpus * nodes)]
    return ["python", "-m", "pretrain.train", *_train_args(tokens), *plan]


def _printed_launch(root: Path, out: str, tokens: list[str]) -> None:
    target = "--_slurm-task" if "--slurm" in tokens else "pretrain.train"  # srun re-enters launch.sh per task
    assert out.startswith("+ ") and target in out and _arg(tokens, "--recipe") in out, out[-2000:]


def _file(path: str, *more: str) -> Callable[[Path, str, list[str]], None]:
    def check(root: Path, out: str, tokens: list[str]) -> None:
        for p in (path, *more):
            assert (root / p).exists(), f"{p} was not produced"

    return check


def _eval_out(root: Path, out: str, tokens: list[str]) -> None:
    if _arg(tokens, "--out"):
        res = json.loads((root / _arg(tokens, "--out")).read_text())
        wanted = _arg(tokens, "--tasks").split(",")
        assert set(res["tasks"]) == set(wanted) and all(res["tasks"][t] for t in wanted)
    elif _arg(tokens, "--out-dir"):
        d = root / _arg(tokens, "--out-dir")
        table = (d / "results.md").read_text()
        for run in [t for i, t in enumerate(tokens) if i and tokens[i - 1] == "--run-dir"]:
            assert Path(run).name in table
        assert list((d / "plots").glob("*.png"))
    else:
        res = json.loads(out)
        assert res["tasks"] and res["metrics"]


def _scaling(root: Path, out: str, tokens: list[str]) -> None:
    d = root / _arg(tokens, "--out")
    if tokens[3] == "sweep":
        assert len(list((d / "runs").iterdir())) >= 2
    elif tokens[3] == "collect":
        assert (d / "results.csv").is_file() and (d / "results.md").is_file()
    else:
        assert (d / "fits.json").is_file() and list(d.glob("*.png"))


def _scaling_budget(tokens: list[str]) -> list[str]:
    if tokens[3] != "sweep":
        return tokens
    return tokens + ["--sizes", "tiny,xs", "--variants", "standard", "--seeds", "1", "--tokens", "4096"]


RULES = [
    Rule(r"^tests/run$", "the test suite (this test is part of it)", run=False),
    Rule(r"^source \.venv/bin/activate$", "the environment on PATH (every command here runs with it)", run=False),
    Rule(
        r"^\./demo\.sh$",
        "a table beside the paper's numbers, a verdict line and demo.png: run by tests/test_demo.py",
        run=False,
    ),
    Rule(
        r"^python -m pretrain\.train .*--dry-run",
        "the plan",
        check=lambda root, out, t: (assert_in("# summary", out), assert_in("layout:", out)),
    ),
    Rule(
        r"^python -m pretrain\.train ", "a run dir with checkpoints", budget=lambda t: t + TRAIN_BUDGET, check=_trained
    ),
    Rule(
        r"^\./launch\.sh --cpu \d+ -- ",
        "a run trained by N CPU ranks",
        budget=lambda t: t + TRAIN_BUDGET,
        check=_trained,
    ),
    Rule(
        r"^\./launch\.sh ",
        "the launch command (GPU, multi-node or Slurm: printed, the plan checked)",
        budget=_launch_dry,
        check=_printed_launch,
        also=_plan_of_launch,
    ),
    Rule(
        r"^python -m pretrain\.export ",
        "an exported model dir",
        check=lambda root, out, t: _file(_arg(t, "--out") + "/config.json")(root, out, t),
    ),
    Rule(
        r"^python -m pretrain\.universal ",
        "a universal checkpoint",
        check=lambda root, out, t: assert_in("universal checkpoint:", out),
    ),
    Rule(
        r"^python -m data_pipeline\.tokenizer train ",
        "a tokenizer dir",
        budget=lambda t: t + ["--vocab-size", "1000"],
        check=lambda root, out, t: _file(_arg(t, "--out"))(root, out, t),
    ),
    Rule(
        r"^python -m data_pipeline\.prepare ",
        "a shard dir with a manifest",
        check=lambda root, out, t: _file(_arg(t, "--out") + "/manifest.json")(root, out, t),
    ),
    Rule(r"^python -m eval\.run ", "results (JSON, or a table and plots for --run-dir)", check=_eval_out),
    Rule(
        r"^python -m eval\.generate ", "generated text", check=lambda root, out, t: assert_in(_arg(t, "--prompt"), out)
    ),
    Rule(
        r"^python -m eval\.lm_eval_cli ",
        "lm-eval's results table, a row per task",
        check=lambda root, out, t: [assert_in(f"|{task}", out) for task in _arg(t, "--tasks").split(",")],
    ),
    Rule(
        r"^python -m studies\.scaling (sweep|collect|fit) ",
        "sweep runs, a table, fits and plots",
        budget=_scaling_budget,
        check=_scaling,
    ),
]


def assert_in(needle: str, text: str) -> None:
    assert needle in text, f"{needle!r} not in output:\n{text[-3000:]}"


def rule_for(cmd: str) -> Rule:
    hits = [r for r in RULES if re.search(r.pattern, cmd)]
    assert hits, f"no rule for the documented command {cmd!r}: add one to tests/test_readme.py"
    return hits[0]


# ---- the scratch checkout -----------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """tmp/repo: the tracked files, the environment linked, nothing beside them."""
    top = tmp_path_factory.mktemp("readme")
    root = top / "repo"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for f in files:
        if (REPO / f).is_file():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, root / f)
    (root / ".venv").symlink_to(sys.prefix)  # the environment running the tests (.venv, or a compat set's)
    (root / "hostfile").write_text("node0 slots=8\nnode1 slots=8\n")  # the format the docs describe
    fake = top / "fake-bin"  # scontrol, for the Slurm line's plan outside an allocation
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\necho node0\n")
    (fake / "scontrol").chmod(0o755)
    return root


def _env(root: Path) -> dict[str, str]:
    keep = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"))
    }
    return dict(
        keep,
        PATH=f"{root / '.venv' / 'bin'}:{os.environ['PATH']}:{root.parent / 'fake-bin'}",
        VIRTUAL_ENV=str(root / ".venv"),
        DS_ACCELERATOR="cpu",
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_NTASKS="16",
        SLURM_NNODES="2",
    )


def _bash(root: Path, tokens: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", _join(tokens)], cwd=root, env=_env(root), capture_output=True, text=True, timeout=TIMEOUT_S
    )


# ---- the tests ----------------------------------------------------------------------------


def _all_commands() -> list[tuple[str, str]]:
    return [(doc, c) for doc in DOCS for c in doc_commands((REPO / doc).read_text())]


def test_every_documented_command_has_a_rule():
    cmds = _all_commands()
    assert len(cmds) >= 20
    for _, c in cmds:
        rule_for(c)
    readme = [c for d, c in cmds if d == "README.md"]
    assert readme[:2] == ["./demo.sh", "tests/run"], "the README's two set-up commands come first"


def test_what_the_documented_commands_write_is_ignored_by_git():
    """A new user who runs the docs' commands in a clone finds what they wrote ignored, not a dozen untracked
    paths (tok/, shards/, valid-gcide/, exports/ ... at the repository's root were not)."""
    written = {
        tokens[tokens.index(flag) + 1]
        for _, cmd in _all_commands()
        for tokens in [shlex.split(cmd)]
        for flag in ("--out", "--out-dir", "--run-dir", "--output_path")
        if flag in tokens
    }
    assert {"tok", "shards", "valid-gcide", "results.json"} <= written
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", *sorted(written)], cwd=REPO, capture_output=True, text=True
    )
    assert set(checked.stdout.split()) == written


def test_the_readmes_first_training_command_trains_the_standard_model():
    """The first model a new user trains is the standard one (recipes/tiny_cpu.yaml trained MixiT)."""
    first = next(c for d, c in _all_commands() if d == "README.md" and c.startswith("python -m pretrain.train "))
    tokens = shlex.split(first)
    overrides = [t for t in tokens[tokens.index("--recipe") + 2 :] if "=" in t and not t.startswith("-")]
    assert load_recipe(REPO / _arg(tokens, "--recipe"), overrides).model.variant == "standard", first


def test_doc_commands_parse_blocks_continuations_comments_and_chains():
    text = "x\n```bash\na --b 'c d'  # note\ne \\\n  f && g *.txt\n# only a comment\n```\n```python\nno\n```\n"
    assert doc_commands(text) == ["a --b 'c d'", "e f", "g *.txt"]


def test_the_documented_journey_runs(scratch, capsys):
    ran = set()
    for doc, cmd in _all_commands():
        rule = rule_for(cmd)
        if not rule.run or cmd in ran:  # a command the docs repeat runs once
            continue
        ran.add(cmd)
        tokens = rule.budget(shlex.split(cmd))
        t0 = time.monotonic()
        out = _bash(scratch, tokens)
        with capsys.disabled():  # to the terminal, also where output is captured
            print(f"[readme] {time.monotonic() - t0:6.1f} s  {cmd[:110]}", flush=True)
        assert out.returncode == 0, (
            f"{doc}: `{cmd}` (run as `{_join(tokens)}`) failed:\n{(out.stdout + out.stderr)[-4000:]}"
        )
        rule.check(scratch, out.stdout, tokens)
        extra = rule.also(tokens)
        if extra is not None and _join(extra) not in ran:  # launch lines of one recipe share a plan
            ran.add(_join(extra))
            out2 = _bash(scratch, extra)
            assert out2.returncode == 0, f"{doc}: plan of `{cmd}` failed:\n{(out2.stdout + out2.stderr)[-3000:]}"
