"""The one fixed schema between flare_core and recipe plugins: what a plugin registers, as
validated data (`types`), and the protocols of what it hands the runtime (`protocols`)."""

from flare_core.contract.protocols import *  # noqa: F403
from flare_core.contract.protocols import __all__ as _protocols
from flare_core.contract.types import *  # noqa: F403
from flare_core.contract.types import __all__ as _types

__all__ = [*_types, *_protocols]
