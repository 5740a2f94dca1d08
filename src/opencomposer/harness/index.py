"""The codebase index behind `codebase_search`: BM25 over overlapping line windows of every file.

Composer serves semantic search from outside the environment (report §5); so does this index: it
is built on the host from the workspace's base directory (never from inside the sandbox) and kept
current with the agent's own edits, which the file tools report to it. BM25 over identifier-aware
tokens (`parseHTTPRequest` -> parse, http, request, parsehttprequest) is a strong lexical baseline
for code retrieval; an embedding model can replace `score` behind the same interface.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d+")
_CAMEL = re.compile(r"[A-Z]+(?=[A-Z][a-z]|\d|\b)|[A-Z]?[a-z]+|[A-Z]+|\d+")
SKIP_DIRS = {".git", "node_modules", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".tox",
             "build", "dist", ".ruff_cache"}


def tokenize(text: str) -> list[str]:
    out = []
    for word in _WORD.findall(text):
        low = word.lower()
        out.append(low)
        parts = [p.lower() for piece in word.split("_") for p in _CAMEL.findall(piece)]
        if len(parts) > 1:
            out += parts
    return out


@dataclass(frozen=True, slots=True)
class Hit:
    path: str
    start: int
    end: int
    score: float
    text: str


class CodeIndex:
    def __init__(self, *, window: int = 40, stride: int = 30, max_file_bytes: int = 512 << 10,
                 k1: float = 1.2, b: float = 0.75, workdir: str = "/workspace"):
        self.workdir = workdir.rstrip("/")
        self.window, self.stride, self.max_file_bytes = window, stride, max_file_bytes
        self.k1, self.b = k1, b
        self._docs: dict[int, tuple[str, int, int, str, int]] = {}  # id -> (path, start, end, text, length)
        self._by_path: dict[str, list[int]] = defaultdict(list)
        self._postings: dict[str, dict[int, int]] = defaultdict(dict)
        self._next = 0
        self._total_len = 0
        self._lock = threading.Lock()

    @classmethod
    def build(cls, root: str | Path, **kw) -> "CodeIndex":
        idx = cls(**kw)
        root = Path(root)
        for rel in _list_files(root):
            p = root / rel
            try:
                if p.stat().st_size > idx.max_file_bytes:
                    continue
                data = p.read_bytes()
            except OSError:
                continue
            if b"\x00" in data[:8192]:
                continue
            idx.update(rel, data.decode("utf-8", "replace"))
        return idx

    def __len__(self) -> int:
        return len(self._docs)

    def norm(self, path: str) -> str:
        """Workspace-relative form of a path as tools give it (relative, or absolute in workdir)."""
        p = os.path.normpath(path)
        if p.startswith(self.workdir + "/"):
            p = p[len(self.workdir) + 1:]
        return p

    def update(self, path: str, text: str) -> None:
        path = self.norm(path)
        with self._lock:
            self._remove(path)
            lines = text.splitlines()
            starts = range(0, max(1, len(lines) - self.window + self.stride), self.stride) if lines else []
            for s in starts:
                chunk = lines[s: s + self.window]
                if not chunk:
                    continue
                body = "\n".join(chunk)
                toks = tokenize(path) + tokenize(body)
                doc = self._next
                self._next += 1
                self._docs[doc] = (path, s + 1, s + len(chunk), body, len(toks))
                self._total_len += len(toks)
                self._by_path[path].append(doc)
                for term, tf in Counter(toks).items():
                    self._postings[term][doc] = tf

    def remove(self, path: str) -> None:
        with self._lock:
            self._remove(self.norm(path))

    def _remove(self, path: str) -> None:
        for doc in self._by_path.pop(path, []):
            _, _, _, _, n = self._docs.pop(doc)
            self._total_len -= n
        # Postings of removed docs are skipped lazily in search (cheaper than rewriting them here).

    def search(self, query: str, *, dirs: list[str] | None = None, k: int = 10) -> list[Hit]:
        terms = set(tokenize(query))
        with self._lock:
            n = len(self._docs) or 1
            avg = self._total_len / n if self._docs else 1.0
            scores: dict[int, float] = defaultdict(float)
            for term in terms:
                post = {d: tf for d, tf in self._postings.get(term, {}).items() if d in self._docs}
                if not post:
                    continue
                idf = math.log(1 + (n - len(post) + 0.5) / (len(post) + 0.5))
                for doc, tf in post.items():
                    length = self._docs[doc][4]
                    scores[doc] += idf * tf * (self.k1 + 1) / (tf + self.k1 * (1 - self.b + self.b * length / avg))
            prefixes = [self.norm(d) for d in dirs or [] if self.norm(d) != "."]
            ranked = sorted(scores.items(), key=lambda kv: -kv[1])
            hits: list[Hit] = []
            for doc, score in ranked:
                path, start, end, text, _ = self._docs[doc]
                if prefixes and not any(path == p or path.startswith(p + "/") for p in prefixes):
                    continue
                hits.append(Hit(path, start, end, score, text))
                if len(hits) >= k:
                    break
            return hits


def _list_files(root: Path) -> list[str]:
    if (root / ".git").exists():
        r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, timeout=120)
        if r.returncode == 0:
            return [os.fsdecode(p) for p in r.stdout.split(b"\0") if p]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")]
        for f in filenames:
            out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return out
