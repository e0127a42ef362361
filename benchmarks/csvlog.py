"""The benchmarks' long-format CSV: rows appended, the header written once, by every bench_*.py; a GPU's peak."""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path


def append_rows(path: Path, fields: Sequence[str], rows: Iterable[Mapping[str, object]]) -> None:
    """Append ``rows`` to the CSV at ``path`` (created, with its header, if new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def run_meta(kernel: str, device: object) -> dict[str, str]:
    """The columns every benchmark row carries: kernel, GPU (or cpu), torch, triton, lazytriton, UTC time."""
    import datetime as dt

    import torch

    import lazytriton

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    on_gpu = getattr(device, "type", None) == "cuda"
    return {"kernel": kernel, "gpu": torch.cuda.get_device_name(device) if on_gpu else "cpu",
            "torch": torch.__version__, "triton": triton_version, "lazytriton": lazytriton.__version__,
            "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}


# Memory bandwidth of the GPUs the benches meet, GB/s, from the vendors' datasheets, by a part of the name torch
# reports (the first that matches): the denominator of the memory-bound benches' "% of peak".
MEMORY_PEAK_GB_S = (("H200", 4800.0), ("H100 PCIe", 2000.0), ("H100", 3350.0), ("A100-SXM4-80GB", 2039.0),
                    ("A100 80GB PCIe", 1935.0), ("A100", 1555.0), ("MI300X", 5300.0), ("MI325X", 6000.0))


def memory_peak_gb_s(gpu: str) -> float | None:
    """The datasheet memory bandwidth of the GPU named ``gpu`` (``torch.cuda.get_device_name``); None if unknown."""
    return next((peak for part, peak in MEMORY_PEAK_GB_S if part in gpu), None)
