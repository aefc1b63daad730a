"""The one fixed schema between flare_core and recipe plugins."""

from flare_core.contract.types import *  # noqa: F403
from flare_core.contract.types import __all__  # noqa: F401
