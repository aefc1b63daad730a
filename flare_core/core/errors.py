"""Exceptions raised by runtime core files, signing, trust and the core cache."""

from __future__ import annotations


class CoreError(Exception):
    """Base class: a runtime core could not be written, read or used."""


class CoreVerificationError(CoreError):
    """The core's bytes are corrupt or do not match what its publisher signed.

    The message names what failed (a payload, an asset, the manifest signature,
    a header) and the file it was found in.
    """


class UntrustedPublisherError(CoreVerificationError):
    """The core is validly signed, but by a publisher the user has not trusted."""


class CoreFormatVersionError(CoreError):
    """The core was written with a newer format version than this Flare reads."""


class CoreNotFoundError(CoreError):
    """No core with the requested name exists in the core cache."""
