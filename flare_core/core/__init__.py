"""Runtime core files: write/read/verify/sign, the core cache, form conversion."""

from flare_core.core.errors import (
    CoreError,
    CoreFormatVersionError,
    CoreNotFoundError,
    CoreVerificationError,
    UntrustedPublisherError,
)
from flare_core.core.format import (
    DEFAULT_SHARD_BYTES,
    DIRECTORY,
    FORMAT_VERSION,
    FORMS,
    PACKED,
    LazyTensor,
    RuntimeCore,
    TensorSource,
    canonical_json,
    convert_core,
    open_core,
    write_core,
)
from flare_core.core.signing import Publisher, SigningKey, fingerprint, load_or_create_signing_key
from flare_core.core.store import CoreEntry, CoreStore, core_name
from flare_core.core.trust import TrustedPublisher, TrustStore

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "DIRECTORY",
    "FORMAT_VERSION",
    "FORMS",
    "PACKED",
    "CoreEntry",
    "CoreError",
    "CoreFormatVersionError",
    "CoreNotFoundError",
    "CoreStore",
    "CoreVerificationError",
    "LazyTensor",
    "Publisher",
    "RuntimeCore",
    "SigningKey",
    "TensorSource",
    "TrustStore",
    "TrustedPublisher",
    "UntrustedPublisherError",
    "canonical_json",
    "convert_core",
    "core_name",
    "fingerprint",
    "load_or_create_signing_key",
    "open_core",
    "write_core",
]
