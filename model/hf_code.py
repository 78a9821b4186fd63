"""The modelling code an export of a variant transformers does not know ships beside its weights, so that
`AutoModelForCausalLM.from_pretrained(DIR, ...)` with the user's opt-in to remote code (trust_remote_code) loads
it in a process that has torch and transformers but not this repository.

The code is this repository's own, not a second copy: model/hf_modeling.py and every project module it
imports, read from their files and written flat into the export directory (transformers copies a remote
model's files into one package and follows only `from .NAME import ...`), each import of a project module
rewritten to its flat name. Imports a module defers into a function (Triton, flash-attn, Liger: GPU paths
taken only where the package is installed) go through importlib in the copy, because transformers asks a
remote file for every package it names in an import statement, wherever the statement stands.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

ENTRY = "model.hf_modeling"  # the module whose classes the export's config.json names
MAIN = "modeling_trainable_parts"  # its file name in an export
PROJECT = ("model", "common")  # the packages the modelling code may import from this repository
REQUIRED = ("torch", "transformers", "safetensors")  # what a process loading the export has (with the stdlib)
_IMPORTLIB = '__import__("importlib").import_module'


def flat_name(module: str) -> str:
    """An exported module's file name (without .py): model.kernels.loss -> tp_model_kernels_loss."""
    return MAIN if module == ENTRY else "tp_" + module.replace(".", "_")


def auto_map() -> dict[str, str]:
    """config.json's `auto_map`: where transformers finds the classes with trust_remote_code."""
    return {
        "AutoConfig": f"{MAIN}.TrainablePartsConfig",
        "AutoModelForCausalLM": f"{MAIN}.TrainablePartsForCausalLM",
    }


def _source_file(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise RuntimeError(f"modelling code: module {module} not found")
    if spec.submodule_search_locations is not None:
        raise RuntimeError(f"modelling code: {module} is a package; import names from the module that defines them")
    return Path(spec.origin)


def _imported_module(module: str, node: ast.ImportFrom) -> str | None:
    """The project module a `from ... import` names, or None for one outside the project."""
    if node.level == 0:
        return node.module if node.module and node.module.split(".")[0] in PROJECT else None
    if node.module is None:
        raise RuntimeError(
            f"modelling code: `from {'.' * node.level} import ...` in {module}; import names from a module"
        )
    package = module.rsplit(".", node.level)[0]
    return f"{package}.{node.module}"


def _deferred(tree: ast.Module) -> set[int]:
    """ids of the import statements inside a function."""
    inner = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inner


def _optional(name: str) -> bool:
    top = name.split(".")[0]
    return top not in REQUIRED and top not in sys.stdlib_module_names and top not in PROJECT


def _through_importlib(node: ast.Import | ast.ImportFrom) -> str:
    """A deferred import of an optional package as importlib calls, binding the same names."""
    if isinstance(node, ast.ImportFrom):
        return "; ".join(f"{a.asname or a.name} = {_IMPORTLIB}({node.module!r}).{a.name}" for a in node.names)
    return "; ".join(
        f"{a.asname} = {_IMPORTLIB}({a.name!r})" if a.asname else f"{a.name.split('.')[0]} = __import__({a.name!r})"
        for a in node.names
    )


def shipped_source(module: str) -> tuple[str, list[str]]:
    """(the module's source as it ships, the project modules it imports). Lines keep their numbers, so a
    traceback in the export points at the same line as in this repository."""
    text = _source_file(module).read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    deferred = _deferred(tree)
    needs: list[str] = []
    edits: list[tuple[int, int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            if any(a.name.split(".")[0] in PROJECT for a in node.names):
                raise RuntimeError(f"modelling code: `import {node.names[0].name}` in {module}; use `from ... import`")
            if id(node) in deferred and any(_optional(a.name) for a in node.names):
                edits.append((node.lineno, node.end_lineno, _through_importlib(node)))
        elif isinstance(node, ast.ImportFrom):
            target = _imported_module(module, node)
            if target is not None:
                needs.append(target)
                names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
                edits.append((node.lineno, node.end_lineno, f"from .{flat_name(target)} import {names}"))
            elif id(node) in deferred and _optional(node.module or ""):
                edits.append((node.lineno, node.end_lineno, _through_importlib(node)))
    for first, last, statement in sorted(edits, reverse=True):
        indent = lines[first - 1][: len(lines[first - 1]) - len(lines[first - 1].lstrip())]
        lines[first - 1 : last] = [f"{indent}{statement}\n"] + ["\n"] * (last - first)
    origin = f"{module.replace('.', '/')}.py"
    lines.append(f"\n# {origin} of trainable-parts, shipped with an export (imports rewritten by model/hf_code.py)\n")
    return "".join(lines), needs


def write_modelling_code(out_dir: str | Path) -> list[Path]:
    """Write model/hf_modeling.py and every project module it imports, flat, into `out_dir`."""
    out, written, todo, seen = Path(out_dir), [], [ENTRY], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        source, needs = shipped_source(module)
        path = out / f"{flat_name(module)}.py"
        path.write_text(source)
        written.append(path)
        todo += needs
    return written
