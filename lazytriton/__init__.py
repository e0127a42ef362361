"""lazytriton: Triton FlashAttention kernels served from a cache.

No call waits for a compiler that could have run earlier.

The attention functions: ``flash_attn_func`` and ``flash_attn_varlen_func``
(FlashAttention-2's signatures),
``scaled_dot_product_attention`` (torch's), ``attn_fwd`` (the lower-level
call, returning the logsumexp too), ``flash_attn_with_kvcache`` (decoding),
``flash_attn_combine`` (FlashAttention-3's merge of attention over key chunks)
and ``preload`` (load kernels before a CUDA graph capture); their docstrings
are in ``lazytriton.interface`` (SDPA's in ``lazytriton.sdpa``, the KV-cache
call's in ``lazytriton.kvcache``, the combine's in ``lazytriton.combine``,
``preload``'s in ``lazytriton.preloading``). ``write_kvcache_slots`` (and
vLLM's name for it, ``reshape_and_cache_flash``) writes keys and values at
cache slots, as serving engines do every step (``lazytriton.kvcache_slots``).

``import lazytriton`` is light: it imports neither torch nor triton until an
attention function is first looked up (then torch), and triton only when
something must be compiled or interpreted.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from lazytriton import codepack

if TYPE_CHECKING:
    from importlib.machinery import ModuleSpec

__version__ = "0.1.0"

_LAZY = ("flash", "runtime", "config", "compiler", "ops", "interface", "kvcache", "combine")
# The public functions and the modules that define them (and hold their docstrings).
_HOMES = {"flash_attn_func": "interface", "flash_attn_varlen_func": "interface", "attn_fwd": "interface",
          "preload": "preloading", "CaptureError": "interface", "scaled_dot_product_attention": "sdpa",
          "flash_attn_with_kvcache": "kvcache", "trusted_indices": "kvcache", "flash_attn_combine": "combine",
          "write_kvcache_slots": "kvcache_slots", "reshape_and_cache_flash": "kvcache_slots"}


class _CheckoutFinder:
    """Finds ``lazytriton.kernels`` (and the other mapped folders) in a source checkout's top-level folders.

    pyproject maps ``kernels/``, ``cache_format/``, ``prewarm/`` and ``capi/``
    into this package. A regular install copies them inside the installed
    ``lazytriton/``, and an editable install maps them with its own finder;
    but Python started in the checkout's root (``''`` first on ``sys.path``)
    imports this folder instead of the installed package, and there
    ``lazytriton.kernels`` would not exist. This finder, appended last to
    ``sys.meta_path`` and only when running from a checkout, does the mapping.
    """

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        import importlib.util  # only in a checkout, only for these four names

        return importlib.util.spec_from_file_location(fullname, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


def _set_up_imports() -> None:
    """A regular install: its code pack's finder, where it has a pack (codepack.py); a checkout: ``_CheckoutFinder``."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "kernels")):  # an installed package: the folders are inside it
        codepack.install(here)
        return
    root = os.path.dirname(here)
    folders = {f"{__name__}.{name}": os.path.join(root, name) for name in codepack.MAPPED_FOLDERS}
    if not os.path.isfile(os.path.join(root, "pyproject.toml")) or not all(
            os.path.isfile(os.path.join(folder, "__init__.py")) for folder in folders.values()):
        return
    if not any(type(finder).__name__ == "_CheckoutFinder" for finder in sys.meta_path):
        sys.meta_path.append(_CheckoutFinder(folders))  # type: ignore[arg-type]


_set_up_imports()


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(f"lazytriton.{_HOMES[name]}"), name)
    elif name in _LAZY:
        value = importlib.import_module(f"lazytriton.{name}")
    else:
        raise AttributeError(f"module 'lazytriton' has no attribute {name!r}")
    globals()[name] = value  # later lookups are plain attribute reads
    return value


__all__ = ["__version__", *_HOMES, *_LAZY]


def __dir__() -> list[str]:
    """The public API (``__all__``, found before it is imported) and the module's dunders, not its helpers."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__") and name.endswith("__"))})
