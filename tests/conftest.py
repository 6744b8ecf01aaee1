"""Suite-wide fixtures: keep process-global torch settings from leaking between tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_globals() -> Iterator[None]:
    # Code under test (the bench trainer) turns on deterministic algorithms; later tests
    # must see the defaults again.
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.set_num_threads(threads)
