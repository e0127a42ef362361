"""A prewarm worker whose compile hangs, eats memory or is killed for chosen keys (tests of the pool).

Run by the pool in place of ``lazytriton.prewarm.worker`` when a test points
``pool.WORKER_MODULE`` here. ``FAKE_SLOW_KEYS``, ``FAKE_HUNGRY_KEYS`` and
``FAKE_KILL_KEYS`` (comma-separated keys) pick the variants whose compile
never ends, asks for 64 GiB at once, or is killed (SIGKILL, as the kernel's
OOM killer would); every other variant is compiled for real. A slow compile
writes its process id to ``FAKE_PID_DIR/<key>.pid`` first, so the test can
check that the worker was killed.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from lazytriton.prewarm import worker

_real_build_one = worker.build_one


def build_one(text: str, key: str, work_path: str, created: float | None) -> None:
    if key in os.environ.get("FAKE_SLOW_KEYS", "").split(","):
        (Path(os.environ["FAKE_PID_DIR"]) / f"{key}.pid").write_text(str(os.getpid()))
        threading.Event().wait()  # a compile that never ends: only the pool's timeout stops it
    if key in os.environ.get("FAKE_HUNGRY_KEYS", "").split(","):
        hog = bytearray(64 << 30)  # far over any limit a test sets: the allocation itself fails
        del hog
    if key in os.environ.get("FAKE_KILL_KEYS", "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    _real_build_one(text, key, work_path, created)


worker.build_one = build_one

if __name__ == "__main__":
    sys.exit(worker.main(sys.argv[1:]))
