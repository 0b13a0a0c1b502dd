"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The built-in `tiny` checkpoint, written once under a test cache unless SPECTER_CACHE is set.
    Modules that need something else define their own `tiny`, which takes precedence."""
    import os

    from specter.builtin import builtin_path

    os.environ.setdefault("SPECTER_CACHE", str(tmp_path_factory.mktemp("cache")))
    return builtin_path("tiny")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy CI machine they lose a lot to contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
