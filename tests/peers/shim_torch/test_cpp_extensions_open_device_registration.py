"""A stand-in for PyTorch's ``test/test_cpp_extensions_open_device_registration.py`` (its other test file).

PyTorch's ``test_transformers.py`` imports two helpers from it at module level for its PrivateUse1 tests, which
build a C++ extension registering a fake device: nothing lazytriton serves. Here the import succeeds and those
tests skip, saying why; the rest of the file runs unchanged.
"""

from __future__ import annotations

import unittest
from typing import Any

REASON = "the PrivateUse1 extension is PyTorch's own device-registration test (not run against lazytriton)"


def remove_build_path() -> None:
    """Nothing was built."""


def generate_faked_module() -> Any:
    raise unittest.SkipTest(REASON)
