"""Ed25519 publishers and the per-user development signing key.

Every core is signed. Until real publisher keys exist, each user gets a
development key, created on first export in a keys directory the caller
chooses (config decides it, e.g. ``~/.config/flare/keys/``). The key file is
JSON ``{"name", "algorithm": "ed25519", "private_key": <base64 32-byte seed>}``
with mode 0600 inside a 0700 directory.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import pwd
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from flare_core.core.errors import CoreError

KEY_FILE_NAME = "flare-dev-signing-key.json"
PUBLIC_KEY_BYTES = 32


def fingerprint(public_key: bytes) -> str:
    """Short, stable identifier of a public key: ``ed25519:`` + 16 hex of its sha256."""
    return "ed25519:" + hashlib.sha256(public_key).hexdigest()[:16]


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether `signature` is a valid Ed25519 signature of `message` by raw `public_key`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class Publisher:
    """Whoever signed a core: a display name and the raw 32-byte Ed25519 public key.

    Only the key identifies a publisher; the name is informational.
    """

    name: str
    public_key: bytes

    def __post_init__(self) -> None:
        if len(self.public_key) != PUBLIC_KEY_BYTES:
            raise CoreError(
                f"publisher {self.name!r} public key has {len(self.public_key)} bytes, "
                f"an Ed25519 key has {PUBLIC_KEY_BYTES}"
            )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public_key)

    def verify(self, message: bytes, signature: bytes) -> bool:
        return verify_signature(self.public_key, message, signature)

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint})"


class SigningKey:
    """An Ed25519 private key with the publisher identity it signs as."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        raw_public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.publisher = Publisher(name, raw_public)

    def sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)


def default_publisher_name() -> str:
    """``user@host`` of the current process, read from the OS (not the environment)."""
    return f"{pwd.getpwuid(os.getuid()).pw_name}@{socket.gethostname()}"


def load_or_create_signing_key(keys_dir: Path, name: str | None = None) -> SigningKey:
    """The development key in `keys_dir`, created on first use.

    `name` (default ``user@host``) is only used when the key is created; an
    existing key keeps the name stored with it.
    """
    path = Path(keys_dir) / KEY_FILE_NAME
    if not path.exists():
        _create_key_file(path, name or default_publisher_name())
    return _load_key_file(path)


def _create_key_file(path: Path, name: str) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    seed = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    content = json.dumps(
        {"name": name, "algorithm": "ed25519", "private_key": base64.b64encode(seed).decode("ascii")},
        indent=2,
    )
    # Written complete under a private temporary name (mode 0600 from the
    # start), then linked into place: a concurrent first export or a crash
    # never leaves a partial or world-readable key, and never replaces one.
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(content + "\n")
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process created the key first; use theirs
    finally:
        temporary.unlink(missing_ok=True)


def _load_key_file(path: Path) -> SigningKey:
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("algorithm") != "ed25519":
            raise ValueError(f"algorithm {stored.get('algorithm')!r} is not 'ed25519'")
        seed = base64.b64decode(stored["private_key"], validate=True)
        return SigningKey(str(stored["name"]), Ed25519PrivateKey.from_private_bytes(seed))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, binascii.Error) as error:
        raise CoreError(f"signing key file {path} is unreadable or malformed: {error}") from None
