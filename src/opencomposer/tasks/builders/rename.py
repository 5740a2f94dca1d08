"""Tasks from a codebase whose test suite passes: renames, the refactoring that real engineering
work asks for in one line ("rename X to Y").

Pick a public function, class or method that is defined once in the code and that the tests use;
the hidden tests call it by a new name (every use of the identifier in the test files renamed), and
the repository still has the old one, so the tests that use it fail. The reference change renames
it in the code: the definition, every use, in every file, and its entries in `__all__`. Kept only
if the renamed code passes the tests that use the new name and the rest of the suite still
passes. Renaming by token (not by text) leaves comments, docstrings and other strings alone.

A step below a bug fix in difficulty, and on purpose: a small model after SFT passes some of
these and fails others for reasons that are skill (a missed call site, a broken edit), which is
the starting point RL needs (issue 13: a family the starting policy passes roughly 5-35% of the
time).
"""

from __future__ import annotations

import ast
import builtins
import io
import logging
import random
import re
import shutil
import tempfile
import tokenize
from collections.abc import Callable
from pathlib import Path

from opencomposer.sandbox.base import SandboxConfig
from opencomposer.sandbox.local import Workspace
from opencomposer.tasks import environment
from opencomposer.tasks.builders.deletion import CodeSource, definitions, passing_tests, run_suite, stage, write_task
from opencomposer.tasks.environment import EnvironmentSpec

log = logging.getLogger(__name__)


def _rename_spans(text: str, old: str, new: str) -> list[tuple[int, int, int, str]]:
    """(line, start col, end col, replacement) of every NAME token `old` and every one-line string
    literal that is exactly `old`; empty where the source does not tokenize."""
    spans: list[tuple[int, int, int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME and tok.string == old:
                spans.append((tok.start[0], tok.start[1], tok.end[1], new))
            elif tok.type == tokenize.STRING and tok.start[0] == tok.end[0] and tok.string in (f"'{old}'", f'"{old}"'):
                q = tok.string[0]
                spans.append((tok.start[0], tok.start[1], tok.end[1], f"{q}{new}{q}"))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    return spans


def rename_sites(code: dict[str, str], old: str) -> int:
    """How many places (identifier tokens and `__all__`-style string literals) renaming `old` changes
    in `code` ({path: text}): the definition counts as one."""
    return sum(len(_rename_spans(text, old, old)) for text in code.values())


def rename_identifier(text: str, old: str, new: str) -> str:
    """`text` (Python source) with every NAME token `old` and every string literal that is exactly
    `old` (an `__all__` entry, a `getattr` name) changed to `new`; nothing else changes, byte for
    byte. Source that does not tokenize is returned unchanged."""
    spans = _rename_spans(text, old, new)
    if not spans:
        return text
    lines = text.splitlines(keepends=True)
    for line, a, b, rep in sorted(spans, reverse=True):  # right to left keeps earlier columns valid
        s = lines[line - 1]
        lines[line - 1] = s[:a] + rep + s[b:]
    return "".join(lines)


def _names(text: str) -> set[str]:
    try:
        return {t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME}
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def new_name(old: str, rng: random.Random, taken: set[str]) -> str | None:
    """A new name in the style of the old one that nothing in the code or tests uses yet."""
    if old[:1].isupper():  # a class
        options = [f"{old}Impl", f"Base{old}", f"{old}V2"]
    else:
        options = [f"{old}_v2", f"compute_{old}", f"{old}_impl"]
    rng.shuffle(options)
    return next((n for n in options if n not in taken), None)


# Names a rename by token would also change where they mean something else (`s.split()`, `len`).
_BUILTIN_NAMES = set(dir(builtins)).union(*(dir(t) for t in (str, bytes, list, dict, set, tuple, int, float,
                                                              object)))


def rename_candidates(code: dict[str, str], tests: dict[str, str], rng: random.Random,
                      min_length: int = 4) -> list[tuple[str, str, str]]:
    """(file, qualname, new name) for public definitions made once in `code` ({path: text}) whose
    name the tests use, except builtins' names and their types' methods (`split`, `join`)."""
    defined: dict[str, list[tuple[str, str]]] = {}
    for rel, text in sorted(code.items()):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node, owner in definitions(tree):
            qual = f"{owner.name}.{node.name}" if owner is not None else node.name
            defined.setdefault(node.name, []).append((rel, qual))
    test_names = set().union(*(_names(t) for t in tests.values())) if tests else set()
    taken = test_names.union(*(_names(t) for t in code.values()))
    out = []
    for name, where in sorted(defined.items()):
        if len(where) != 1 or name.startswith("_") or len(name) < min_length or name not in test_names \
                or name in _BUILTIN_NAMES:
            continue
        new = new_name(name, rng, taken)
        if new is not None:
            out.append((where[0][0], where[0][1], new))
    rng.shuffle(out)
    return out


def _prompt(qualname: str, file: str, new: str) -> str:
    owner, _, name = qualname.rpartition(".")
    what = f"`{owner}.{name}`" if owner else f"`{name}`"
    return f"Rename {what} in `{file}` to `{new}` and update everything that uses it."


def build_renames(source: CodeSource, out_dir: Path, max_tasks: int = 4, seed: int = 0,
                  sandbox: SandboxConfig | None = None, progress: Callable[[str], None] | None = None,
                  min_pass_to_pass: int = 1, max_sites: int = 0) -> list[Path]:
    """Up to `max_tasks` rename tasks from `source` into `out_dir`; returns their folders (run
    `gates.validate` on each to prove them, as the default-benchmark builder does). `max_sites` > 0
    keeps only renames that change at most that many places in the code (`rename_sites`): a family
    of one or two edits each, where what decides a pass is executing them, not finding them."""
    rng = random.Random(f"{source.name}-rename-{seed}")
    say = progress or (lambda msg: None)
    sandbox = environment.sandbox_config(EnvironmentSpec(), sandbox)
    made: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="oc-rename-") as tmp:
        code, hidden = stage(source, Path(tmp) / "staged")
        code_text = {str(p.relative_to(code)): p.read_text() for p in sorted(code.rglob("*.py"))}
        test_text = {str(p.relative_to(hidden)): p.read_text(errors="replace") for p in sorted(hidden.rglob("*.py"))
                     if not str(p.relative_to(hidden)).startswith(".oc_verifier")}
        command = source.verifier_command()
        with Workspace(code, sandbox) as ws:
            passing, timeout = passing_tests(ws, hidden, command, source.name)
            for i, (file, qual, new) in enumerate(rename_candidates(code_text, test_text, rng)):
                if len(made) >= max_tasks:
                    break
                old = qual.rpartition(".")[2]
                if max_sites and rename_sites(code_text, old) > max_sites:
                    continue
                renamed_tests = Path(tmp) / f"hidden-{i}"
                shutil.copytree(hidden, renamed_tests)
                for rel, text in test_text.items():
                    (renamed_tests / rel).write_text(rename_identifier(text, old, new))
                solution = {rel: rename_identifier(t, old, new) for rel, t in code_text.items()}
                solution = {rel: t for rel, t in solution.items() if t != code_text[rel]}
                before = run_suite(ws, renamed_tests, command, timeout_s=timeout)
                after = run_suite(ws, renamed_tests, command, solution, timeout_s=timeout)
                f2p = tuple(sorted(t for t in passing if after.get(t) == "passed" and before.get(t) != "passed"))
                p2p = tuple(sorted(t for t in passing if after.get(t) == "passed" and before.get(t) == "passed"))
                broken = [t for t in passing if after.get(t) != "passed"]
                if not f2p or len(p2p) < min_pass_to_pass or broken:
                    log.debug("rename %s -> %s rejected: %d fail-to-pass, %d still failing", qual, new, len(f2p),
                              len(broken))
                    continue
                sol_dir = Path(tmp) / f"solution-{i}"
                shutil.copytree(code, sol_dir)
                for rel, text in solution.items():
                    (sol_dir / rel).write_text(text)
                made.append(write_task(source, out_dir, f"rename:{file}:{qual}:{new}", code=code, changes={},
                                       hidden=renamed_tests, solution=sol_dir, category="refactor",
                                       prompt=_prompt(qual, file, new), kind="rename", fail_to_pass=f2p,
                                       pass_to_pass=p2p, command=command, timeout_s=timeout))
                say(f"{source.name}: rename task {made[-1].name}")
    return made
