"""A kernel family's JIT miss from end to end: compiled just in time, prewarmed from the miss log, served from an image.

``jit_prewarm_serve`` runs a resolve program (one that prints a JSON report of the variants it resolved, their
sources, the compile count and the triton modules it imported) in a fresh process with this test's cache dir,
builds an image of its misses with ``lazytriton prewarm --from-misses`` (the JIT's entries reused, none compiled
again) and runs the program again in a process with an empty cache dir, the image and no JIT: every variant
served from the image, nothing compiled, triton never imported, no miss logged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import run_python

from lazytriton.cache_format.image import Image
from lazytriton.variant import Variant

EPOCH = "1700000000"


def jit_prewarm_serve(resolve: str, kernel: str, tmp_path: Path, cache_dir: Path) -> dict[str, Any]:
    """The flow above for the two variants ``resolve`` reports, the image built with ``--kernel kernel``.

    Returns the first process's report, for the family's own checks of its variants.
    """
    first = run_python(resolve)
    assert first.returncode == 0, first.stderr
    report: dict[str, Any] = json.loads(first.stdout.splitlines()[-1])
    assert report["sources"] == ["jit", "jit"], report
    misses = cache_dir / "misses.jsonl"
    assert [json.loads(line)["variant"] for line in misses.read_text().splitlines()] == report["variants"]

    image = tmp_path / f"{kernel}.ltimg"
    built = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", "--from-misses", str(misses),
                            "--kernel", kernel, "-j", "2", "--out", str(image)], capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, SOURCE_DATE_EPOCH=EPOCH), check=False)
    assert built.returncode == 0 and "2 reused, 0 compiled, 0 failed" in built.stdout, built.stdout + built.stderr
    with Image(image) as served:
        assert sorted(served.keys()) == sorted(Variant.parse(v).key() for v in report["variants"])

    empty = tmp_path / "empty-cache"
    second = run_python(resolve, {"LAZYTRITON_CACHE_DIR": str(empty), "LAZYTRITON_IMAGES": str(image),
                                  "LAZYTRITON_JIT": "0"})
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout.splitlines()[-1])
    assert again == {**report, "sources": ["image", "image"], "compiles": 0, "triton": []}
    assert not (empty / "misses.jsonl").exists()
    return report
