"""The benchmarks' long-format CSV: rows appended, the header written once, by every bench_*.py."""

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
