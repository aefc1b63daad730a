"""Streaming reader/writer for the safetensors file layout, with sha256 per tensor.

Layout (the one `safetensors` defines): an 8-byte little-endian header length N,
N bytes of JSON header, then the raw tensor bytes. The header maps each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative
to the end of the header) plus an optional ``"__metadata__"`` string map.

We write the file ourselves instead of using ``safetensors.torch.save_file``
because cores are far larger than memory: each tensor is produced, written
and hashed one at a time. Files are deterministic so that converting a core
between forms reproduces it byte for byte:

* header JSON is canonical (sorted keys, compact separators, UTF-8), padded
  with spaces so that the data starts at a multiple of 8 bytes;
* tensors are laid out by decreasing element size, then by name, with no gaps,
  so every tensor starts at a multiple of its element size (mmap-friendly).

Readers reject any header that is not exactly what this writer would produce
for its content: a single flipped byte in the header (even in the padding)
is therefore always detected.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from flare_core.core.errors import CoreError, CoreVerificationError

# safetensors dtype code -> torch dtype.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # FP4 weights' group scales (flare_core.kernels.fp4)
}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}

METADATA_KEY = "__metadata__"
HEADER_ALIGNMENT = 8
# Large sequential chunks keep hashing and copying bound by disk, not by Python.
CHUNK_BYTES = 16 * 1024 * 1024
# `safetensors` refuses headers larger than this; stay readable by it.
MAX_HEADER_BYTES = 100_000_000
_PLACEHOLDER_SHA256 = "0" * 64


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code for a torch dtype, or a CoreError naming it."""
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in DTYPE_CODES)
        raise CoreError(f"dtype {dtype} cannot be stored in a core; supported: {supported}") from None


def itemsize(code: str) -> int:
    return DTYPES[code].itemsize


@dataclass(frozen=True)
class TensorEntry:
    """One tensor to write: its header fields and a producer of its raw bytes.

    ``chunks()`` is called exactly once, when the tensor's turn comes, so a
    producer may materialize the tensor lazily and drop it afterwards. Each
    yielded chunk must stay valid only until the next one is requested.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[memoryview | bytes]]

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's raw bytes lie: an absolute byte range in a file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]
    tensors: dict[str, TensorLocation]


def canonical_order(entries: Iterable[TensorEntry]) -> list[TensorEntry]:
    """Decreasing element size, then name: keeps every tensor aligned to its element size."""
    return sorted(entries, key=lambda entry: (-itemsize(entry.dtype), entry.name))


def tensor_chunks(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's raw bytes (C order, little-endian as in memory) in CHUNK_BYTES pieces."""
    # Flattening first lets 0-d tensors be viewed as bytes; uint8 views work for
    # dtypes numpy lacks (bfloat16, float8).
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    raw = memoryview(flat.numpy())
    for start in range(0, len(raw), CHUNK_BYTES):
        yield raw[start : start + CHUNK_BYTES]


def _encode_header(entries: Sequence[TensorEntry], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    offset = 0
    for entry in entries:
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    return _frame_header(header)


def _frame_header(header: Mapping[str, object]) -> bytes:
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    path: Path,
    entries: Sequence[TensorEntry],
    metadata_for: Callable[[Mapping[str, str]], Mapping[str, str] | None],
    on_bytes: Callable[[int], None],
) -> dict[str, str]:
    """Write `entries` to a new file at `path` in one streaming pass; return sha256 per tensor.

    The header must precede the data but may depend on the hashes (the core
    manifest lists them). ``metadata_for(hashes)`` is therefore called twice:
    first with placeholder hashes to size the header, whose space is reserved,
    then with the real hashes once the data is written; the final header is
    written over the reserved space. Hex digests have a fixed length, so both
    headers have the same size (checked).
    """
    ordered = canonical_order(entries)
    names = [entry.name for entry in ordered]
    if len(set(names)) != len(names):
        raise CoreError(f"duplicate tensor names while writing {path}")
    if METADATA_KEY in names:
        raise CoreError(f"tensor name {METADATA_KEY!r} is reserved by safetensors ({path})")
    reserved = _encode_header(ordered, metadata_for({name: _PLACEHOLDER_SHA256 for name in names}))
    hashes: dict[str, str] = {}
    with open(path, "xb") as file:
        file.seek(len(reserved))
        for entry in ordered:
            digest = hashlib.sha256()
            written = 0
            for chunk in entry.chunks():
                file.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                on_bytes(len(chunk))
            if written != entry.nbytes:
                raise CoreError(
                    f"tensor {entry.name!r} produced {written} bytes, but its dtype {entry.dtype} "
                    f"and shape {list(entry.shape)} need {entry.nbytes}"
                )
            hashes[entry.name] = digest.hexdigest()
        final = _encode_header(ordered, metadata_for(hashes))
        if len(final) != len(reserved):
            raise CoreError(f"header of {path} changed size after hashing ({len(reserved)} -> {len(final)} bytes)")
        file.seek(0)
        file.write(final)
        file.flush()
        os.fsync(file.fileno())
    return hashes


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and strictly validate a safetensors header; CoreVerificationError if corrupt."""

    def corrupt(reason: str) -> CoreVerificationError:
        return CoreVerificationError(f"corrupt safetensors header in {path}: {reason}")

    try:
        with open(path, "rb") as file:
            file_size = os.fstat(file.fileno()).st_size
            prefix = file.read(8)
            if len(prefix) < 8:
                raise corrupt(f"file is {file_size} bytes, shorter than the 8-byte length prefix")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > min(MAX_HEADER_BYTES, file_size - 8):
                raise corrupt(f"header length {header_size} exceeds the file ({file_size} bytes) or the 100 MB limit")
            raw = file.read(header_size)
    except FileNotFoundError:
        raise CoreVerificationError(f"missing core file {path}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise corrupt(f"header is not valid UTF-8 JSON ({error})") from None
    if not isinstance(header, dict):
        raise corrupt("header is not a JSON object")

    metadata = header.get(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise corrupt(f"{METADATA_KEY} is not a map of strings")

    data_start = 8 + header_size
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == METADATA_KEY:
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise corrupt(f"tensor {name!r} entry must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPES:
            raise corrupt(f"tensor {name!r} has unknown dtype {dtype!r}")
        if not _is_int_list(shape) or not _is_int_list(offsets) or len(offsets) != 2:
            raise corrupt(f"tensor {name!r} has a malformed shape or data_offsets")
        begin, end = offsets
        nbytes = prod(shape) * itemsize(dtype)
        if end - begin != nbytes:
            raise corrupt(f"tensor {name!r} spans {end - begin} bytes but dtype {dtype} shape {shape} needs {nbytes}")
        spans.append((begin, end, name))
        tensors[name] = TensorLocation(path, dtype, tuple(shape), data_start + begin, nbytes)

    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise corrupt(f"tensor {name!r} starts at {begin}, expected {position} (gap or overlap)")
        position = end
    if data_start + position != file_size:
        raise corrupt(f"tensor data ends at byte {data_start + position} but the file has {file_size} bytes")
    if _frame_header(header) != prefix + raw:
        raise corrupt("header bytes are not in canonical form (altered JSON or padding)")
    return SafetensorsHeader(path, metadata, tensors)


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(type(item) is int and item >= 0 for item in value)


def iter_file_range(path: Path, offset: int, nbytes: int) -> Iterator[memoryview]:
    """Yield the bytes [offset, offset + nbytes) of a file in CHUNK_BYTES pieces.

    The pieces share one buffer: each is valid only until the next is requested.
    """
    with open(path, "rb", buffering=0) as file:
        file.seek(offset)
        buffer = memoryview(bytearray(min(CHUNK_BYTES, nbytes)))
        remaining = nbytes
        while remaining:
            count = file.readinto(buffer[: min(remaining, len(buffer))])
            if not count:
                raise CoreVerificationError(f"{path} ended {remaining} bytes before the data it declares")
            remaining -= count
            yield buffer[:count]


def read_range(location: TensorLocation) -> bytes:
    return b"".join(bytes(chunk) for chunk in iter_file_range(location.path, location.offset, location.nbytes))


def hash_locations(
    locations: Mapping[str, TensorLocation],
    on_bytes: Callable[[int], None],
    threads: int | None = None,
) -> dict[str, str]:
    """sha256 of each byte range, several ranges at once (hashlib and reads release the GIL)."""
    lock = threading.Lock()

    def digest(location: TensorLocation) -> str:
        hasher = hashlib.sha256()
        for chunk in iter_file_range(location.path, location.offset, location.nbytes):
            hasher.update(chunk)
            with lock:
                on_bytes(len(chunk))
        return hasher.hexdigest()

    workers = threads or min(8, os.cpu_count() or 1)
    # Largest first, so one huge tensor does not start last and run alone.
    largest_first = sorted(locations, key=lambda name: -locations[name].nbytes)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flare-hash") as pool:
        digests = pool.map(lambda name: digest(locations[name]), largest_first)
        return dict(zip(largest_first, digests))
