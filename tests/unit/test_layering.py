"""The layering rule of DESIGN.md, checked on the source: a module imports only from lower layers
and its own package; sandbox, harness, tasks and evals never import torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "opencomposer"

LAYERS = {
    "core": 0,
    "sandbox": 1, "kernels": 1, "tokenizer": 1,
    "harness": 2, "model": 2,
    "tasks": 3, "inference": 3, "train": 3,
    "evals": 4,
    "rl": 5,
    "report": 6, "speedrun": 7, "cli": 8,
    "__init__": 0,
}
TORCH_FREE = {"core", "sandbox", "harness", "tasks", "evals"}


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "opencomposer":  # `from opencomposer import speedrun` names a module
                out += [f"opencomposer.{a.name}" for a in node.names]
            else:
                out.append(node.module)
    return out


def violations(src: Path = SRC) -> list[str]:
    bad = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        pkg = rel.parts[0].removesuffix(".py")
        if pkg not in LAYERS:
            bad.append(f"{rel}: package {pkg!r} has no layer in the table")
            continue
        for mod in imports_of(path):
            root = mod.split(".")[0]
            if root in ("torch", "triton") and pkg in TORCH_FREE:
                bad.append(f"{rel}: imports {mod} but {pkg} must stay torch-free")
            if root != "opencomposer":
                continue
            other = top_package(mod)
            if other == pkg or other == "__init__":
                continue
            if other not in LAYERS:
                bad.append(f"{rel}: imports unknown package {mod}")
            elif LAYERS[other] >= LAYERS[pkg]:
                bad.append(f"{rel}: layer {LAYERS[pkg]} ({pkg}) imports {mod} (layer {LAYERS[other]})")
    return bad


def test_layering_holds():
    assert violations() == []


MAX_MODULE_LINES = 600
SELF_CONTAINED = {"sandbox/toolserver.py"}
"""Runs inside the sandbox as one file on a bare interpreter (`python -S -I toolserver.py`): it
cannot import sibling modules, so it stays whole (628 lines)."""


def test_modules_stay_small():
    """Small modules named for what they own (style.md): none over 600 lines."""
    big = {rel: n for p in SRC.rglob("*.py") if (rel := str(p.relative_to(SRC))) not in SELF_CONTAINED
           and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert big == {}


@pytest.mark.parametrize("pkg,code,expect", [
    ("sandbox", "import torch\n", "torch-free"),
    ("core", "from opencomposer.sandbox import local\n", "layer 0 (core) imports"),
    ("harness", "from opencomposer.model import x\n", "layer 2 (harness) imports"),
    ("report", "from opencomposer import speedrun\n", "layer 6 (report) imports"),
])
def test_the_checker_catches_violations(tmp_path, pkg, code, expect):
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "m.py").write_text(code)
    found = violations(tmp_path)
    assert any(expect in v for v in found), found
