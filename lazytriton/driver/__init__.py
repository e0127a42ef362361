"""Drivers: load an Entry on a device and launch it, without Triton.

``cuda`` talks to libcuda and ``hip`` to libamdhip64 through cffi's ABI mode
(no compiler needed at install or run time). Both give a ``LoadedKernel``
whose ``launch`` fills a per-thread argument array and calls the driver's
launch function: the whole hot path is a few cffi calls.
"""

from __future__ import annotations

from lazytriton.cache_format import Entry
from lazytriton.driver.gpu import DriverError, LoadedKernel


def load(entry: Entry, device_index: int, dependent: bool = False) -> LoadedKernel:
    """Load ``entry``'s binary on GPU ``device_index`` (CUDA or HIP by the entry's kind).

    ``dependent``: launch it as its stream predecessor's programmatic dependent (``KernelSpec.dependent``).
    """
    from lazytriton.driver import gpu

    api = gpu.cuda() if entry.kind == "cubin" else gpu.hip()
    return api.load(entry, device_index, dependent)


__all__ = ["DriverError", "LoadedKernel", "load"]
