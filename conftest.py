"""Settings for every suite of the repository (tests/, the recipe plugins' tests)."""

from __future__ import annotations

import pytest
import torch

# The torch threads a worker had before it took its share.
_THREADS = pytest.StashKey[int]()


def pytest_configure(config) -> None:
    """Under pytest-xdist, torch in each worker would start one intra-op thread per core, so the
    workers' threads outnumber the cores and wait on each other: the V4.1 and Kimi Linear suites
    took 481 s on two workers of a two-core machine, 67 s with the cores shared out. Each worker
    gets its share of the cores (restored when the worker ends)."""
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        config.stash[_THREADS] = torch.get_num_threads()
        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))


def pytest_unconfigure(config) -> None:
    if _THREADS in config.stash:
        torch.set_num_threads(config.stash[_THREADS])

