"""Facts about host buffers that backends and the engine share: direct-I/O alignment, addresses.

They live apart from any backend so that the engine lays out its staging memory for direct
writes without importing a concrete backend (``storage/local.py`` is one user of them).
"""

from __future__ import annotations

import numpy as np

# O_DIRECT wants the buffer's address, the file offset and the length in whole logical blocks
# of the device; a page is a whole number of them on every common disk.
DIRECT_ALIGN = 4096


def buffer_address(data: memoryview) -> int:
    """The address of the first byte of a contiguous buffer (0 when it is empty)."""
    return int(np.frombuffer(data, np.uint8).__array_interface__["data"][0]) if len(data) else 0
