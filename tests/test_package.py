"""The ``lazytriton`` package object: what ``dir()`` and ``help()`` show of it."""

from __future__ import annotations

import subprocess
import sys

import lazytriton


def test_dir_lists_the_api_and_not_the_modules_helpers() -> None:
    names = dir(lazytriton)
    assert set(lazytriton.__all__) <= set(names)
    assert names == sorted(names)
    for helper in ("Any", "TYPE_CHECKING", "importlib", "os", "sys", "annotations", "_LAZY", "_CheckoutFinder"):
        assert helper not in names
    for dunder in ("__version__", "__doc__", "__name__", "__file__", "__path__", "__spec__", "__all__"):
        assert dunder in names


def test_dir_imports_nothing() -> None:
    code = ("import sys, lazytriton; names = dir(lazytriton); "
            "assert 'flash_attn_func' in names and 'attn_fwd' in names; "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
