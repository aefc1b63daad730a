"""Development signing keys, publishers and the trust store."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest

from flare_core.core import CoreError, Publisher, TrustStore, fingerprint, load_or_create_signing_key
from flare_core.core.signing import KEY_FILE_NAME


def test_key_is_created_once_private_and_reloaded(tmp_path: Path) -> None:
    keys_dir = tmp_path / "config" / "keys"
    key = load_or_create_signing_key(keys_dir)
    key_file = keys_dir / KEY_FILE_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(keys_dir.stat().st_mode) == 0o700
    assert "@" in key.publisher.name  # user@host
    assert [path.name for path in keys_dir.iterdir()] == [KEY_FILE_NAME]

    again = load_or_create_signing_key(keys_dir, name="ignored-once-created")
    assert again.publisher == key.publisher
    other = load_or_create_signing_key(tmp_path / "other-keys", name="someone")
    assert other.publisher.name == "someone"
    assert other.publisher.public_key != key.publisher.public_key


def test_fingerprint_is_short_sha256_of_the_key(tmp_path: Path) -> None:
    publisher = load_or_create_signing_key(tmp_path / "keys").publisher
    expected = "ed25519:" + hashlib.sha256(publisher.public_key).hexdigest()[:16]
    assert publisher.fingerprint == fingerprint(publisher.public_key) == expected
    assert str(publisher) == f"{publisher.name} ({expected})"


def test_signatures_verify_only_for_the_signed_message_and_key(tmp_path: Path) -> None:
    key = load_or_create_signing_key(tmp_path / "a")
    other = load_or_create_signing_key(tmp_path / "b")
    signature = key.sign(b"manifest bytes")
    assert len(signature) == 64
    assert key.publisher.verify(b"manifest bytes", signature)
    assert not key.publisher.verify(b"manifest bytez", signature)
    assert not other.publisher.verify(b"manifest bytes", signature)
    assert not key.publisher.verify(b"manifest bytes", signature[:-1] + bytes([signature[-1] ^ 1]))


def test_malformed_key_file_and_key_are_reported(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    keys_dir.mkdir()
    (keys_dir / KEY_FILE_NAME).write_text(json.dumps({"name": "x", "algorithm": "rsa", "private_key": ""}))
    with pytest.raises(CoreError, match=rf"signing key file .*{KEY_FILE_NAME} is unreadable or malformed: .*'rsa'"):
        load_or_create_signing_key(keys_dir)
    with pytest.raises(CoreError, match="public key has 31 bytes"):
        Publisher("short", b"\x00" * 31)


def test_trust_store_remembers_publishers_by_full_key(tmp_path: Path) -> None:
    path = tmp_path / "config" / "trusted.json"
    alice = load_or_create_signing_key(tmp_path / "alice", name="alice").publisher
    bob = load_or_create_signing_key(tmp_path / "bob", name="bob").publisher
    store = TrustStore(path)
    assert not store.is_trusted(alice)
    assert store.publishers() == []

    store.trust(alice)
    store.trust(alice)  # idempotent
    assert TrustStore(path).is_trusted(alice)
    assert not store.is_trusted(bob)
    # A different key under a trusted name is not trusted: only the key counts.
    assert not store.is_trusted(Publisher("alice", bob.public_key))
    assert [entry.publisher for entry in store.publishers()] == [alice]

    store.trust(bob)
    store.remove(alice.fingerprint)
    assert not store.is_trusted(alice) and store.is_trusted(bob)
    with pytest.raises(CoreError, match=rf"publisher {alice.fingerprint} is not in"):
        store.remove(alice.fingerprint)


def test_trust_store_rejects_an_entry_whose_key_does_not_match_its_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "trusted.json"
    alice = load_or_create_signing_key(tmp_path / "alice", name="alice").publisher
    bob = load_or_create_signing_key(tmp_path / "bob", name="bob").publisher
    store = TrustStore(path)
    store.trust(alice)
    stored = json.loads(path.read_text())
    stored["publishers"][bob.fingerprint] = stored["publishers"].pop(alice.fingerprint)
    path.write_text(json.dumps(stored))
    with pytest.raises(CoreError, match=rf"trust store .*trusted.json is unreadable or malformed: entry {bob.fingerprint}"):
        store.is_trusted(bob)
