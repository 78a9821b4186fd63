"""The repository's shape, checked: imports point down the layers (import-linter), the code
passes ruff (lint and format), and no module hides an import inside a function except to
defer a heavy optional dependency, said on that line."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PACKAGES = ("studies", "eval", "pretrain", "checkpoint", "model", "data_pipeline", "common")
# What a function may import lazily: slow to import, or absent on some machines.
HEAVY = (
    "deepspeed",
    "flash_attn",
    "triton",
    "lm_eval",
    "liger_kernel",
    "matplotlib",
    "scipy",
    "datasets",
    "fsspec",
    "transformers",
    "model.hf",
    "torch.utils.tensorboard",
    "sentencepiece",
    "s3fs",
    "gcsfs",
    "aiohttp",
    "eval.lm_eval_adapter",
    "mlflow",
    "wandb",
    "tiktoken",
)  # imports lm_eval at its top


def _tool(name: str) -> str:
    """A dev tool's command: this venv's, else the base interpreter's or PATH's (a venv made on top of
    a Python that has the dev tools already, as scripts/bootstrap.sh does where torch is installed)."""
    for cand in (BIN / name, Path(sys.base_prefix) / "bin" / name):
        if cand.is_file():
            return str(cand)
    return shutil.which(name) or str(BIN / name)


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=REPO, capture_output=True, text=True)


def test_imports_point_down_the_layers():
    out = _run(_tool("lint-imports"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "1 kept, 0 broken" in out.stdout


def test_ruff_lint_passes():
    out = _run(_tool("ruff"), "check", ".")
    assert out.returncode == 0, out.stdout[-4000:]


def test_no_dead_code():
    """vulture over the packages and benchmarks ([tool.vulture] in pyproject.toml names the hooks that
    frameworks call and vulture cannot see)."""
    out = _run(_tool("vulture"))
    assert out.returncode == 0, "unused code:\n" + out.stdout[-4000:]


def test_ruff_format_is_applied():
    out = _run(_tool("ruff"), "format", "--check", ".")
    assert out.returncode == 0, "run `.venv/bin/ruff format .`:\n" + out.stdout[-4000:]


def _function_level_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, absolute module name, the statement's text) of every import below module level (an
    `if TYPE_CHECKING:` block at module level counts as module level: its imports are for annotations)."""
    src = path.read_text()
    tree = ast.parse(src)
    top = {id(n) for n in tree.body}
    for n in tree.body:
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
            top |= {id(m) for m in n.body}
    lines = src.splitlines()
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top:
            if isinstance(node, ast.Import):
                name = node.names[0].name
            else:
                base = package[: len(package) - node.level + 1] if node.level else ()
                name = ".".join([*base, *([node.module] if node.module else [])])
            out.append((node.lineno, name, "\n".join(lines[node.lineno - 1 : node.end_lineno])))
    return out


def test_no_function_level_imports_except_deferred_heavy_ones():
    bad = []
    for pkg in PACKAGES:
        for f in sorted((REPO / pkg).rglob("*.py")):
            for line, name, text in _function_level_imports(f):
                heavy = any(name == h or name.startswith(h + ".") for h in HEAVY)
                if not (heavy and "# deferred:" in text):
                    bad.append(f"{f.relative_to(REPO)}:{line}: {text.strip()}")
    assert not bad, (
        "imports inside functions (move them to the top, or mark a heavy one `# deferred: ...`):\n" + "\n".join(bad)
    )
