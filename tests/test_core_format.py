"""Runtime core files: write, read, verify, convert and the core cache."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from flare_core.core import (
    DIRECTORY,
    PACKED,
    CoreError,
    CoreFormatVersionError,
    CoreStore,
    CoreVerificationError,
    LazyTensor,
    Publisher,
    TrustStore,
    UntrustedPublisherError,
    convert_core,
    load_or_create_signing_key,
    open_core,
    write_core,
)
from flare_core.core import format as core_format
from flare_core.core.safetensors_io import TensorEntry, read_header, tensor_chunks, write_safetensors

FIXTURES = Path(__file__).parent / "fixtures"
CHAT_TEMPLATE = (FIXTURES / "chat_templates" / "Qwen-Qwen3-0.6B.jinja").read_bytes()
TOKENIZER_CONFIG = (FIXTURES / "tokenizers" / "qwen3" / "tokenizer_config.json").read_bytes()

MANIFEST = {
    "contract_version": 1,
    "recipe": {"name": "tiny-recipe", "version": "1.0.0"},
    "served_names": ["tiny-model", "tiny"],
    "architecture": {"hidden_size": 8, "note": "non-ASCII survives: façade ✓"},
}
QKV = "model.layers.0.qkv_proj.weight"


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {
        "model.embed_tokens.weight": randn(16, 8).to(torch.bfloat16),
        QKV: randn(24, 8).to(torch.float16),
        "model.layers.0.norm.weight": randn(8),
        "model.layers.0.mlp.experts.weight": randn(2, 4, 8).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.experts.scale": randn(2, 4),
        "quant.zero_points": torch.randint(-128, 128, (5,), generator=generator, dtype=torch.int8),
        "quant.codes": torch.randint(0, 256, (7,), generator=generator, dtype=torch.uint8),
        "rope.positions": torch.arange(3, dtype=torch.int32),
        "vocab.token_ids": torch.arange(5, dtype=torch.int64) * 1_000_000_007,
        "logit_scale": torch.tensor(3.5),
    }


def sample_assets() -> dict[str, bytes]:
    return {"chat_template.jinja": CHAT_TEMPLATE, "tokenizer_config.json": TOKENIZER_CONFIG}


def same_bits(left: torch.Tensor, right: torch.Tensor) -> bool:
    return (
        left.dtype == right.dtype
        and left.shape == right.shape
        and torch.equal(left.reshape(-1).view(torch.uint8), right.reshape(-1).view(torch.uint8))
    )


@pytest.fixture
def key(tmp_path: Path):
    return load_or_create_signing_key(tmp_path / "keys", name="tester@example")


@pytest.fixture
def trust(tmp_path: Path, key) -> TrustStore:
    store = TrustStore(tmp_path / "trust.json")
    store.trust(key.publisher)
    return store


def export(path: Path, key, form: str = PACKED, **options) -> Path:
    options.setdefault("tensors", sample_tensors())
    options.setdefault("assets", sample_assets())
    options.setdefault("manifest", MANIFEST)
    return write_core(path, signing_key=key, form=form, progress=False, **options)


@pytest.mark.parametrize("form", [PACKED, DIRECTORY])
def test_write_open_verify_round_trip(tmp_path: Path, key, trust: TrustStore, form: str) -> None:
    path = export(tmp_path / "tiny", key, form, shard_bytes=400)
    core = open_core(path)
    core.verify(trust)

    tensors = sample_tensors()
    assert core.form == form
    assert core.tensor_names() == sorted(tensors)
    loaded = core.load_tensors()
    for name, tensor in tensors.items():
        assert same_bits(loaded[name], tensor), name
    assert core.asset_names() == ["chat_template.jinja", "tokenizer_config.json"]
    assert core.asset("chat_template.jinja") == CHAT_TEMPLATE
    assert core.asset("tokenizer_config.json") == TOKENIZER_CONFIG

    manifest = core.manifest
    assert {key_: manifest[key_] for key_ in MANIFEST} == MANIFEST
    assert manifest["format_version"] == core_format.FORMAT_VERSION
    assert manifest["publisher"] == "tester@example"
    raw_qkv = tensors[QKV].reshape(-1).view(torch.uint8).numpy().tobytes()
    assert manifest["payloads"][QKV] == {
        "dtype": "F16", "shape": [24, 8], "sha256": hashlib.sha256(raw_qkv).hexdigest()
    }
    assert manifest["assets"]["chat_template.jinja"] == {
        "size": len(CHAT_TEMPLATE), "sha256": hashlib.sha256(CHAT_TEMPLATE).hexdigest()
    }
    assert core.publisher == key.publisher
    assert core.manifest_bytes == core_format.canonical_json(manifest)


def test_lazy_tensors_are_produced_once_in_file_order(tmp_path: Path, key, trust: TrustStore) -> None:
    tensors = sample_tensors()
    produced: list[str] = []

    def lazy(name: str) -> LazyTensor:
        def produce() -> torch.Tensor:
            produced.append(name)
            return tensors[name]

        return LazyTensor(tensors[name].dtype, tuple(tensors[name].shape), produce)

    path = export(tmp_path / "lazy.safetensors", key, tensors={name: lazy(name) for name in reversed(tensors)})
    assert sorted(produced) == sorted(tensors) and len(produced) == len(tensors)
    # Same bytes as writing the tensors directly: the caller's order does not matter.
    assert path.read_bytes() == export(tmp_path / "eager.safetensors", key).read_bytes()
    open_core(path).verify(trust)


def test_lazy_tensor_with_wrong_shape_is_refused_and_leaves_nothing(tmp_path: Path, key) -> None:
    bad = LazyTensor(torch.float32, (4,), lambda: torch.zeros(5))
    with pytest.raises(CoreError, match=r"payload 'bad' was declared torch.float32 \[4\] but produced torch.float32 \[5\]"):
        export(tmp_path / "out" / "bad.safetensors", key, tensors={"bad": bad})
    assert list((tmp_path / "out").iterdir()) == []


def test_writer_refuses_reserved_manifest_keys_and_existing_destination(tmp_path: Path, key) -> None:
    with pytest.raises(CoreError, match=r"\['payloads'\] are filled in by the core writer"):
        export(tmp_path / "a.safetensors", key, manifest={**MANIFEST, "payloads": {}})
    path = export(tmp_path / "a.safetensors", key)
    with pytest.raises(CoreError, match="already exists"):
        export(path, key)


def test_files_are_readable_by_safetensors_safe_open(tmp_path: Path, key) -> None:
    tensors = sample_tensors()
    packed = export(tmp_path / "tiny.safetensors", key)
    with safe_open(str(packed), framework="pt") as file:
        assert file.metadata()["flare.form"] == "packed"
        assert json.loads(file.metadata()["flare.manifest"])["served_names"] == ["tiny-model", "tiny"]
        assert set(file.keys()) == set(tensors) | {"asset/chat_template.jinja", "asset/tokenizer_config.json"}
        for name, tensor in tensors.items():
            assert same_bits(file.get_tensor(name), tensor), name
        assert bytes(file.get_tensor("asset/chat_template.jinja").numpy()) == CHAT_TEMPLATE

    directory = convert_core(packed, tmp_path / "tiny-dir", DIRECTORY, shard_bytes=400, progress=False)
    found: dict[str, torch.Tensor] = {}
    for path in sorted(directory.iterdir()):
        with safe_open(str(path), framework="pt") as file:
            found |= {name: file.get_tensor(name) for name in file.keys()}
            if path.name == "core.safetensors":
                assert file.metadata()["flare.form"] == "directory"
    for name, tensor in tensors.items():
        assert same_bits(found[name], tensor), name


def test_bfloat16_round_trip_is_bit_exact(tmp_path: Path, key, trust: TrustStore) -> None:
    special = torch.tensor(
        [0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 1e-40, 3.3895e38],
        dtype=torch.bfloat16,
    )
    everything = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    tensors = {"special": special, "every_bit_pattern": everything}
    for form in (PACKED, DIRECTORY):
        core = open_core(export(tmp_path / f"bf16-{form}", key, form, tensors=tensors, assets={}))
        core.verify(trust)
        loaded = core.load_tensors()
        for name, tensor in tensors.items():
            assert loaded[name].dtype == torch.bfloat16
            assert torch.equal(loaded[name].view(torch.int16), tensor.view(torch.int16)), (form, name)


def test_packed_to_directory_to_packed_is_byte_identical(tmp_path: Path, key, trust: TrustStore) -> None:
    packed = export(tmp_path / "tiny.safetensors", key)
    directory = convert_core(packed, tmp_path / "tiny-dir", DIRECTORY, shard_bytes=400, progress=False)
    shards = sorted(path.name for path in directory.glob("weights-*"))
    count = len(shards)
    assert count > 1
    assert shards == [f"weights-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]
    for shard in shards:
        header = read_header(directory / shard)
        data_bytes = sum(location.nbytes for location in header.tensors.values())
        assert data_bytes <= 400 or len(header.tensors) == 1, shard
    open_core(directory).verify(trust)

    again = convert_core(directory, tmp_path / "again.safetensors", PACKED, progress=False)
    assert again.read_bytes() == packed.read_bytes()

    # Exporting straight to directory form gives the same files as converting.
    exported_directory = export(tmp_path / "exported-dir", key, DIRECTORY, shard_bytes=400)
    for path in directory.iterdir():
        assert (exported_directory / path.name).read_bytes() == path.read_bytes(), path.name


def flip(path: Path, offset: int, new_byte: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = data[offset] ^ 0x01 if new_byte is None else new_byte
    path.write_bytes(bytes(data))


def replace_base64_char(path: Path, offset: int) -> None:
    """Change one character of a base64 text to another valid base64 character."""
    current = path.read_bytes()[offset]
    flip(path, offset, ord("A") if current != ord("A") else ord("B"))


def open_and_verify(path: Path, trust: TrustStore) -> None:
    open_core(path).verify(trust)


def offset_of(path: Path, needle: bytes) -> int:
    data = path.read_bytes()
    assert data.count(needle) == 1, needle
    return data.index(needle)


@pytest.mark.parametrize("form", [PACKED, DIRECTORY])
def test_every_flipped_byte_of_every_file_is_rejected(tmp_path: Path, key, trust: TrustStore, form: str) -> None:
    tensors = {"a.weight": torch.arange(6, dtype=torch.bfloat16), "b.bias": torch.ones(3)}
    core_path = export(tmp_path / "small", key, form, tensors=tensors, assets={"t.jinja": b"{{ x }}"})
    files = sorted(core_path.iterdir()) if form == DIRECTORY else [core_path]
    assert len(files) == (3 if form == DIRECTORY else 1)  # primary, one shard, assets
    for path in files:
        original = path.read_bytes()
        for offset in range(len(original)):
            for mask in (0x01, 0x80):
                corrupted = bytearray(original)
                corrupted[offset] ^= mask
                path.write_bytes(bytes(corrupted))
                with pytest.raises(CoreVerificationError):
                    open_and_verify(core_path, trust)
        path.write_bytes(original)
    open_and_verify(core_path, trust)


def payload_offset(path: Path, name: str) -> int:
    return read_header(path).tensors[name].offset


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("payload", rf"payload '{QKV}' sha256 mismatch in .*tiny.safetensors"),
        ("asset", r"asset 'chat_template.jinja' sha256 mismatch in .*tiny.safetensors"),
        ("manifest", r"manifest signature invalid in .*tiny.safetensors"),
        ("signature", r"manifest signature invalid in .*tiny.safetensors"),
        ("publisher", r"manifest signature invalid in .*tiny.safetensors"),
        ("header padding", r"corrupt safetensors header in .*tiny.safetensors: header bytes are not in canonical"),
        ("header json", r"corrupt safetensors header in .*tiny.safetensors: header is not valid UTF-8 JSON"),
        ("header length", r"corrupt safetensors header in .*tiny.safetensors"),
        ("form", r"declares core form 'packee', expected 'packed'"),
    ],
)
def test_flipped_byte_is_named_in_the_error(tmp_path: Path, key, trust: TrustStore, where: str, message: str) -> None:
    path = export(tmp_path / "tiny.safetensors", key)
    core = open_core(path)
    header_end = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    if where == "payload":
        flip(path, payload_offset(path, QKV) + 5)
    elif where == "asset":
        flip(path, payload_offset(path, "asset/chat_template.jinja") + 100)
    elif where == "manifest":
        flip(path, offset_of(path, b"tiny-recipe") + 2)
    elif where == "signature":
        signature = core_format._signature_metadata(b"", core.signature, b"")["flare.signature"]
        replace_base64_char(path, offset_of(path, signature.encode()) + 10)
    elif where == "publisher":
        public_key = core_format._signature_metadata(b"", b"", core.publisher.public_key)["flare.publisher"]
        replace_base64_char(path, offset_of(path, public_key.encode()) + 3)
    elif where == "header padding":
        assert path.read_bytes()[header_end - 1 : header_end] == b" "
        flip(path, header_end - 1, ord("\n"))  # still valid JSON, but not what the writer wrote
    elif where == "header json":
        flip(path, 8, ord("["))
    elif where == "header length":
        flip(path, 0)
    elif where == "form":
        flip(path, offset_of(path, b'"packed"') + 6)
    with pytest.raises(CoreVerificationError, match=message):
        open_and_verify(path, trust)


def test_flipped_byte_in_a_directory_shard_names_the_shard(tmp_path: Path, key, trust: TrustStore) -> None:
    directory = export(tmp_path / "tiny-dir", key, DIRECTORY, shard_bytes=400)
    shard = next(path for path in sorted(directory.glob("weights-*")) if QKV in read_header(path).tensors)
    flip(shard, payload_offset(shard, QKV))
    with pytest.raises(CoreVerificationError, match=rf"payload '{QKV}' sha256 mismatch in .*{shard.name}"):
        open_and_verify(directory, trust)


def rewrite_packed(path: Path, target: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write `tensors` under the original (signed) metadata of the packed core at `path`."""
    metadata = read_header(path).metadata
    entries = [
        TensorEntry(name, core_format.dtype_code(tensor.dtype), tuple(tensor.shape), lambda t=tensor: tensor_chunks(t))
        for name, tensor in tensors.items()
    ]
    write_safetensors(target, entries, lambda _: metadata, lambda _: None)


def test_missing_or_extra_tensors_are_rejected(tmp_path: Path, key, trust: TrustStore) -> None:
    path = export(tmp_path / "tiny.safetensors", key)
    with safe_open(str(path), framework="pt") as file:
        everything = {name: file.get_tensor(name) for name in file.keys()}

    missing = {name: tensor for name, tensor in everything.items() if name != QKV}
    rewrite_packed(path, tmp_path / "missing.safetensors", missing)
    with pytest.raises(CoreVerificationError, match=rf"payload '{QKV}' listed in the manifest is missing"):
        open_and_verify(tmp_path / "missing.safetensors", trust)

    extra = {**everything, "smuggled": torch.zeros(2)}
    rewrite_packed(path, tmp_path / "extra.safetensors", extra)
    with pytest.raises(CoreVerificationError, match=r"tensor 'smuggled' in .*extra.safetensors is not listed"):
        open_and_verify(tmp_path / "extra.safetensors", trust)

    reshaped = {**everything, QKV: everything[QKV].reshape(8, 24)}
    rewrite_packed(path, tmp_path / "reshaped.safetensors", reshaped)
    with pytest.raises(CoreVerificationError, match=r"is F16 \[8, 24\], the manifest says F16 \[24, 8\]"):
        open_and_verify(tmp_path / "reshaped.safetensors", trust)


def test_untrusted_publisher_is_refused_then_accepted_and_remembered(tmp_path: Path, key) -> None:
    path = export(tmp_path / "tiny.safetensors", key)
    trust = TrustStore(tmp_path / "trust" / "publishers.json")
    fingerprint = key.publisher.fingerprint

    with pytest.raises(UntrustedPublisherError, match=rf"--trust-publisher.*{fingerprint}"):
        open_and_verify(path, trust)
    asked: list[Publisher] = []

    def refuse(publisher: Publisher) -> bool:
        asked.append(publisher)
        return False

    with pytest.raises(UntrustedPublisherError):
        open_core(path).verify(trust, refuse)
    assert asked == [key.publisher] and asked[0].name == "tester@example"
    assert not trust.is_trusted(key.publisher)

    open_core(path).verify(trust, lambda publisher: True)
    reopened = TrustStore(tmp_path / "trust" / "publishers.json")
    assert reopened.is_trusted(key.publisher)
    open_core(path).verify(reopened, refuse)  # not asked again
    assert len(asked) == 1


def test_newer_format_version_is_refused_clearly(tmp_path: Path, key, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core_format, "FORMAT_VERSION", 2)
    path = export(tmp_path / "future.safetensors", key)
    monkeypatch.undo()
    with pytest.raises(CoreFormatVersionError, match="uses format version 2; this Flare reads versions up to 1"):
        open_core(path)


def test_convert_refuses_a_corrupt_source_and_leaves_nothing(tmp_path: Path, key) -> None:
    path = export(tmp_path / "tiny.safetensors", key)
    flip(path, payload_offset(path, QKV))
    with pytest.raises(CoreVerificationError, match=rf"payload '{QKV}' sha256 mismatch"):
        convert_core(path, tmp_path / "out" / "tiny-dir", DIRECTORY, progress=False)
    assert list((tmp_path / "out").iterdir()) == []


def cache_export(store: CoreStore, key, seed: int, served_names: list[str]):
    tensors = {"w": torch.full((4,), float(seed))}
    manifest = {**MANIFEST, "served_names": served_names}
    return store.add("tiny", manifest=manifest, tensors=tensors, assets={"a": b"x"}, signing_key=key, progress=False)


def test_store_default_core_is_the_latest_complete_export(tmp_path: Path, key, trust: TrustStore) -> None:
    store = CoreStore(tmp_path / "cores")
    assert store.default_core("tiny-model") is None
    first = cache_export(store, key, 1, ["tiny-model"])
    second = cache_export(store, key, 2, ["tiny-model", "tiny"])
    cache_export(store, key, 3, ["other-model"])
    assert first.name != second.name and first.name.startswith("tiny-")
    assert store.default_core("tiny-model") == second.path
    assert store.default_core("tiny") == second.path
    assert store.default_core("missing") is None

    def failing_read() -> torch.Tensor:
        raise RuntimeError("checkpoint read failed")

    broken = LazyTensor(torch.float32, (4,), failing_read)
    with pytest.raises(RuntimeError, match="checkpoint read failed"):
        store.add("tiny", manifest=MANIFEST, tensors={"w": broken}, assets={}, signing_key=key, progress=False)
    assert sorted(path.name for path in store.root.iterdir()) == sorted(
        [entry.name for entry in store.list()] + ["index.json", ".index.lock"]
    )
    assert store.default_core("tiny-model") == second.path

    entries = {entry.name: entry for entry in store.list()}
    assert len(entries) == 3
    assert entries[second.name].served_names == ("tiny-model", "tiny")
    assert (entries[second.name].recipe_name, entries[second.name].recipe_version) == ("tiny-recipe", "1.0.0")
    assert entries[second.name].recipe == "tiny-recipe 1.0.0"
    assert entries[second.name].size_bytes == sum(path.stat().st_size for path in second.path.iterdir())
    assert entries[second.name].problem is None
    open_core(store.path_for(second.name)).verify(trust)

    # Re-exporting identical content keeps the name and becomes the latest again.
    again = cache_export(store, key, 1, ["tiny-model"])
    assert again.name == first.name
    assert store.default_core("tiny-model") == first.path
    store.remove(first.name)
    assert store.default_core("tiny-model") == second.path


def test_store_imports_a_packed_core(tmp_path: Path, key, trust: TrustStore) -> None:
    packed = export(tmp_path / "tiny.safetensors", key)
    store = CoreStore(tmp_path / "cores")
    entry = store.import_core(packed, "tiny", progress=False)
    assert entry.name == f"tiny-{open_core(packed).manifest_sha256[:12]}"
    assert store.default_core("tiny-model") == entry.path
    open_core(entry.path).verify(trust)
    with pytest.raises(CoreError, match="no core named 'nope'"):
        store.path_for("nope")
