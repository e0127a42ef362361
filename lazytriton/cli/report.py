"""What the ``cache`` reports share: the runtime they read, its images, and one way to print a report.

``ls``, ``stats``, ``verify`` and ``explain`` each compute one plain report (dicts, lists, str, int, bool,
None) and then render it: as text, or with ``--json`` as that report itself, so the two views can never
disagree.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Report = dict[str, Any]


def open_runtime() -> Any:
    from lazytriton import runtime

    return runtime.get()


def image_paths(rt: Any) -> list[Path]:
    from lazytriton.store.image import image_files

    return image_files(rt.settings.images)


def emit(args: argparse.Namespace, report: Report, render: Callable[[Report], None]) -> None:
    """Print ``report`` as one JSON object on one line (``--json``, sorted keys), else as text through ``render``."""
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        render(report)
