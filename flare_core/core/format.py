"""Runtime core files: write (export), open, verify and convert.

A runtime core is a prepared model: payload tensors, assets (tokenizer.json,
annotated chat template, ...) and a manifest signed with Ed25519. It exists
in two forms holding the same bytes:

* **packed**: one ``.safetensors`` file. Payloads under their names, each
  asset as a 1-D uint8 tensor ``asset/<name>``.
* **directory** (the core cache's form): ``core.safetensors`` (metadata
  only, no tensors), weight shards ``weights-00001-of-0000N.safetensors``
  (payloads in canonical order, cut at a size limit) and
  ``assets.safetensors`` (the asset tensors).

The primary file's safetensors metadata holds:

* ``flare.manifest``: canonical JSON (sorted keys, compact, UTF-8) — the
  caller's manifest plus what the writer adds: ``format_version``,
  ``publisher`` (the signer's display name), ``payloads`` (name ->
  dtype, shape, sha256 of the raw bytes) and ``assets`` (name -> size, sha256);
* ``flare.signature``: base64 Ed25519 signature over the manifest bytes;
* ``flare.publisher``: base64 raw 32-byte public key;
* ``flare.form``: ``packed`` or ``directory``; and in directory form
  ``flare.shards``: the number of weight shards.

Hashes are per tensor, so the manifest and signature do not depend on the form
and ``convert_core`` copies them verbatim; with deterministic writing
(see ``safetensors_io``) packed -> directory -> packed is byte-identical.

Format versions: ``format_version`` is an integer, bumped only when an older
reader could misread a new core. Readers load every version up to
``FORMAT_VERSION`` and refuse newer ones with a CoreFormatVersionError.
Compatible additions (new manifest keys) do not bump it: readers ignore keys
they do not know and tolerate missing optional ones (``publisher``,
``served_names``, ...).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from flare_core.core.errors import (
    CoreError,
    CoreFormatVersionError,
    CoreNotFoundError,
    CoreVerificationError,
    UntrustedPublisherError,
)
from flare_core.core.safetensors_io import (
    METADATA_KEY,
    SafetensorsHeader,
    TensorEntry,
    TensorLocation,
    canonical_order,
    dtype_code,
    hash_locations,
    iter_file_range,
    read_header,
    read_range,
    tensor_chunks,
    write_safetensors,
)
from flare_core.core.signing import PUBLIC_KEY_BYTES, Publisher, SigningKey, verify_signature
from flare_core.core.trust import TrustStore

FORMAT_VERSION = 1
PACKED = "packed"
DIRECTORY = "directory"
FORMS = (PACKED, DIRECTORY)
DEFAULT_SHARD_BYTES = 4 * 1024**3
PRIMARY_FILE = "core.safetensors"
ASSETS_FILE = "assets.safetensors"
ASSET_PREFIX = "asset/"
MAX_SHARDS = 99_999  # five-digit shard numbers

META_FORM = "flare.form"
META_MANIFEST = "flare.manifest"
META_SIGNATURE = "flare.signature"
META_PUBLISHER = "flare.publisher"
META_SHARDS = "flare.shards"

# Manifest keys the writer fills in; an export manifest must not contain them.
WRITER_MANIFEST_KEYS = ("format_version", "publisher", "payloads", "assets")
UNKNOWN_PUBLISHER_NAME = "unknown"


def canonical_json(value: object) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def shard_file_name(index: int, count: int) -> str:
    return f"weights-{index:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class LazyTensor:
    """A payload produced only when the writer reaches it, then released.

    Export uses this to read and transform checkpoint tensors one at a time;
    the declared dtype and shape go into the header before any data is read.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]


TensorSource = torch.Tensor | LazyTensor


def write_core(
    path: Path | str,
    *,
    manifest: Mapping[str, Any],
    tensors: Mapping[str, TensorSource],
    assets: Mapping[str, bytes],
    signing_key: SigningKey,
    form: str = PACKED,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Write and sign a new core at `path` (a file for packed, a directory for directory form).

    Tensors are streamed and hashed in one pass (memory stays at about one
    tensor); the result appears at `path` only once complete.
    """
    path = Path(path)
    _check_form(form)
    _check_export_manifest(manifest)
    payload_entries = [_payload_entry(name, source) for name, source in tensors.items()]
    asset_entries = [_asset_entry(name, data) for name, data in assets.items()]

    def signed_metadata(hashes: Mapping[str, str]) -> dict[str, str]:
        full = dict(manifest)
        full["format_version"] = FORMAT_VERSION
        full["publisher"] = signing_key.publisher.name
        full["payloads"] = {
            entry.name: {"dtype": entry.dtype, "shape": list(entry.shape), "sha256": hashes[entry.name]}
            for entry in payload_entries
        }
        full["assets"] = {
            entry.name.removeprefix(ASSET_PREFIX): {"size": entry.nbytes, "sha256": hashes[entry.name]}
            for entry in asset_entries
        }
        manifest_bytes = canonical_json(full)
        return _signature_metadata(manifest_bytes, signing_key.sign(manifest_bytes), signing_key.publisher.public_key)

    def write(destination: Path, on_bytes: Callable[[int], None]) -> None:
        _write_form(destination, form, payload_entries, asset_entries, signed_metadata, shard_bytes, on_bytes)

    total = sum(entry.nbytes for entry in [*payload_entries, *asset_entries])
    _write_atomically(path, write, total, progress, f"writing {path.name}")
    return path


def open_core(path: Path | str) -> RuntimeCore:
    """Open a core in either form; checks its structure and manifest signature (not trust or hashes)."""
    path = Path(path)
    if path.is_dir():
        primary = read_header(path / PRIMARY_FILE)
        _expect_form(primary, DIRECTORY)
        count = _shard_count(primary)
        companions = [shard_file_name(index, count) for index in range(1, count + 1)] + [ASSETS_FILE]
        files = [primary] + [read_header(path / name) for name in companions]
        return RuntimeCore(path, DIRECTORY, primary, files)
    if path.is_file():
        header = read_header(path)
        if path.name == PRIMARY_FILE and header.metadata.get(META_FORM) == DIRECTORY:
            return open_core(path.parent)
        _expect_form(header, PACKED)
        return RuntimeCore(path, PACKED, header, [header])
    raise CoreNotFoundError(f"no runtime core at {path}")


def convert_core(
    source_path: Path | str,
    destination: Path | str,
    form: str,
    *,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> Path:
    """Rewrite a core in `form` at `destination`, byte-for-byte the same payloads, manifest and signature.

    Every byte copied is hashed and checked against the manifest, so a corrupt
    source is refused rather than converted.
    """
    destination = Path(destination)
    _check_form(form)
    source = open_core(source_path)
    source.check_inventory()
    entries = [
        TensorEntry(name, location.dtype, location.shape, partial(iter_file_range, location.path, location.offset, location.nbytes))
        for name, location in source.locations.items()
    ]
    payload_entries = [entry for entry in entries if not entry.name.startswith(ASSET_PREFIX)]
    asset_entries = [entry for entry in entries if entry.name.startswith(ASSET_PREFIX)]
    metadata = _signature_metadata(source.manifest_bytes, source.signature, source.publisher.public_key)

    def write(target: Path, on_bytes: Callable[[int], None]) -> None:
        hashes = _write_form(target, form, payload_entries, asset_entries, lambda _: metadata, shard_bytes, on_bytes)
        source.compare_hashes(hashes)

    total = sum(entry.nbytes for entry in entries)
    _write_atomically(destination, write, total, progress, f"converting to {form}")
    return destination


class RuntimeCore:
    """An opened core. Construction checks structure and the signature; `verify` checks trust and every byte."""

    def __init__(
        self, path: Path, form: str, primary: SafetensorsHeader, files: Sequence[SafetensorsHeader]
    ) -> None:
        self.path = path
        self.form = form
        self.manifest_bytes = _required_metadata(primary, META_MANIFEST).encode("utf-8")
        self.signature = _base64_metadata(primary, META_SIGNATURE)
        public_key = _base64_metadata(primary, META_PUBLISHER)
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise CoreVerificationError(f"{META_PUBLISHER} in {primary.path} is not a {PUBLIC_KEY_BYTES}-byte Ed25519 key")
        if not verify_signature(public_key, self.manifest_bytes, self.signature):
            raise CoreVerificationError(f"manifest signature invalid in {primary.path}")
        try:
            self.manifest: dict[str, Any] = json.loads(self.manifest_bytes)
        except json.JSONDecodeError as error:
            raise CoreVerificationError(f"manifest in {primary.path} is not valid JSON ({error})") from None
        if not isinstance(self.manifest, dict):
            raise CoreVerificationError(f"manifest in {primary.path} is not a JSON object")
        self.publisher = Publisher(str(self.manifest.get("publisher", UNKNOWN_PUBLISHER_NAME)), public_key)
        version = self.manifest.get("format_version")
        if type(version) is not int:
            raise CoreVerificationError(f"manifest in {primary.path} has no integer format_version")
        if version > FORMAT_VERSION:
            raise CoreFormatVersionError(
                f"core {path} uses format version {version}; this Flare reads versions up to "
                f"{FORMAT_VERSION}. Upgrade flare-core to load it."
            )
        self.format_version: int = version

        # Every tensor of every file, by its name in the file (assets keep their prefix).
        self.locations: dict[str, TensorLocation] = {}
        for header in files:
            for name, location in header.tensors.items():
                if name in self.locations:
                    raise CoreVerificationError(
                        f"tensor {name!r} appears in both {self.locations[name].path} and {location.path}"
                    )
                self.locations[name] = location
        self.files = [header.path for header in files]

    @property
    def manifest_sha256(self) -> str:
        return hashlib.sha256(self.manifest_bytes).hexdigest()

    def size_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.files)

    def tensor_names(self) -> list[str]:
        return sorted(name for name in self.locations if not name.startswith(ASSET_PREFIX))

    def asset_names(self) -> list[str]:
        return sorted(name.removeprefix(ASSET_PREFIX) for name in self.locations if name.startswith(ASSET_PREFIX))

    def asset(self, name: str) -> bytes:
        location = self.locations.get(ASSET_PREFIX + name)
        if location is None:
            raise CoreError(f"core {self.path} has no asset {name!r}; it has: {', '.join(self.asset_names()) or 'none'}")
        return read_range(location)

    def load_tensors(
        self, device: str | torch.device = "cpu", names: Iterable[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Payload tensors (all, or `names`), memory-mapped through safetensors where the device allows."""
        wanted = self.tensor_names() if names is None else list(names)
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            if name.startswith(ASSET_PREFIX) or name not in self.locations:
                raise CoreError(f"core {self.path} has no payload tensor {name!r}")
            by_file.setdefault(self.locations[name].path, []).append(name)
        loaded: dict[str, torch.Tensor] = {}
        for path, group in by_file.items():
            with safe_open(str(path), framework="pt", device=str(device)) as file:
                for name in group:
                    loaded[name] = file.get_tensor(name)
        return {name: loaded[name] for name in wanted}

    def verify(
        self,
        trust: TrustStore,
        accept_new: Callable[[Publisher], bool] | None = None,
        *,
        progress: bool = False,
    ) -> None:
        """Check the publisher is trusted (asking `accept_new` once), then every tensor's bytes.

        The signature was checked when the core was opened.
        """
        self.check_publisher(trust, accept_new)
        self.verify_integrity(progress=progress)

    def check_publisher(self, trust: TrustStore, accept_new: Callable[[Publisher], bool] | None = None) -> None:
        """The publisher is trusted, or `accept_new` accepts it (then it is trusted from now on)."""
        if not trust.is_trusted(self.publisher):
            if accept_new is None or not accept_new(self.publisher):
                raise UntrustedPublisherError(
                    f"core {self.path} is signed by publisher {self.publisher}, which is not trusted; "
                    f"if you trust it, run again with --trust-publisher (fingerprint {self.publisher.fingerprint})"
                )
            trust.trust(self.publisher)

    def verify_integrity(self, *, progress: bool = False) -> None:
        """Every payload and asset present as the manifest lists it, with matching sha256 (no trust check)."""
        self.check_inventory()
        total = sum(location.nbytes for location in self.locations.values())
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=f"verifying {self.path.name}", disable=not progress) as bar:
            hashes = hash_locations(self.locations, bar.update)
        self.compare_hashes(hashes)

    def check_inventory(self) -> None:
        """Tensor names, dtypes and shapes equal the manifest's; no tensor missing or extra."""
        expected = self._expected_tensors()
        for name, (dtype, shape, _) in expected.items():
            location = self.locations.get(name)
            if location is None:
                raise CoreVerificationError(f"{_describe(name)} listed in the manifest is missing from {self.path}")
            if (location.dtype, location.shape) != (dtype, shape):
                raise CoreVerificationError(
                    f"{_describe(name)} in {location.path} is {location.dtype} {list(location.shape)}, "
                    f"the manifest says {dtype} {list(shape)}"
                )
        for name, location in self.locations.items():
            if name not in expected:
                raise CoreVerificationError(f"tensor {name!r} in {location.path} is not listed in the manifest")

    def compare_hashes(self, hashes: Mapping[str, str]) -> None:
        """Raise naming the first tensor whose sha256 in `hashes` differs from the manifest."""
        for name, (_, _, sha256) in self._expected_tensors().items():
            if hashes.get(name) != sha256:
                raise CoreVerificationError(f"{_describe(name)} sha256 mismatch in {self.locations[name].path}")

    def _expected_tensors(self) -> dict[str, tuple[str, tuple[int, ...], str]]:
        """File tensor name -> (dtype, shape, sha256) as the manifest declares them."""
        expected: dict[str, tuple[str, tuple[int, ...], str]] = {}
        try:
            for name, entry in self.manifest["payloads"].items():
                expected[name] = (entry["dtype"], tuple(entry["shape"]), entry["sha256"])
            for name, entry in self.manifest["assets"].items():
                expected[ASSET_PREFIX + name] = ("U8", (entry["size"],), entry["sha256"])
        except (KeyError, TypeError, AttributeError) as error:
            raise CoreVerificationError(f"manifest of {self.path} has malformed payloads/assets tables ({error!r})") from None
        return expected


def _describe(tensor_name: str) -> str:
    if tensor_name.startswith(ASSET_PREFIX):
        return f"asset {tensor_name.removeprefix(ASSET_PREFIX)!r}"
    return f"payload {tensor_name!r}"


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise CoreError(f"core form {form!r} is unknown; use one of {', '.join(FORMS)}")


def _check_export_manifest(manifest: Mapping[str, Any]) -> None:
    if not isinstance(manifest, Mapping):
        raise CoreError(f"core manifest must be a mapping, got {type(manifest).__name__}")
    reserved = [key for key in WRITER_MANIFEST_KEYS if key in manifest]
    if reserved:
        raise CoreError(f"manifest keys {reserved} are filled in by the core writer; leave them out")
    try:
        canonical_json(manifest)
    except (TypeError, ValueError) as error:
        raise CoreError(f"core manifest is not plain JSON data: {error}") from None


def _payload_entry(name: str, source: TensorSource) -> TensorEntry:
    if not isinstance(name, str) or not name or name.startswith(ASSET_PREFIX) or name == METADATA_KEY:
        raise CoreError(f"payload tensor name {name!r} is invalid: it must be non-empty and not start with {ASSET_PREFIX!r}")
    if isinstance(source, torch.Tensor):
        return TensorEntry(name, dtype_code(source.dtype), tuple(source.shape), partial(tensor_chunks, source))
    if isinstance(source, LazyTensor):
        return TensorEntry(name, dtype_code(source.dtype), tuple(source.shape), lambda: tensor_chunks(_produce(name, source)))
    raise CoreError(f"payload {name!r} must be a torch.Tensor or LazyTensor, got {type(source).__name__}")


def _produce(name: str, lazy: LazyTensor) -> torch.Tensor:
    tensor = lazy.produce()
    if tensor.dtype != lazy.dtype or tuple(tensor.shape) != tuple(lazy.shape):
        raise CoreError(
            f"payload {name!r} was declared {lazy.dtype} {list(lazy.shape)} "
            f"but produced {tensor.dtype} {list(tensor.shape)}"
        )
    return tensor


def _asset_entry(name: str, data: bytes) -> TensorEntry:
    if not isinstance(name, str) or not name:
        raise CoreError(f"asset name {name!r} is invalid: it must be a non-empty string")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CoreError(f"asset {name!r} must be bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    return TensorEntry(ASSET_PREFIX + name, "U8", (len(view),), lambda: [view])


def _signature_metadata(manifest_bytes: bytes, signature: bytes, public_key: bytes) -> dict[str, str]:
    return {
        META_MANIFEST: manifest_bytes.decode("utf-8"),
        META_SIGNATURE: base64.b64encode(signature).decode("ascii"),
        META_PUBLISHER: base64.b64encode(public_key).decode("ascii"),
    }


def _write_form(
    destination: Path,
    form: str,
    payload_entries: Sequence[TensorEntry],
    asset_entries: Sequence[TensorEntry],
    signed_metadata: Callable[[Mapping[str, str]], dict[str, str]],
    shard_bytes: int,
    on_bytes: Callable[[int], None],
) -> dict[str, str]:
    """Write the files of one form at `destination`; return sha256 per tensor name."""
    if form == PACKED:
        return write_safetensors(
            destination,
            [*payload_entries, *asset_entries],
            lambda hashes: {**signed_metadata(hashes), META_FORM: PACKED},
            on_bytes,
        )
    if shard_bytes < 1:
        raise CoreError(f"shard size limit must be at least 1 byte, got {shard_bytes}")
    shards = _split_shards(canonical_order(payload_entries), shard_bytes)
    if len(shards) > MAX_SHARDS:
        raise CoreError(f"{len(shards)} weight shards exceed the limit of {MAX_SHARDS}; raise the shard size limit")
    destination.mkdir()
    hashes: dict[str, str] = {}
    no_metadata: Callable[[Mapping[str, str]], None] = lambda _: None
    for index, shard in enumerate(shards, start=1):
        hashes |= write_safetensors(destination / shard_file_name(index, len(shards)), shard, no_metadata, on_bytes)
    hashes |= write_safetensors(destination / ASSETS_FILE, asset_entries, no_metadata, on_bytes)
    metadata = {**signed_metadata(hashes), META_FORM: DIRECTORY, META_SHARDS: str(len(shards))}
    write_safetensors(destination / PRIMARY_FILE, [], lambda _: metadata, on_bytes)
    return hashes


def _split_shards(ordered: Sequence[TensorEntry], limit: int) -> list[list[TensorEntry]]:
    """Consecutive runs of at most `limit` bytes; a larger tensor gets a shard of its own."""
    shards: list[list[TensorEntry]] = []
    size = 0
    for entry in ordered:
        if not shards or (size + entry.nbytes > limit and size > 0):
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _write_atomically(
    destination: Path,
    write: Callable[[Path, Callable[[int], None]], None],
    total_bytes: int,
    progress: bool,
    description: str,
) -> None:
    """Run `write` into a hidden sibling, then rename it to `destination`; clean up on any failure."""
    if destination.exists() or destination.is_symlink():
        raise CoreError(f"{destination} already exists; remove it or choose another destination")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.with_name(f".{destination.name}.partial-{uuid.uuid4().hex[:12]}")
    try:
        with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                  desc=description, disable=not progress) as bar:
            write(staging, bar.update)
        os.replace(staging, destination)
    except BaseException:
        if staging.is_dir():
            shutil.rmtree(staging, ignore_errors=True)
        else:
            staging.unlink(missing_ok=True)
        raise


def _required_metadata(header: SafetensorsHeader, key: str) -> str:
    value = header.metadata.get(key)
    if value is None:
        raise CoreVerificationError(
            f"{header.path} has no {key!r} in its safetensors metadata (not a Flare runtime core, or corrupt)"
        )
    return value


def _base64_metadata(header: SafetensorsHeader, key: str) -> bytes:
    text = _required_metadata(header, key)
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raw = None
    # Re-encoding must reproduce the text: padding bits are otherwise ignored by
    # the decoder and a flipped character there would go unnoticed.
    if raw is None or base64.b64encode(raw).decode("ascii") != text:
        raise CoreVerificationError(f"{key} in {header.path} is not valid base64")
    return raw


def _expect_form(header: SafetensorsHeader, form: str) -> None:
    found = _required_metadata(header, META_FORM)
    if found != form:
        raise CoreVerificationError(f"{header.path} declares core form {found!r}, expected {form!r}")


def _shard_count(primary: SafetensorsHeader) -> int:
    text = _required_metadata(primary, META_SHARDS)
    if not (text.isascii() and text.isdigit()) or str(int(text)) != text or int(text) > MAX_SHARDS:
        raise CoreVerificationError(f"{META_SHARDS} in {primary.path} is not a shard count: {text!r}")
    return int(text)
