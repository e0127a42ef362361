"""The C API: ``liblazytriton.so`` and ``lazytriton.h`` for C and C++ programs.

``lazytriton capi build [--prefix DIR]`` compiles the library (cffi's
embedding mode: it embeds the Python it was built with) and installs it with
its header, a pkg-config file and a CMake package config; ``lazytriton capi
--prefix`` prints where they go by default. See ``capi/README.md``.

Nothing here imports cffi, torch or triton: ``build`` does when it runs, and
``embedded`` runs inside the library.
"""

from __future__ import annotations

import sys
from pathlib import Path


def default_prefix() -> Path:
    """Where ``lazytriton capi build`` installs by default.

    Inside a virtual environment, the environment itself (``lib/``,
    ``include/`` beside its Python). Otherwise a folder of the lazytriton
    cache dir named after this interpreter (``CACHE_DIR/capi/cpython-312``):
    the library is bound to the Python it was built with.
    """
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix)
    from lazytriton.config import settings

    return settings().cache_dir / "capi" / sys.implementation.cache_tag


__all__ = ["default_prefix"]
