"""Tasks from a codebase whose test suite passes: feature deletion and bug injection.

Feature deletion (the task is to re-implement): pick functions, methods or classes from the AST
whose names the tests use; delete them; keep the deletion only if the code still imports and the
rest of the suite still passes while some tests fail. Those become fail-to-pass, the rest that
passed stay pass-to-pass. Several deletions in different files of one package make a multi-file
task (the hard split).

Bug injection (the task is a bug fix): apply one small AST mutation (an operator, a comparison, a
boolean connective, an off-by-one) inside a function the tests cover, kept only if some tests now
fail. The prompt names the symptom, not the cause.

Every accepted candidate becomes a task folder that passes the integrity gates (tasks/gates.py).
"""

from __future__ import annotations

import ast
import hashlib
import logging
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.sandbox.base import SandboxConfig
from opencomposer.sandbox.local import Workspace
from opencomposer.tasks import environment, run_tests
from opencomposer.tasks.environment import EnvironmentSpec
from opencomposer.tasks.format import Task, TaskSpec, TaskStats, VerifierSpec
from opencomposer.tasks.grade import suite_outcomes
from opencomposer.tasks.patch import diff_dirs, init_single_commit_repo, patch_stats

log = logging.getLogger(__name__)
RUNNER = ".oc_verifier/run_tests.py"


@dataclass(frozen=True)
class CodeSource:
    """A codebase and its tests. `code` and `tests` map workspace-relative paths to host files."""

    name: str
    code: dict[str, Path]
    tests: dict[str, Path]
    test_modules: tuple[str, ...]
    """unittest names of the test modules (run by the verifier)."""
    version: str = ""
    command: str | None = None
    """Verifier command; default: our unittest runner over `test_modules` with a JUnit report."""

    def verifier_command(self) -> str:
        local = sorted({rel.split("/")[0].removesuffix(".py") for rel in self.code if rel.endswith(".py")})
        return self.command or f"python {RUNNER} --junit {{junit}} " + "".join(f"--local {m} " for m in local) \
            + " ".join(self.test_modules)


@dataclass
class Candidate:
    kind: str  # "delete" or "mutate"
    file: str
    qualname: str
    lines: tuple[int, int]
    new_text: str
    doc: str = ""
    mutation: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    extra: list["Candidate"] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# Staging and running


def stage(source: CodeSource, dest: Path) -> tuple[Path, Path]:
    """dest/code (the repository) and dest/hidden (tests + the verifier runner)."""
    code, hidden = dest / "code", dest / "hidden"
    for rel, src in source.code.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, code / rel)
    for rel, src in source.tests.items():
        (hidden / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, hidden / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, hidden / rel)
    (hidden / RUNNER).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_tests.__file__, hidden / RUNNER)
    return code, hidden


def run_suite(ws: Workspace, hidden: Path, command: str, changes: dict[str, str] | None = None,
              timeout_s: float = 600) -> dict[str, str]:
    """Outcomes of the suite on the workspace with `changes` ({path: new text}) applied."""
    with ws.sandbox() as sb:
        for rel, text in (changes or {}).items():
            sb.write_file(rel, text)
        return suite_outcomes(sb, hidden, command, timeout_s)


def passing_tests(ws: Workspace, hidden: Path, command: str, name: str) -> tuple[set[str], float]:
    """The tests that pass on the clean code, and the time a candidate's run gets: a mutation can
    loop forever, so a few times the clean suite's time."""
    t0 = time.perf_counter()
    baseline = run_suite(ws, hidden, command)
    timeout = max(30.0, 5 * (time.perf_counter() - t0))
    passing = {t for t, o in baseline.items() if o == "passed"}
    if not passing:
        raise RuntimeError(f"{name}: the test suite does not pass here ({len(baseline)} tests ran)")
    return passing, timeout


def imports_ok(ws: Workspace, module: str, changes: dict[str, str]) -> bool:
    with ws.sandbox() as sb:
        for rel, text in changes.items():
            sb.write_file(rel, text)
        return sb.exec(["python", "-c", f"import sys; sys.path.insert(0, '.'); import {module}"], timeout_s=60).ok


# ----------------------------------------------------------------------------------------------
# Candidates


def _module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def deletion_candidates(code_dir: Path, test_text: str, min_lines: int = 4) -> list[Candidate]:
    out = []
    for path in sorted(code_dir.rglob("*.py")):
        rel = str(path.relative_to(code_dir))
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        tree = ast.parse(text)
        for node, owner in definitions(tree):
            name = node.name
            if name.startswith("_") or not re.search(rf"\b{re.escape(name)}\b", test_text):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            end = node.end_lineno
            if end - start + 1 < min_lines:
                continue
            if owner is not None and len(owner.body) <= 1:
                continue  # deleting the only member would leave an empty class body
            new = "".join(lines[: start - 1] + lines[end:])
            doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
            qual = f"{owner.name}.{name}" if owner is not None else name
            out.append(Candidate("delete", rel, qual, (start, end), new, doc=doc[:200]))
    return out


def definitions(tree: ast.Module):
    """(node, owning class or None) for top-level functions and classes and their methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, None
        elif isinstance(node, ast.ClassDef):
            yield node, None
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, node


_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.Lt: ast.LtE, ast.LtE: ast.Lt,
          ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.And: ast.Or, ast.Or: ast.And,
          ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


def mutation_candidates(code_dir: Path, test_text: str, rng: random.Random, per_function: int = 1) -> list[Candidate]:
    """One small mutation per covered public function: an operator or comparison flipped, or an
    integer constant moved by one. The rest of the file is untouched byte for byte."""
    out = []
    for path in sorted(code_dir.rglob("*.py")):
        rel = str(path.relative_to(code_dir))
        text = path.read_text()
        lines = text.splitlines(keepends=True)
        for node, owner in definitions(ast.parse(text)):
            if isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            if not re.search(rf"\b{re.escape(node.name)}\b", test_text):
                continue
            sites = [n for n in ast.walk(node) if isinstance(n, (ast.BinOp, ast.Compare, ast.BoolOp))
                     or (isinstance(n, ast.Constant) and type(n.value) is int and n.value in (0, 1, 2))]
            rng.shuffle(sites)
            for site in sites[:per_function]:
                new_line = _mutate_line(lines, site)
                if new_line is None:
                    continue
                i = site.lineno - 1
                new = "".join(lines[:i] + [new_line] + lines[i + 1:])
                qual = f"{owner.name}.{node.name}" if owner is not None else node.name
                out.append(Candidate("mutate", rel, qual, (node.lineno, node.end_lineno), new,
                                     mutation=f"line {site.lineno}: {lines[i].strip()} -> {new_line.strip()}"))
    return out


def _mutate_line(lines: list[str], site: ast.AST) -> str | None:
    if site.lineno != site.end_lineno:
        return None
    line = lines[site.lineno - 1]
    seg = line[site.col_offset: site.end_col_offset]
    if isinstance(site, ast.Constant):
        new = str(site.value + 1) if site.value != 2 else "1"
        return line[: site.col_offset] + new + line[site.end_col_offset:]
    node = ast.parse(seg, mode="eval").body if seg else None
    if node is None:
        return None
    for sub in ast.walk(node):
        for attr in ("op",):
            op = getattr(sub, attr, None)
            if op is not None and type(op) in _SWAPS:
                setattr(sub, attr, _SWAPS[type(op)]())
                return line[: site.col_offset] + ast.unparse(node) + line[site.end_col_offset:]
        if isinstance(sub, ast.Compare) and type(sub.ops[0]) in _SWAPS:
            sub.ops[0] = _SWAPS[type(sub.ops[0])]()
            return line[: site.col_offset] + ast.unparse(node) + line[site.end_col_offset:]
    return None


# ----------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True, kw_only=True, slots=True)
class BuildConfig:
    max_single: int = 20
    """Single-file tasks (deletions and mutations) per source at most."""
    max_multi: int = 4
    """Multi-file tasks per source at most (needs candidates in >= `multi_files` files)."""
    multi_files: int = 3
    mutations: bool = True
    renames: int = 0
    """Rename tasks per source at most (`builders/rename.py`; the default benchmark builds them)."""
    rename_sites: int = 0
    """Renames that change more places in the code than this are skipped (0: no limit)."""
    seed: int = 0
    min_pass_to_pass: int = 1


def build_tasks(source: CodeSource, out_dir: Path, cfg: BuildConfig = BuildConfig(),
                sandbox: SandboxConfig | None = None, progress: Callable[[str], None] | None = None) -> list[Path]:
    """Build validated-by-construction task folders from `source` into `out_dir`; returns their paths.
    (Run `gates.validate` on each to prove it; the default-benchmark builder does.)"""
    rng = random.Random(f"{source.name}-{cfg.seed}")
    say = progress or (lambda msg: None)
    # Measured in the environment the tasks will be graded in (the default one: tasks/environment.py).
    sandbox = environment.sandbox_config(EnvironmentSpec(), sandbox)
    made: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="oc-build-") as tmp:
        code, hidden = stage(source, Path(tmp))
        test_text = "\n".join(p.read_text(errors="replace") for p in hidden.rglob("*.py"))
        command = source.verifier_command()
        with Workspace(code, sandbox) as ws:
            passing, timeout = passing_tests(ws, hidden, command, source.name)
            say(f"{source.name}: {len(passing)} passing tests")
            cands = deletion_candidates(code, test_text)
            if cfg.mutations:
                cands += mutation_candidates(code, test_text, rng)
            rng.shuffle(cands)
            accepted: list[Candidate] = []
            for c in cands:
                if sum(1 for a in accepted if a.kind == c.kind) >= cfg.max_single // (2 if cfg.mutations else 1):
                    continue
                if not _evaluate(ws, hidden, command, c, passing, code, cfg, timeout):
                    continue
                accepted.append(c)
                made.append(_write_task(source, out_dir, code, hidden, [c], command, timeout))
                say(f"{source.name}: task {made[-1].name}")
            if cfg.max_multi > 0:
                deletions = _per_file_deletions(ws, hidden, command, cands, accepted, passing, code, cfg, timeout)
                for group in _groups(deletions, cfg, rng):
                    combo = _combine(code, group)
                    if _evaluate(ws, hidden, command, combo, passing, code, cfg, timeout):
                        made.append(_write_task(source, out_dir, code, hidden, group, command, timeout, combo=combo))
                        say(f"{source.name}: multi-file task {made[-1].name}")
    return made


def _evaluate(ws, hidden, command, c: Candidate, passing: set[str], code: Path, cfg: BuildConfig,
              timeout_s: float) -> bool:
    changes = {c.file: c.new_text, **{e.file: e.new_text for e in c.extra}}
    top = _module_name(c.file).split(".")[0]
    if not imports_ok(ws, top, changes):
        return False  # the rest must still import
    after = run_suite(ws, hidden, command, changes, timeout_s=timeout_s)
    f2p = tuple(sorted(t for t in passing if after.get(t) != "passed"))
    p2p = tuple(sorted(t for t in passing if after.get(t) == "passed"))
    if not f2p or len(p2p) < cfg.min_pass_to_pass:
        return False
    c.fail_to_pass, c.pass_to_pass = f2p, p2p
    return True


def _per_file_deletions(ws, hidden, command, cands, accepted, passing, code, cfg, timeout,
                        tries_per_file: int = 6) -> list[Candidate]:
    """Valid deletions spread over as many files as possible: the single-file tasks' own, plus, for
    files that have none yet, the first few candidates there that pass `_evaluate`."""
    found = [c for c in accepted if c.kind == "delete"]
    have = {c.file for c in found}
    tried: dict[str, int] = {}
    for c in cands:
        if c.kind != "delete" or c.file in have or c in accepted or tried.get(c.file, 0) >= tries_per_file:
            continue
        tried[c.file] = tried.get(c.file, 0) + 1
        if _evaluate(ws, hidden, command, c, passing, code, cfg, timeout):
            found.append(c)
            have.add(c.file)
    return found


def _groups(deletions: list[Candidate], cfg: BuildConfig, rng: random.Random) -> list[list[Candidate]]:
    by_file: dict[str, list[Candidate]] = {}
    for c in deletions:
        by_file.setdefault(c.file, []).append(c)
    if len(by_file) < cfg.multi_files:
        return []
    groups = []
    for _ in range(cfg.max_multi * 3):
        files = rng.sample(sorted(by_file), cfg.multi_files)
        group = [rng.choice(by_file[f]) for f in files]
        key = sorted(c.qualname for c in group)
        if key not in [sorted(c.qualname for c in g) for g in groups]:
            groups.append(group)
        if len(groups) >= cfg.max_multi:
            break
    return groups


def _combine(code: Path, group: list[Candidate]) -> Candidate:
    head, *rest = group
    return Candidate("delete", head.file, head.qualname, head.lines, head.new_text, doc=head.doc,
                     extra=[Candidate(c.kind, c.file, c.qualname, c.lines, c.new_text, doc=c.doc) for c in rest])


def _prompt(source: CodeSource, group: list[Candidate], c: Candidate) -> tuple[str, str]:
    pkg = source.name
    if c.kind == "mutate":
        failing = sorted({t.split("::")[-1] for t in c.fail_to_pass})[:2]
        verb = "fails" if len(failing) == 1 else "fail"
        return "bug_fix", (f"`{c.qualname}` in `{c.file}` gives wrong results (`{'`, `'.join(failing)}` {verb}). "
                           "Find the bug and fix it.")
    if len(group) == 1:
        what = f" ({c.doc.rstrip('.')})" if c.doc else ""
        return "feature", f"`{c.qualname}`{what} is missing from `{c.file}`. Implement it to match the rest of {pkg}."
    names = ", ".join(f"`{g.qualname}` ({g.file})" for g in group)
    return "multi_file_feature", f"Several pieces of {pkg} were removed: {names}. Restore them so {pkg} works again."


def _write_task(source: CodeSource, out_dir: Path, code: Path, hidden: Path, group: list[Candidate],
                command: str, timeout_s: float, combo: Candidate | None = None) -> Path:
    c = combo or group[0]
    changes = {c.file: c.new_text, **{e.file: e.new_text for e in c.extra}}
    key = "|".join(sorted(f"{g.kind}:{g.file}:{g.qualname}:{g.mutation}" for g in group))
    category, prompt = _prompt(source, group, c)
    return write_task(source, out_dir, key, code=code, changes=changes, hidden=hidden, solution=code,
                      category=category, prompt=prompt, kind=c.kind, fail_to_pass=c.fail_to_pass,
                      pass_to_pass=c.pass_to_pass, command=command, timeout_s=timeout_s)


def write_task(source: CodeSource, out_dir: Path, key: str, *, code: Path, changes: dict[str, str], hidden: Path,
               solution: Path, category: str, prompt: str, kind: str, fail_to_pass: tuple[str, ...],
               pass_to_pass: tuple[str, ...], command: str, timeout_s: float) -> Path:
    """A task folder: `repo/` is `code` with `changes` applied (one commit), `hidden/` the tests,
    `reference.patch` the change from the repo to `solution`."""
    # Neutral: the id shows in mount paths inside the sandbox, so it names no builder or mutation.
    tid = f"{source.name}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    root = out_dir / tid
    if root.exists():
        shutil.rmtree(root)
    repo = root / "repo"
    shutil.copytree(code, repo)
    for rel, text in changes.items():
        (repo / rel).write_text(text)
    base = init_single_commit_repo(repo, f"{source.name} {source.version}".strip())
    shutil.copytree(hidden, root / "hidden")
    patch = diff_dirs(repo, solution)
    (root / "reference.patch").write_text(patch)
    (root / "prompt.md").write_text(prompt + "\n")
    files, lines = patch_stats(patch)
    spec = TaskSpec(id=tid, category=category, source=f"{source.name}@{source.version}", base_revision=base,
                    tags=(source.name, kind), verifier=VerifierSpec(command=command, fail_to_pass=fail_to_pass,
                                                                    pass_to_pass=pass_to_pass,
                                                                    timeout_s=round(2 * timeout_s)),
                    stats=TaskStats(prompt_chars=len(prompt), files_changed=files, lines_changed=lines))
    Task.write_spec(root, spec)
    return root
