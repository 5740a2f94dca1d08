"""Data mixes for continued pretraining (report §2: a code-dominated mix).

A mix is a list of sources — folders and globs of code (the Python standard library and
site-packages are on every machine), git repositories (the files tracked at HEAD), and plain text
or JSONL files — each with a weight, a language filter and size filters. Building a mix:

1. collects documents, skipping binary and out-of-range files (counted, never silently);
2. removes exact duplicates (content hash) and near duplicates (MinHash over word 5-grams with
   locality-sensitive banding; Jaccard threshold 0.8 by default);
3. splits documents into train and held-out by a stable hash of (source, path);
4. tokenises every document (with an end-of-text token after it) into one memory-mapped uint32
   token file per split and source, plus the document start offsets.

`PackedSampler` then draws fixed-length sequences: each sequence's source is drawn by weight from
an RNG keyed by (seed, sequence index), and its tokens are the next window of that source's stream
(wrapping around: epochs). Documents are packed back to back with no padding; the segment ids it
returns mark document boundaries so attention and loss stay within a document. The sampler's
state is the per-source cursors and the sequence index, which a checkpoint stores: resuming
reproduces the uninterrupted stream exactly.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opencomposer.core.errors import UserError

LANGUAGES = {".py": "python", ".pyi": "python", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp",
             ".rs": "rust", ".go": "go", ".js": "javascript", ".ts": "typescript", ".java": "java", ".rb": "ruby",
             ".sh": "shell", ".md": "markdown", ".rst": "text", ".txt": "text", ".toml": "toml", ".json": "json",
             ".yaml": "yaml", ".yml": "yaml"}


class DataError(ValueError, UserError):
    pass


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceConfig:
    name: str
    kind: str = "files"
    """files (a folder + globs), git (tracked files at HEAD), text (a .txt or .jsonl file with "text")."""
    path: str = ""
    """A folder, repository or file; `stdlib` and `site-packages` name this Python's own."""
    include: tuple[str, ...] = ("**/*.py",)
    exclude: tuple[str, ...] = ("**/test/data/**", "**/__pycache__/**")
    languages: tuple[str, ...] = ()
    """Keep only these languages (by extension); empty keeps all."""
    weight: float = 1.0
    min_bytes: int = 64
    max_bytes: int = 400_000
    max_docs: int = 0
    """Cap on documents (0: none), taken in sorted path order for reproducibility."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MixConfig:
    sources: tuple[SourceConfig, ...] = ()
    heldout_fraction: float = 0.02
    near_dup_threshold: float = 0.8
    """Jaccard similarity above which a document is a near duplicate (0 disables)."""
    seed: int = 0


@dataclass
class Document:
    source: str
    path: str
    text: str


@dataclass
class BuildReport:
    documents: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)
    tokens: dict[str, dict[str, int]] = field(default_factory=dict)


def resolve_path(path: str) -> Path:
    import site
    import sysconfig

    if path == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    if path == "site-packages":
        return Path(site.getsitepackages()[0])
    return Path(path).expanduser()


def _matches(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p.removeprefix("**/")) for p in patterns)


def _candidates(src: SourceConfig) -> Iterator[tuple[str, bytes]]:
    root = resolve_path(src.path)
    if src.kind == "files":
        if not root.is_dir():
            raise DataError(f"source {src.name!r}: {root} is not a folder")
        files = sorted({p for pat in src.include for p in root.glob(pat) if p.is_file()})
        for p in files:
            rel = p.relative_to(root).as_posix()
            if not _matches(rel, src.exclude):
                try:
                    yield rel, p.read_bytes()
                except OSError:
                    continue
    elif src.kind == "git":
        try:
            out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True,
                                 timeout=60).stdout
        except (subprocess.CalledProcessError, FileNotFoundError, subprocess.TimeoutExpired) as e:
            raise DataError(f"source {src.name!r}: {root} is not a git repository ({e})") from None
        for rel in sorted(x for x in out.decode().split("\0") if x):
            if _matches(rel, src.include) and not _matches(rel, src.exclude):
                blob = subprocess.run(["git", "-C", str(root), "show", f"HEAD:{rel}"], capture_output=True,
                                      timeout=60)
                if blob.returncode == 0:
                    yield rel, blob.stdout
    elif src.kind == "text":
        if not root.is_file():
            raise DataError(f"source {src.name!r}: {root} is not a file")
        if root.suffix == ".jsonl":
            for i, line in enumerate(root.read_text(errors="replace").splitlines()):
                try:
                    yield f"{root.name}:{i}", json.loads(line)["text"].encode()
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
        else:
            yield root.name, root.read_bytes()
    else:
        raise DataError(f"source {src.name!r}: unknown kind {src.kind!r} (files, git, text)")


def documents(src: SourceConfig, skipped: dict[str, int]) -> list[Document]:
    docs = []
    for rel, raw in _candidates(src):
        lang = LANGUAGES.get(Path(rel).suffix, "text" if src.kind == "text" else "other")
        if src.languages and lang not in src.languages:
            skipped["language"] = skipped.get("language", 0) + 1
            continue
        if not src.min_bytes <= len(raw) <= src.max_bytes:
            skipped["size"] = skipped.get("size", 0) + 1
            continue
        if b"\0" in raw[:8192]:
            skipped["binary"] = skipped.get("binary", 0) + 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["binary"] = skipped.get("binary", 0) + 1
            continue
        docs.append(Document(src.name, rel, text))
        if src.max_docs and len(docs) >= src.max_docs:
            break
    return docs


# -- deduplication ----------------------------------------------------------------------------------

_WORD = re.compile(r"\w+")
_PRIME = (1 << 61) - 1


class NearDup:
    """MinHash (64 permutations) over word 5-grams with 16 bands of 4 rows: a document is a near
    duplicate when a band collides with an earlier document and their estimated Jaccard
    similarity is at least the threshold."""

    def __init__(self, threshold: float, perms: int = 64, bands: int = 16, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.a = rng.integers(1, _PRIME, perms, dtype=np.uint64)
        self.b = rng.integers(0, _PRIME, perms, dtype=np.uint64)
        self.threshold, self.bands, self.rows = threshold, bands, perms // bands
        self.buckets: dict[tuple, list[int]] = {}
        self.signatures: list[np.ndarray] = []

    def signature(self, text: str) -> np.ndarray | None:
        words = _WORD.findall(text)
        if len(words) < 5:
            return None
        grams = {hash(" ".join(words[i:i + 5])) & 0xFFFFFFFF for i in range(len(words) - 4)}
        x = np.fromiter(grams, dtype=np.uint64, count=len(grams))
        # (a*x + b) mod p with 32-bit x and a < 2^61 overflows uint64; fold a to 32 bits instead
        h = ((self.a[:, None] & 0xFFFFFFFF) * x[None, :] + self.b[:, None]) % _PRIME
        return h.min(axis=1)

    def seen(self, text: str) -> bool:
        sig = self.signature(text)
        if sig is None:
            return False
        for band in range(self.bands):
            key = (band, sig[band * self.rows:(band + 1) * self.rows].tobytes())
            for other in self.buckets.get(key, ()):
                if float((self.signatures[other] == sig).mean()) >= self.threshold:
                    return True
        idx = len(self.signatures)
        self.signatures.append(sig)
        for band in range(self.bands):
            self.buckets.setdefault((band, sig[band * self.rows:(band + 1) * self.rows].tobytes()), []).append(idx)
        return False


def is_heldout(doc: Document, fraction: float, seed: int) -> bool:
    h = hashlib.sha256(f"{seed}:{doc.source}:{doc.path}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def check_weights(mix: MixConfig) -> None:
    if not mix.sources:
        raise DataError("the mix has no sources")
    names = [s.name for s in mix.sources]
    if len(set(names)) != len(names):
        raise DataError(f"source names must be unique: {names}")
    if any(s.weight < 0 for s in mix.sources):
        raise DataError("source weights must be >= 0")
    total = sum(s.weight for s in mix.sources)
    if abs(total - 1.0) > 1e-6:
        raise DataError(f"source weights add up to {total:g}, not 1 ({', '.join(f'{s.name}={s.weight:g}' for s in mix.sources)})")


def build(mix: MixConfig, tokenizer, out: str | Path, *, progress=None) -> BuildReport:
    """Build the mix into `out` (refuses a non-empty folder that is not a previous build)."""
    check_weights(mix)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "mix.json").exists():
        raise DataError(f"{out} exists and is not a dataset folder; refusing to overwrite it")
    eot = tokenizer.token_id("<|endoftext|>")
    if eot is None:
        eot = tokenizer.eos_id
    report = BuildReport()
    exact: set[bytes] = set()
    near = NearDup(mix.near_dup_threshold, seed=mix.seed) if mix.near_dup_threshold > 0 else None
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    for split in ("train", "heldout"):
        (tmp / split).mkdir(parents=True)
    for src in mix.sources:
        skipped: dict[str, int] = {}
        docs = documents(src, skipped)
        kept = {"train": [], "heldout": []}
        for d in docs:
            digest = hashlib.sha256(d.text.encode()).digest()
            if digest in exact:
                skipped["exact_duplicate"] = skipped.get("exact_duplicate", 0) + 1
                continue
            exact.add(digest)
            if near is not None and near.seen(d.text):
                skipped["near_duplicate"] = skipped.get("near_duplicate", 0) + 1
                continue
            kept["heldout" if is_heldout(d, mix.heldout_fraction, mix.seed) else "train"].append(d)
        if not kept["train"]:
            raise DataError(f"source {src.name!r} ({resolve_path(src.path)}) has no usable documents "
                            f"(skipped: {skipped or 'none found'})")
        report.documents[src.name] = len(kept["train"]) + len(kept["heldout"])
        report.skipped[src.name] = skipped
        report.tokens[src.name] = {}
        for split, ds in kept.items():
            ids: list[np.ndarray] = []
            starts, pos = [], 0
            paths = []
            for d in ds:
                t = np.asarray(tokenizer.encode(d.text) + [eot], dtype=np.uint32)
                starts.append(pos)
                pos += len(t)
                ids.append(t)
                paths.append(d.path)
                if progress:
                    progress(src.name, len(t))
            arr = np.concatenate(ids) if ids else np.zeros(0, np.uint32)
            arr.tofile(tmp / split / f"{src.name}.bin")
            np.asarray(starts, dtype=np.int64).tofile(tmp / split / f"{src.name}.idx")
            (tmp / split / f"{src.name}.paths").write_text("\n".join(paths) + ("\n" if paths else ""))
            report.tokens[src.name][split] = int(arr.size)
    meta = {"sources": {s.name: {"weight": s.weight, "path": str(resolve_path(s.path)), "kind": s.kind}
                        for s in mix.sources},
            "eot": eot, "vocab_size": tokenizer.vocab_size, "seed": mix.seed,
            "documents": report.documents, "skipped": report.skipped, "tokens": report.tokens}
    (tmp / "mix.json").write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return report


class PackedSampler:
    """Deterministic, resumable fixed-length sequences from a built mix."""

    def __init__(self, folder: str | Path, split: str = "train", *, seq_len: int, seed: int = 0,
                 weights: dict[str, float] | None = None):
        self.folder = Path(folder)
        meta_path = self.folder / "mix.json"
        if not meta_path.is_file():
            raise DataError(f"{self.folder}: not a dataset folder (no mix.json)")
        self.meta = json.loads(meta_path.read_text())
        self.split, self.seq_len, self.seed = split, seq_len, seed
        w = weights or {k: v["weight"] for k, v in self.meta["sources"].items()}
        self.tokens, self.starts = {}, {}
        for name in self.meta["sources"]:
            path = self.folder / split / f"{name}.bin"
            self.tokens[name] = np.memmap(path, dtype=np.uint32, mode="r") if path.stat().st_size else \
                np.zeros(0, np.uint32)
            idx = self.folder / split / f"{name}.idx"
            self.starts[name] = np.fromfile(idx, dtype=np.int64)
        self.names = [n for n in self.meta["sources"] if len(self.tokens[n]) > seq_len and w.get(n, 0) > 0]
        if not self.names:
            raise DataError(f"{self.folder}/{split}: no source has more than {seq_len} tokens")
        p = np.array([w[n] for n in self.names], dtype=np.float64)
        self.probs = p / p.sum()
        self.cursor = {n: 0 for n in self.names}
        self.index = 0

    def state(self) -> dict:
        return {"split": self.split, "index": self.index, "cursor": dict(self.cursor), "seq_len": self.seq_len}

    def load_state(self, state: dict) -> None:
        if state.get("seq_len", self.seq_len) != self.seq_len or state.get("split", self.split) != self.split:
            raise DataError(f"data position is for split {state.get('split')} / seq_len {state.get('seq_len')}")
        for name, c in state["cursor"].items():
            if name not in self.cursor:
                raise DataError(f"data position names source {name!r}, which this mix does not have")
            if not 0 <= c < len(self.tokens[name]):
                raise DataError(f"data position {c} is past the end of source {name!r} ({len(self.tokens[name])} "
                                "tokens)")
        self.cursor.update(state["cursor"])
        self.index = state["index"]

    def next_sequence(self) -> tuple[np.ndarray, np.ndarray, str]:
        """(tokens (seq_len + 1,), segment ids (seq_len + 1,), source). Segment ids change at
        every document start, so that attention and labels stay within a document."""
        rng = np.random.default_rng([self.seed, self.index])
        name = self.names[int(rng.choice(len(self.names), p=self.probs))]
        self.index += 1
        toks, starts = self.tokens[name], self.starts[name]
        n, c = len(toks), self.cursor[name]
        want = self.seq_len + 1
        idx = (np.arange(c, c + want)) % n
        out = np.asarray(toks[idx], dtype=np.int64)
        # document number of each position (wrap-around starts a new document too)
        doc = np.searchsorted(starts, idx, side="right") + (idx < c) * len(starts)
        self.cursor[name] = int((c + self.seq_len) % n)  # the last token is the next window's first input
        return out, doc - doc[0], name

    def batch(self, batch_size: int):
        import torch

        seqs = [self.next_sequence() for _ in range(batch_size)]
        ids = torch.from_numpy(np.stack([s[0] for s in seqs]))
        seg = torch.from_numpy(np.stack([s[1] for s in seqs]))
        return ids, seg
