"""The pytest plugin of Flare's suites (entry point `pytest11`): globals every test gets back.

Compiling a model for serving (flare_core.ops.model.CompiledDecoder) raises Dynamo's process-wide
`recompile_limit` for its layer groups, as a server wants; a test that compiles must not hand the
raised limit to the tests after it on the same worker.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _restore_recompile_limit():
    import torch._dynamo

    limit = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.config.recompile_limit = limit
