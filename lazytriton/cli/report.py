"""What the commands' reports share: counted nouns, the runtime they read, its images, one way to print a report.

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


def plural(n: int, singular: str, plural_form: str | None = None) -> str:
    """``1 entry``, ``2 entries``: a count and its noun in the right number."""
    if n == 1:
        return f"{n} {singular}"
    if plural_form is None:
        consonant_y = singular.endswith("y") and singular[-2:-1] not in ("a", "e", "i", "o", "u")
        plural_form = singular[:-1] + "ies" if consonant_y else singular + "s"
    return f"{n} {plural_form}"


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
