"""Shared fixtures. Sandbox tests use a private state folder so they never touch a user's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

# Triton kernels in the tests run under Triton's CPU interpreter. The switch must be set before
# anything imports triton: Triton's own helpers (tl.max, tl.cdiv, ...) are decorated at import, and
# an interpreted kernel cannot call a compiled helper. (test_triton_compile.py compiles in a child
# process without it.)
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_sessionstart(session):
    """Build the engine's decode-products kernel before any test's clock starts: its first build takes
    about a minute on a busy 2-core machine (later processes load the cached build in ~0.2 s),
    and would otherwise land inside whichever test first starts an engine."""
    try:
        from opencomposer.kernels import decode_products
    except ImportError:  # no torch: nothing builds it
        return
    decode_products.load()


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("oc-state")
    os.environ["OPENCOMPOSER_STATE"] = str(d)
    yield d


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A small real git repository with code and a test."""
    r = tmp_path / "repo"
    (r / "pkg").mkdir(parents=True)
    (r / "pkg" / "__init__.py").write_text("")
    (r / "pkg" / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (r / "test_calc.py").write_text("from pkg.calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (r / "README.md").write_text("calc\n")
    return git_init_commit(r, "init")


def git_init_commit(root: Path, message: str) -> Path:
    """`git init` + one commit of everything, with a fixed identity and date (reproducible hashes)."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    subprocess.run(["git", "init", "-q", str(root)], check=True, env=env)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True, env=env)
    subprocess.run(["git", "-C", str(root), "commit", "-qm", message], check=True, env=env)
    return root


@pytest.fixture
def workspace(repo):
    from opencomposer.sandbox.local import Workspace

    with Workspace(repo) as ws:
        yield ws


@pytest.fixture
def sandbox(workspace):
    with workspace.sandbox() as sb:
        yield sb


def make_buggy_repo(root: Path) -> Path:
    """A real git repository whose `add` is wrong and whose test says so (the harness fixture)."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "calc.py").write_text("def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n")
    (root / "test_calc.py").write_text(
        "from pkg.calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_mul():\n    assert mul(2, 3) == 6\n")
    (root / "AGENTS.md").write_text("Run the tests with `python -m pytest -q -p no:cacheprovider`.\n")
    return git_init_commit(root, "calc")


@pytest.fixture
def buggy_repo(tmp_path: Path) -> Path:
    return make_buggy_repo(tmp_path / "buggy")


def foreground_sigint() -> None:
    """`preexec_fn` for a child that a test will Ctrl-C: a shell starts background jobs with SIGINT
    ignored, the child inherits that, and Python then installs no KeyboardInterrupt handler, so the
    child would run on as if the key had never been pressed (seen when the suite ran under `&`).
    A terminal's Ctrl-C reaches a foreground process, whose SIGINT is the default."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
