"""A GGUF file's header, read straight from its bytes: the metadata, the tensor infos, and each
tensor's data as a view into a read-only memory map.

Why not gguf's `GGUFReader`: it builds a numpy view for every element of every array, and then
`contents()` a Python object from each; for Gemma 3's 262,144-token vocabulary that is 8.6 s, paid
by the router and by every worker. Here an array of numbers is one `numpy.frombuffer` and an array
of strings one Python loop over the mapped bytes. Values come out as `ReaderField.contents()` gives
them, the reader's own `GGUF.version`, `GGUF.tensor_count` and `GGUF.kv_count` entries included,
so either can stand for the other.

A malformed file is a ValueError naming the path and what is wrong: every count and length is
checked against the bytes left in the file before anything is read or allocated for it.

Limits: GGUF v2 and v3, in either byte order. Arrays of arrays are refused, as llama.cpp refuses
them (`GGUFReader` would flatten them).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; nothing still in use writes it
_MAX_DIMS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
_DEFAULT_ALIGNMENT = 32
_HEADER_BYTES = 24  # magic, version, tensor count, metadata count
# The fewest bytes one entry can take, to refuse a count the rest of the file cannot hold:
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8  # name length, dimension count, type, offset

# GGUF scalar type -> struct format character (the byte order is prefixed per file).
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    name: str
    type: int  # GGML type id (a `gguf.GGMLQuantizationType` value)
    shape: tuple[int, ...]  # GGUF order: fastest dimension first, as `ReaderTensor.shape`
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int


class GgufFile:
    """`GgufFile(path)`: the header parsed, the file mapped read-only until `close()`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: list[GgufTensorInfo] = []
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEADER_BYTES:  # also: an empty file cannot be mapped at all
                raise ValueError(f"{self.path}: truncated GGUF file: {size} bytes, shorter than a GGUF header")
            self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            _Parser(self._map, size, self.path).parse(self)
        except BaseException:
            self.close()
            raise

    def data(self, t: GgufTensorInfo) -> np.ndarray:
        """`t`'s bytes: uint8 [n_bytes], a read-only view of the mapped file (no copy)."""
        if self._map is None:
            raise ValueError(f"{self.path}: GgufFile is closed")
        return np.frombuffer(self._map, dtype=np.uint8, count=t.n_bytes, offset=t.offset)

    def close(self) -> None:
        if self._map is None:
            return
        try:
            self._map.close()
        except BufferError:
            pass  # arrays from `data()` still point into it: it is unmapped when the last one goes
        self._map = None

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Parser:
    """One pass over the header; `pos` is the next byte to read."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf, self.size, self.path = buf, size, path
        self.pos = 0
        self.order = "<"

    def parse(self, out: GgufFile) -> None:
        if self.buf[:4] != _MAGIC:
            raise self.error(f"not a GGUF file: it starts with {self.buf[:4]!r}, not {_MAGIC!r}")
        self.pos = 4
        version = self.scalar("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in _VERSIONS:
            raise self.error(f"GGUF version {version} is not supported; pdserve reads versions 2 and 3")
        n_tensors, n_kv = self.scalar("Q"), self.scalar("Q")
        self.check_count(n_kv, _MIN_KV_BYTES, "metadata entries")
        out.metadata.update({"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv})
        alignment = _DEFAULT_ALIGNMENT
        for _ in range(n_kv):
            key = self.string("a metadata key")
            if key in out.metadata:
                raise self.error(f"metadata key {key!r} appears twice")
            kind = self.scalar("I")
            if key == "general.alignment":
                alignment = self.alignment(kind)
                out.metadata[key] = alignment
            else:
                out.metadata[key] = self.value(kind, key)
        self.check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor infos")
        infos = [self.tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        names: set[str] = set()
        for name, kind, shape, offset in infos:
            if name in names:
                raise self.error(f"tensor {name!r} appears twice")
            names.add(name)
            out.tensors.append(self.tensor(name, kind, shape, offset, data_start, alignment))

    # ---- metadata ----

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], key)
        if kind == GGUFValueType.STRING:
            return self.string(key)
        if kind == GGUFValueType.ARRAY:
            return self.array(key)
        raise self.error(f"metadata {key!r} has unknown value type {kind}", back=4)

    def array(self, key: str) -> list[Any]:
        kind, n = self.scalar("I", key), self.scalar("Q", key)
        if kind in _SCALARS:
            itemsize = struct.calcsize(_SCALARS[kind])
            self.check_count(n, itemsize, f"elements of {key!r}")
            if kind == GGUFValueType.BOOL:  # any nonzero byte is true, as `struct` and numpy read one
                values = np.frombuffer(self.buf, np.uint8, n, self.pos) != 0
            else:
                values = np.frombuffer(self.buf, np.dtype(self.order + _SCALARS[kind]), n, self.pos)
            self.pos += n * itemsize
            return values.tolist()
        if kind == GGUFValueType.STRING:
            self.check_count(n, 8, f"strings of {key!r}")
            return self.strings(n, key)
        if kind == GGUFValueType.ARRAY:
            raise self.error(f"metadata {key!r} is an array of arrays, which GGUF readers do not support")
        raise self.error(f"metadata {key!r} is an array of unknown type {kind}")

    def strings(self, n: int, key: str) -> list[str]:
        # The hot loop of the whole header (Gemma 3: 262,144 tokens): locals only.
        buf, size, pos = self.buf, self.size, self.pos
        length_at = struct.Struct(self.order + "Q").unpack_from
        out: list[str] = [""] * n
        try:
            for i in range(n):
                if pos + 8 > size:
                    self.pos = pos
                    raise self.error(f"truncated GGUF file: string {i} of {key!r} runs past the end")
                (length,) = length_at(buf, pos)
                pos += 8
                if length > size - pos:
                    self.pos = pos - 8
                    raise self.error(f"truncated or corrupt GGUF file: string {i} of {key!r} claims {length} "
                                     f"bytes; {size - pos} are left")
                out[i] = str(buf[pos : pos + length], "utf-8")
                pos += length
        except UnicodeDecodeError as e:
            self.pos = pos
            raise self.error(f"string {i} of {key!r} is not valid UTF-8 ({e.reason})") from None
        self.pos = pos
        return out

    def alignment(self, kind: int) -> int:
        if kind != GGUFValueType.UINT32:
            raise self.error("general.alignment must be a uint32")
        alignment = self.scalar("I", "general.alignment")
        if alignment == 0 or alignment & (alignment - 1):
            raise self.error(f"general.alignment is {alignment}; it must be a power of two")
        return alignment

    # ---- tensor infos ----

    def tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self.string("a tensor name")
        n_dims = self.scalar("I", name)
        if n_dims > _MAX_DIMS:
            raise self.error(f"tensor {name!r} has {n_dims} dimensions; GGML allows at most {_MAX_DIMS}")
        shape = tuple(self.scalar("Q", name) for _ in range(n_dims))
        kind, offset = self.scalar("I", name), self.scalar("Q", name)
        return name, kind, shape, offset

    def tensor(self, name: str, kind: int, shape: tuple[int, ...], offset: int, data_start: int,
               alignment: int) -> GgufTensorInfo:
        if kind not in GGML_QUANT_SIZES:
            raise self.error(f"tensor {name!r} has unknown GGML type {kind}")
        block, type_size = GGML_QUANT_SIZES[kind]
        if shape and shape[0] % block:
            raise self.error(f"tensor {name!r}: its first dimension {shape[0]} is not a multiple of "
                             f"its type's block of {block}")
        n_elements = 1
        for d in shape:
            n_elements *= d
        n_bytes = n_elements // block * type_size
        if offset % alignment:
            raise self.error(f"tensor {name!r} starts at data offset {offset}, not a multiple of {alignment}")
        if data_start + offset + n_bytes > self.size:
            raise self.error(f"truncated GGUF file: tensor {name!r} needs bytes up to "
                             f"{data_start + offset + n_bytes}; the file has {self.size}")
        return GgufTensorInfo(name, kind, shape, data_start + offset, n_bytes)

    # ---- primitives ----

    def scalar(self, fmt: str, what: str = "the header") -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.error(f"truncated GGUF file: {what} runs past the end")
        (value,) = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        if length > self.size - self.pos:
            raise self.error(f"truncated or corrupt GGUF file: {what} claims {length} bytes; "
                             f"{self.size - self.pos} are left", back=8)
        try:
            text = str(self.buf[self.pos : self.pos + length], "utf-8")
        except UnicodeDecodeError as e:
            raise self.error(f"{what} is not valid UTF-8 ({e.reason})") from None
        self.pos += length
        return text

    def check_count(self, n: int, min_bytes: int, what: str) -> None:
        if n > (self.size - self.pos) // min_bytes:
            raise self.error(f"truncated or corrupt GGUF file: it claims {n} {what}, more than its "
                             f"remaining {self.size - self.pos} bytes can hold")

    def error(self, message: str, back: int = 0) -> ValueError:
        return ValueError(f"{self.path}: {message} (at byte {self.pos - back})")


def type_name(type_id: int) -> str:
    """GGML's name of a tensor type ("Q4_K"), or "type N" for a number it does not know."""
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def float_values(gguf: GgufFile, t: GgufTensorInfo) -> np.ndarray:
    """`t`'s values as float32, in torch's order (slowest dimension first): F32 and F16 as stored,
    BF16 widened, quantized types expanded by the `gguf` package's reference rules. A ValueError
    names a type it cannot expand."""
    from gguf.quants import dequantize

    raw = gguf.data(t)
    shape = tuple(int(n) for n in reversed(t.shape))
    if t.type == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(shape).copy()
    if t.type == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    if t.type == GGMLQuantizationType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    try:
        kind = GGMLQuantizationType(t.type)
        elements, block_bytes = GGML_QUANT_SIZES[kind]
        values = dequantize(raw.reshape(-1, shape[-1] // elements * block_bytes), kind)
    except (KeyError, ValueError, NotImplementedError):
        raise ValueError(f"{gguf.path}: GGUF tensor {t.name!r} is stored as {type_name(t.type)}, which cannot be "
                         "expanded") from None
    return values.astype(np.float32, copy=False).reshape(shape)
