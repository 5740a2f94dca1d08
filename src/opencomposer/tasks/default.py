"""`opencomposer tasks build-default`: the bundled benchmark, built on first use from code every
fresh machine can obtain without a model or data hub — this Python's standard library with its own
test suite, and source distributions of pure-Python packages fetched with pip at pinned versions
(their tests included). Nothing third-party is committed to this repository; the tasks are
generated, validated by every integrity gate, and written under a data folder.

Splits: `smoke` (a few fast tasks, used by CI for oracle/noop calibration), `train` and
`held_out` (single-file tasks, split by a hash of the id), `hard` (multi-file tasks: their reference
changes touch at least three files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import statistics
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opencomposer.tasks import gates
from opencomposer.tasks.builders.deletion import BuildConfig, CodeSource, build_tasks
from opencomposer.tasks.builders.rename import build_renames
from opencomposer.tasks.format import Manifest, Task

log = logging.getLogger(__name__)
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _module(name: str, test: str | None = None) -> CodeSource:
    test = test or f"test_{name}"
    return CodeSource(name=name, code={f"{name}.py": STDLIB / f"{name}.py"},
                      tests={f"{test}.py": STDLIB / "test" / f"{test}.py"}, test_modules=(test,),
                      version=platform.python_version())


def _package(name: str, test_dir: str, modules: list[str], files: tuple[str, ...] | None = None) -> CodeSource:
    pkg = STDLIB / name
    names = files or tuple(sorted(p.name for p in pkg.glob("*.py")))
    return CodeSource(name=name, code={f"{name}/{f}": pkg / f for f in names},
                      tests={test_dir: STDLIB / "test" / test_dir}, test_modules=tuple(modules),
                      version=platform.python_version())


def stdlib_sources() -> dict[str, CodeSource]:
    """Pure-Python standard-library code with its own tests (chosen so each suite runs in seconds)."""
    json_tests = [f"test_json.{p.stem}" for p in sorted((STDLIB / "test" / "test_json").glob("test_*.py"))
                  if p.stem != "test_tool"]
    toml_tests = [f"test_tomllib.{p.stem}" for p in sorted((STDLIB / "test" / "test_tomllib").glob("test_*.py"))]
    srcs = [
        _module("colorsys"), _module("textwrap"), _module("shlex"), _module("fractions"), _module("graphlib"),
        _module("calendar"), _module("configparser"), _module("base64"), _module("sched"), _module("netrc"),
        _module("statistics"), _module("glob"), _module("reprlib"),
        _package("json", "test_json", json_tests, ("__init__.py", "decoder.py", "encoder.py", "scanner.py")),
        _package("tomllib", "test_tomllib", toml_tests),
        CodeSource(name="html", code={"html/__init__.py": STDLIB / "html" / "__init__.py",
                                      "html/parser.py": STDLIB / "html" / "parser.py",
                                      "html/entities.py": STDLIB / "html" / "entities.py"},
                   tests={"test_html.py": STDLIB / "test" / "test_html.py",
                          "test_htmlparser.py": STDLIB / "test" / "test_htmlparser.py"},
                   test_modules=("test_html", "test_htmlparser"), version=platform.python_version()),
    ]
    return {s.name: s for s in srcs if all(p.exists() for p in (*s.code.values(), *s.tests.values()))}


# Pure-Python packages whose source distributions ship their tests, at pinned versions: fetched
# from PyPI with pip on first use (nothing third-party is committed here).
PYPI_PACKAGES = {
    # name: (version, package folder, tests folder, verifier command or None for our unittest runner)
    "more-itertools": ("10.5.0", "more_itertools", "tests", None),
    "toolz": ("0.12.1", "toolz", "toolz/tests",
              "python -m pytest -p no:cacheprovider -o addopts= -q --junitxml={junit} toolz/tests"),
}


def pypi_source(name: str, cache: Path) -> CodeSource:
    """Download (once) and unpack the pinned sdist of `name`; raise RuntimeError if pip cannot."""
    import subprocess
    import sys
    import tarfile

    version, pkg, tests, command = PYPI_PACKAGES[name]
    root = cache / f"{name}-{version}"
    if not root.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
                            "--disable-pip-version-check", f"{name}=={version}", "-d", str(cache)],
                           capture_output=True, text=True, timeout=600)
        archive = next(cache.glob(f"{name.replace('-', '?')}-{version}.tar.gz"), None)
        if r.returncode != 0 or archive is None:
            raise RuntimeError(f"pip could not fetch {name}=={version}: {r.stderr.strip()[-300:]}")
        with tarfile.open(archive) as tf:
            tf.extractall(cache, filter="data")
        unpacked = next(p for p in cache.iterdir() if p.is_dir() and p.name.lower().replace("_", "-") == root.name)
        if unpacked != root:
            unpacked.rename(root)
    code = {str(p.relative_to(root)): p for p in (root / pkg).rglob("*")
            if p.is_file() and not str(p.relative_to(root)).startswith(tests + "/") and "__pycache__" not in p.parts}
    test_dir = root / tests
    modules = tuple(sorted(str(p.relative_to(root))[:-3].replace("/", ".") for p in test_dir.glob("test_*.py")))
    return CodeSource(name=name.replace("-", "_"), code=code, tests={tests: test_dir}, test_modules=modules,
                      version=version, command=command)


SMOKE_SOURCES = ("colorsys",)


@dataclass(frozen=True, kw_only=True, slots=True)
class DefaultBenchmarkConfig:
    sources: tuple[str, ...] = ()
    """Names from stdlib_sources(); empty means all."""
    build: BuildConfig = BuildConfig()
    held_out_fraction: float = 0.3
    sdist_cache: Path | None = None
    """Where PyPI source distributions are kept (default: .sdists beside <out>, outside the swap)."""
    workers: int = 0
    """Sources built at once (each source's candidates and gates stay in order); 0: one per CPU.
    Not part of the fingerprint: every source is built from its own seed, so the tasks do not
    depend on it."""


def fingerprint(cfg: DefaultBenchmarkConfig) -> str:
    """What a built dataset depends on: the build config, this interpreter (whose stdlib and tests
    are the code), the pinned sdists and the builder's own code."""
    from opencomposer.core.config import to_dict
    from opencomposer.tasks import environment, run_tests
    from opencomposer.tasks.builders import deletion, rename

    code = "".join(Path(m.__file__).read_text() for m in (deletion, rename, run_tests, environment))
    config = to_dict(dataclasses.replace(cfg, sdist_cache=None))
    config.pop("workers")  # how many at once does not change what is built
    blob = json.dumps({"config": config, "python": platform.python_version(),
                       "stdlib": str(STDLIB), "pypi": PYPI_PACKAGES, "code": hashlib.sha256(code.encode()).hexdigest()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def build_default(out: Path, cfg: DefaultBenchmarkConfig = DefaultBenchmarkConfig(),
                  progress: Callable[[str], None] | None = None) -> Manifest:
    """Build, validate (every gate) and index the benchmark in `out`. Rejected tasks are removed and
    their reasons recorded in the manifest.

    Built in a staging folder beside `out` and swapped in whole when complete, so an interrupted
    build leaves the last good dataset (or none), never a truncated one; a complete dataset built
    from the same inputs (`fingerprint`) is reused as it is."""
    say = progress or (lambda m: log.info(m))
    out = Path(out)
    key = fingerprint(cfg)
    existing = out / "manifest.json"
    if existing.is_file():
        try:
            m = json.loads(existing.read_text())
        except ValueError:
            m = {}
        if m.get("extra", {}).get("fingerprint") == key and m.get("extra", {}).get("complete"):
            say(f"reusing the complete dataset in {out} (built from the same inputs)")
            return Manifest(name=m["name"], version=m.get("version", "1"), tasks=m["tasks"], extra=m["extra"])
    sources: dict[str, CodeSource | str] = {**stdlib_sources(), **{k: "pypi" for k in PYPI_PACKAGES}}
    names = cfg.sources or tuple(sources)
    unknown = sorted(set(names) - set(sources))
    if unknown:
        raise ValueError(f"unknown sources {unknown}; known: {sorted(sources)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = out.parent / f".{out.name}.building-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        manifest = _build(stage, names, sources, cfg, say)
        manifest.extra.update(fingerprint=key, complete=True)
        manifest.save(stage)
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            os.replace(out, old)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return manifest


def _build_source(out: Path, name: str, sources, cfg: DefaultBenchmarkConfig, say):
    """One source's tasks, proven by the gates: (kept, rejected) or the reason it was skipped."""
    try:
        src = sources[name]
        if src == "pypi":
            src = pypi_source(name, cfg.sdist_cache or out.parent / ".sdists")
        paths = build_tasks(src, out, cfg.build, progress=say) if cfg.build.max_single or cfg.build.max_multi \
            else []
        if cfg.build.renames:
            paths += build_renames(src, out, cfg.build.renames, seed=cfg.build.seed, progress=say,
                                   min_pass_to_pass=cfg.build.min_pass_to_pass, max_sites=cfg.build.rename_sites)
    except RuntimeError as e:
        return str(e)
    return gates.keep_valid(paths)


def _build(out: Path, names, sources, cfg: DefaultBenchmarkConfig, say) -> Manifest:
    from concurrent.futures import ThreadPoolExecutor

    manifest = Manifest(name="opencomposer-default", extra={"python": platform.python_version(), "rejected": []})
    # Sources are independent (own seed, own task folders), so they are built side by side; the
    # manifest is assembled in source order whatever finishes first.
    workers = max(1, min(cfg.workers or os.cpu_count() or 1, len(names)))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="build")
    try:
        results = list(pool.map(lambda n: _build_source(out, n, sources, cfg, say), names))
    finally:  # on Ctrl-C or an error, sources not started yet are not built; the running ones finish
        pool.shutdown(wait=True, cancel_futures=True)
    for name, result in zip(names, results, strict=True):
        if isinstance(result, str):
            manifest.extra["rejected"].append({"source": name, "reason": result})
            say(f"skipped {name}: {result}")
            continue
        kept, rejected = result
        for p, failed in rejected:
            manifest.extra["rejected"].append({"task": p.name, "gates": {g.name: g.detail for g in failed}})
            say(f"rejected {p.name}: {', '.join(g.name for g in failed)}")
        for p in kept:
            task = Task.load(p)
            manifest.tasks.append({"id": task.id, "split": _split(task, name, cfg), "category": task.spec.category,
                                   "stats": {"prompt_chars": task.spec.stats.prompt_chars,
                                             "files_changed": task.spec.stats.files_changed,
                                             "lines_changed": task.spec.stats.lines_changed}})
            say(f"accepted {task.id}")
    manifest.extra["split_stats"] = split_stats(manifest)
    return manifest


def _split(task: Task, source: str, cfg: DefaultBenchmarkConfig) -> str:
    if task.spec.stats.files_changed >= 3:
        return "hard"
    if source in SMOKE_SOURCES and task.spec.category == "feature":
        return "smoke"
    h = int(hashlib.sha1(task.id.encode()).hexdigest(), 16) % 1000 / 1000
    return "held_out" if h < cfg.held_out_fraction else "train"


def split_stats(manifest: Manifest) -> dict:
    """CursorBench-style statistics per split (report §7): prompt characters, files and lines changed."""
    out = {}
    for split, ids in manifest.splits().items():
        rows = [t["stats"] for t in manifest.tasks if t["id"] in ids]
        out[split] = {"tasks": len(rows),
                      "median_prompt_chars": statistics.median(r["prompt_chars"] for r in rows),
                      "median_files_changed": statistics.median(r["files_changed"] for r in rows),
                      "median_lines_changed": statistics.median(r["lines_changed"] for r in rows),
                      "categories": sorted({t["category"] for t in manifest.tasks if t["id"] in ids})}
    return out
