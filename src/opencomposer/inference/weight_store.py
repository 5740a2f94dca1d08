"""The weight store: every training step's weights published as a versioned, checksummed delta
chain in shared storage, which every inference replica pulls and verifies on its own (report §6.2:
"each rank caches its previous upload and transmits only the diff"; replicas "independently
download and reconstruct weights from the shared delta chain"; a full snapshot every N steps).

Layout under the store's URL (a local folder, or any fsspec URL: s3://, gs://, memory://):

    v00000012/tensors.zst     one zstd frame per tensor
    v00000012/manifest.json   written last: a version exists once its manifest does

A delta frame is the XOR of the tensor's bytes with the base version's bytes: lossless and
bit-exact, and an unchanged tensor (or the unchanged sign, exponent and high mantissa bits of a
slightly changed float) is mostly zeros, which zstd squeezes. A full frame is the raw bytes. The
manifest names the base version, and gives the sha256 of the blob, of every reconstructed tensor
and of the whole state. (Shuffling the bytes by significance first, blosc's filter, made SmolLM2's
frames larger and compression slower here: docs/rl.md, "Weight sync".)

A replica applies a version only after it has the whole blob, the blob's checksum matches, and
every reconstructed tensor's checksum matches; a delta only onto exactly its base. Anything else —
a missing or torn manifest, a corrupt blob, a delta against a version it does not serve — raises
`WeightStoreError` and the engine keeps serving what it had; a newer full snapshot lets a replica
that fell behind (or missed a delta) catch up.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass

import torch

from opencomposer.core.errors import UserError


class WeightStoreError(RuntimeError, UserError):
    """A version that cannot be applied (the message says which and why); nothing was applied."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightStoreConfig:
    url: str
    """A local folder or an fsspec URL."""
    full_every: int = 10
    """A full snapshot every this many versions (and the first one); deltas in between."""
    level: int = 1
    """zstd compression level. Level 3 made SmolLM2's deltas 5% smaller at twice the time."""
    retain_full: int | None = 2
    """After a full snapshot is published, versions older than the `retain_full`-th newest full
    snapshot are deleted: a replica behind them catches up from a newer full snapshot, so the store
    holds at most about `retain_full` x `full_every` versions instead of one per training step
    (a default 12-step run had left 3.4 GB here). None keeps every version."""


def _fs(url: str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/")


def _name(version: int) -> str:
    return f"v{version:08d}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view when it is contiguous on the CPU)."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)


def _sha256(b: torch.Tensor) -> str:
    return hashlib.sha256(memoryview(b.numpy())).hexdigest()


def _xor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bytewise XOR of two flat uint8 tensors, computed 8 bytes at a time where the length allows
    (torch's uint8 XOR ran at ~0.5 GB/s here)."""
    if a.numel() % 8 == 0:
        return torch.bitwise_xor(a.view(torch.int64), b.view(torch.int64)).view(torch.uint8)
    return torch.bitwise_xor(a, b)


def _map(fn, items: list) -> list:
    """fn over items on torch's thread count: zstd, sha256 and torch's kernels release the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    n = min(torch.get_num_threads(), len(items))
    if n <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(n, thread_name_prefix="weight-store") as pool:
        return list(pool.map(fn, items))


_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
                               torch.int8, torch.uint8, torch.bool)}


def _tensor(raw: torch.Tensor, dtype: str, shape: list[int]) -> torch.Tensor:
    if dtype not in _DTYPES:
        raise WeightStoreError(f"unsupported dtype {dtype}")
    return raw.view(_DTYPES[dtype]).reshape(shape)


def state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(hashlib.sha256(memoryview(_bytes(state[name]).numpy())).digest())
    return h.hexdigest()


class WeightStore:
    def __init__(self, config: WeightStoreConfig):
        self.config = config
        self.fs, self.root = _fs(config.url)
        self._last: tuple[int, dict[str, torch.Tensor]] | None = None  # the publisher's copy of its previous upload

    # -- reading ----------------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Complete versions (those with a manifest), ascending."""
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith("v") and base[1:].isdigit() and self.fs.exists(f"{self.root}/{base}/manifest.json"):
                out.append(int(base[1:]))
        return sorted(out)

    def manifest(self, version: int) -> dict:
        path = f"{self.root}/{_name(version)}/manifest.json"
        try:
            with self.fs.open(path, "rb") as f:
                m = json.loads(f.read())
        except FileNotFoundError:
            raise WeightStoreError(f"version {version}: no manifest at {path}") from None
        except ValueError as e:
            raise WeightStoreError(f"version {version}: unreadable manifest ({e})") from None
        if m.get("version") != version:
            raise WeightStoreError(f"version {version}: the manifest says version {m.get('version')}")
        return m

    def load(self, version: int, base: dict[str, torch.Tensor] | None, base_version: int | None,
             ) -> dict[str, torch.Tensor]:
        """The full state of `version`, verified. A delta needs `base` = the state of exactly its
        base version (`base_version`)."""
        import zstandard

        m = self.manifest(version)
        if m["base"] is not None and m["base"] != base_version:
            raise WeightStoreError(f"version {version} is a delta against version {m['base']}, but this replica "
                                   f"has version {base_version}: wait for the next full snapshot")
        try:
            with self.fs.open(f"{self.root}/{_name(version)}/tensors.zst", "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            raise WeightStoreError(f"version {version}: the manifest has no tensors.zst beside it") from None
        if len(blob) != m["bytes"] or hashlib.sha256(blob).hexdigest() != m["sha256"]:
            raise WeightStoreError(f"version {version}: tensors.zst is corrupt or partial ({len(blob)} bytes, "
                                   f"{m['bytes']} expected; checksum mismatch)")
        def decode(e: dict) -> torch.Tensor:
            try:
                data = zstandard.ZstdDecompressor().decompress(blob[e["offset"]:e["offset"] + e["length"]])
            except zstandard.ZstdError as err:
                raise WeightStoreError(f"version {version}: {e['name']} does not decompress ({err})") from None
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
            if m["base"] is not None:
                if e["name"] not in base:
                    raise WeightStoreError(f"version {version}: {e['name']} is not in the base state")
                prev = _bytes(base[e["name"]])
                if prev.numel() != raw.numel():
                    raise WeightStoreError(f"version {version}: {e['name']} has {raw.numel()} bytes, its base "
                                           f"{prev.numel()}")
                raw = _xor(raw, prev)
            if _sha256(raw) != e["sha256"]:
                raise WeightStoreError(f"version {version}: {e['name']} does not match its checksum after "
                                       "reconstruction")
            return _tensor(raw, e["dtype"], e["shape"])

        return dict(zip((e["name"] for e in m["tensors"]), _map(decode, m["tensors"])))

    # -- publishing -------------------------------------------------------------------------------
    def publish(self, state: dict[str, torch.Tensor], version: int, *, full: bool = False) -> dict:
        """Write `version`: a delta against the previous version this store published, or a full
        snapshot (the first, every `full_every`-th, when the tensor set changed, or `full`: a
        replica rejected a version and needs a base it can load). Returns the manifest. The
        manifest is written after the blob, so readers never see half a version."""
        import zstandard

        if self._last is not None and version <= self._last[0]:
            raise WeightStoreError(f"version {version} is not newer than the last published {self._last[0]}")
        t0 = time.perf_counter()
        raw = {name: _bytes(t).clone() for name, t in state.items()}  # a copy: the trainer goes on updating
        prev = self._last[1] if self._last is not None else None
        full = full or prev is None or version % self.config.full_every == 0 or set(prev) != set(raw) or \
            any(prev[n].numel() != raw[n].numel() for n in raw)
        names = sorted(raw)

        def encode(name: str) -> tuple[bytes, str]:
            data = raw[name] if full else _xor(raw[name], prev[name])
            return zstandard.ZstdCompressor(level=self.config.level).compress(memoryview(data.numpy())), \
                _sha256(raw[name])

        frames, entries, offset = [], [], 0
        for name, (frame, digest) in zip(names, _map(encode, names)):
            t = state[name]
            entries.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset,
                            "length": len(frame), "sha256": digest})
            frames.append(frame)
            offset += len(frame)
        blob = b"".join(frames)
        folder = f"{self.root}/{_name(version)}"
        self.fs.makedirs(folder, exist_ok=True)
        with self.fs.open(f"{folder}/tensors.zst", "wb") as f:
            f.write(blob)
        manifest = {"version": version, "base": None if full else self._last[0], "kind": "full" if full else "delta",
                    "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest(),
                    "tensors": entries,
                    "raw_bytes": sum(v.numel() for v in raw.values()), "created": time.time(),
                    "seconds": round(time.perf_counter() - t0, 4)}
        with self.fs.open(f"{folder}/manifest.json.tmp", "wb") as f:
            f.write(json.dumps(manifest).encode())
        self.fs.mv(f"{folder}/manifest.json.tmp", f"{folder}/manifest.json")
        self._last = (version, raw)
        if full:
            self.prune()
        return manifest

    def prune(self) -> list[int]:
        """Delete the versions (and torn uploads) older than the `retain_full`-th newest full
        snapshot; returns the deleted version numbers. A manifest goes first, so a reader never
        sees a version whose blob is already gone; one caught mid-read gets a `WeightStoreError`
        and catches up from the full snapshot on its next poll."""
        keep = self.config.retain_full
        if keep is None:
            return []
        fulls = [v for v in reversed(self.versions()) if self.manifest(v)["base"] is None][:keep]
        if len(fulls) < keep:
            return []
        cutoff = fulls[-1]
        try:
            names = [n.rstrip("/").rsplit("/", 1)[-1] for n in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        gone = []
        for base in names:
            if base.startswith("v") and base[1:].isdigit() and int(base[1:]) < cutoff:
                folder = f"{self.root}/{base}"
                if self.fs.exists(f"{folder}/manifest.json"):
                    self.fs.rm(f"{folder}/manifest.json")
                self.fs.rm(folder, recursive=True)
                gone.append(int(base[1:]))
        return sorted(gone)


class WeightPuller:
    """One replica's side: bring an engine to the newest version in the store, one verified version
    at a time (or straight to a newer full snapshot). What was applied is counted; a version that
    fails is recorded with its reason and the engine keeps serving its last good weights."""

    def __init__(self, store: WeightStore, engine):
        self.store = store
        self.engine = engine
        self.errors: list[str] = []
        self.applied = 0
        self.failed: set[int] = set()
        self.seen = -1
        """The newest version in the store at the last poll: a refusal is about the store up to it."""

    def _state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.engine.model.to_hf_state().items()}

    def poll(self, *, wait: float | None = 60.0) -> int:
        """Apply every version newer than the engine's; returns the engine's version after."""
        while True:
            current = self.engine.version
            newer = [v for v in self.store.versions() if v > current and v not in self.failed]
            if not newer:
                return current
            self.seen = max(self.seen, newer[-1])
            bases = {v: self.store.manifest(v)["base"] for v in newer}
            chain = next((v for v in newer if bases[v] == current), None)
            full = max((v for v in newer if bases[v] is None), default=None)
            # the next link of the chain, or a newer full snapshot, which replaces everything before it
            target = full if full is not None and (chain is None or full > chain) else chain
            if target is None:
                err = (f"no version in the store applies to version {current}: the next ones are deltas against "
                       f"versions this replica does not have ({newer[:5]}); it keeps serving until a full snapshot "
                       "is published")
                self.errors.append(err)
                raise WeightStoreError(err)
            try:
                tensors = self.store.load(target, self._state(), current)
            except WeightStoreError as e:
                self.errors.append(str(e))
                self.failed.add(target)
                raise
            self.engine.update_weights(tensors, target, wait=wait)
            self.applied += 1


class WeightFollower:
    """A replica following a store on its own: a background thread polls the store every
    `interval_s` and applies new versions through a `WeightPuller`, between decode steps. A refusal
    (corrupt, partial, out of order) is counted once per distinct error, not on every poll, while
    the engine keeps serving its last good weights; `refusals` holds them in order. Used by the RL
    loop's in-process replica and by `opencomposer serve --weights=URL` (a replica process)."""

    def __init__(self, url: str, engine, *, interval_s: float = 0.2, wait_s: float = 60.0):
        self.puller = WeightPuller(WeightStore(WeightStoreConfig(url=url)), engine)
        self.url, self.interval_s, self.wait_s = url, interval_s, wait_s
        self.refusals: list[dict] = []
        """{"version": the engine's version when refused, "seen": the newest version in the store then,
        "error": why}, one per distinct error. A full snapshot newer than `seen` answers the refusal."""
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def rejected(self) -> int:
        return len(self.refusals)

    def poll(self) -> None:
        try:
            self.puller.poll(wait=self.wait_s)
            self._last_error = None
        except (WeightStoreError, TimeoutError) as e:
            if str(e) != self._last_error:  # the same refusal on every poll until a full snapshot comes
                self._last_error = str(e)
                self.refusals.append({"version": self.puller.engine.version, "seen": self.puller.seen,
                                      "error": str(e)[:500]})

    def start(self) -> WeightFollower:
        self._stop.clear()
        self.poll()
        self._thread = threading.Thread(target=self._loop, name="weight-follower", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
