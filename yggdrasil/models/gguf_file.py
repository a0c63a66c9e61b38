"""A fast GGUF reader: metadata and tensor directory from the header, tensor bytes memory-mapped.

The `gguf` package's GGUFReader builds a numpy view per vocabulary entry, which takes seconds for
a 50k–150k-token vocabulary and dominated start-up time. This reads the same header with plain
struct unpacking and leaves dequantization to `gguf.quants`.

The `gguf` package is imported only when a GGUF file is opened (`gguf_package()`): HF-format
models and bundles built from them run without it (a GPU image may not have it).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from functools import cache

import numpy as np

from yggdrasil.errors import ModelFileError, UnsupportedModelError
from yggdrasil.models import gguf_dequant

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type codes → struct format of one scalar
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numbers (everything else goes through gguf.quants as raw bytes),
# by GGML type code: F32, F16, F64
_PLAIN = {0: np.float32, 1: np.float16, 28: np.float64}


@cache
def gguf_package():
    """The `gguf` package (block sizes, dequantization), imported on first use."""
    try:
        import gguf  # optional: only GGUF models need it, and the GPU image lacks it
    except ImportError:
        raise ModelFileError("reading GGUF files needs the `gguf` package, which is not installed; "
                             "`pip install gguf` (or use an HF-format model folder)") from None
    return gguf


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), the reverse of GGUF's ne order
    qtype: int  # gguf.GGMLQuantizationType (an IntEnum)
    offset: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelFileError(f"{self.path} is truncated (header ends early); re-download it "
                                 "or reinstall its package")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype}; the file is corrupt")


class GGUFFile:
    """Metadata dict and tensor directory of a GGUF file, with memory-mapped tensor data."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"GGUF file {self.path} does not exist")
        with open(self.path, "rb") as handle:
            size = self.path.stat().st_size
            if size < 24:
                raise ModelFileError(f"{self.path} is too small to be a GGUF file ({size} bytes)")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        cursor = _Cursor(memoryview(self._map), self.path)
        if bytes(cursor.take(4)) != MAGIC:
            raise ModelFileError(f"{self.path} is not a GGUF file (bad magic)")
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} is not supported (2, 3 are)")
        n_tensors, n_kv = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        raw = [self._tensor_header(cursor) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        self.tensors = [self._tensor_info(name, ne, qtype, data_start + off)
                        for name, ne, qtype, off in raw]
        self._check_complete(size)

    @staticmethod
    def _tensor_header(cursor: _Cursor):
        name = cursor.string()
        n_dims = cursor.scalar("<I")
        ne = tuple(cursor.scalar("<Q") for _ in range(n_dims))
        return name, ne, cursor.scalar("<I"), cursor.scalar("<Q")

    def _tensor_info(self, name: str, ne: tuple[int, ...], qtype: int, offset: int) -> TensorInfo:
        gguf = gguf_package()
        try:
            kind = gguf.GGMLQuantizationType(qtype)
        except ValueError:
            raise UnsupportedModelError(f"{self.path}: tensor {name} has unknown type {qtype}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_elements = int(np.prod(ne)) if ne else 1
        return TensorInfo(name, tuple(reversed(ne)), kind, offset, n_elements // block * type_size)

    def _check_complete(self, size: int) -> None:
        for info in self.tensors:
            if info.offset + info.nbytes > size:
                raise ModelFileError(
                    f"{self.path} is truncated (tensor {info.name} ends at byte "
                    f"{info.offset + info.nbytes}, the file has {size}); re-download it or "
                    "reinstall its package")

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes/values, shaped the way gguf.quants.dequantize expects."""
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if info.qtype in _PLAIN:
            return flat.view(_PLAIN[info.qtype]).reshape(info.shape)
        block, type_size = gguf_package().GGML_QUANT_SIZES[info.qtype]
        row_bytes = info.shape[-1] // block * type_size
        return flat.reshape(*info.shape[:-1], row_bytes)

    def dequantize(self, info: TensorInfo) -> np.ndarray:
        """The tensor as a writable, contiguous float32 array (gguf_dequant.py where it knows
        the block type: the same bits, a few times sooner)."""
        if gguf_dequant.supported(info.qtype):
            return gguf_dequant.dequantize(self.raw(info), info.qtype, info.shape).numpy()
        try:
            data = gguf_package().quants.dequantize(self.raw(info), info.qtype)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {info.name} uses {info.qtype.name}, which the gguf package "
                "cannot dequantize") from None
        data = np.ascontiguousarray(data, dtype=np.float32)
        # plain float32 tensors come back as read-only views of the map: copy those
        return data if data.flags.writeable else data.copy()
