"""The repository's shape, checked: imports point down the layers (import-linter), the code
passes ruff (lint and format), and no module hides an import inside a function except to
defer a heavy optional dependency, said on that line."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PACKAGES = ("studies", "eval", "pretrain", "checkpoint", "model", "data_pipeline", "common", "benchmarks")
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
    "tokenizers",  # transformers' tokenizer backend, used with it
    "torch.utils.tensorboard",
    "sentencepiece",
    "s3fs",
    "gcsfs",
    "aiohttp",
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


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports at module level (type-checking imports included), as dotted names."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).split(".") if path.name == "__init__.py" else _module_name(path).split(".")[:-1]
    body = list(tree.body)
    for n in tree.body:
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING":
            body += n.body
    out = set()
    for node in body:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*(package[: len(package) - node.level + 1] if node.level else []), node.module or ""])
            base = base.strip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        out |= {n for n in names if n in known}
    return out


def test_no_import_cycles():
    """Module-level imports between the project's modules, type-checking ones included, form no cycle (a
    cycle makes the import order matter and hides which module is the lower one)."""
    files = {_module_name(f): f for pkg in PACKAGES for f in (REPO / pkg).rglob("*.py")}
    graph = {m: _module_level_imports(f, set(files)) - {m} for m, f in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(path[path.index(n) :] + [m, n]) if n in path else f"{m} -> {n}")
            elif n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_loading_a_recipe_builds_nothing():
    """`import pretrain.config` (the recipe) loads no component of a run: no loader, engine, loop, logger,
    tracker, checkpoint or evaluation module, and no model: the `model` package exports its configuration
    only (13 project modules in all today)."""
    code = (
        "import sys, json; before = set(sys.modules); import pretrain.config; "
        f"print(json.dumps(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {list(PACKAGES)!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    builders = [m for m in loaded if m.startswith(("checkpoint", "eval", "studies", "data_pipeline.loader"))]
    builders += [
        m for m in loaded if m.startswith("pretrain.") and m not in ("pretrain.config", "pretrain.recipe_checks")
    ]
    builders += [m for m in loaded if m.startswith("model.") and m != "model.config"]
    assert not builders, f"loading a recipe imports {builders}"
    assert len(loaded) <= 20, loaded
