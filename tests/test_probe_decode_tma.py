"""experiments/probe_decode_tma.py on CPU: its three ways of loading K and V (pointers, device-made descriptors, one
host descriptor whose V rows past the length are zeroed) give the attention of a float32 reference through
Triton's interpreter, with NaN in the cache past every sequence's length (its timing needs a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO


def test_every_load_mode_matches_the_reference_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / "probe_decode_tma.py"), "--interpret",
                           "--lengths", "200,64", "--splits", "3", "--configs", "64x4x2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["200"], ["64"])]
    assert sorted((r[0], r[2]) for r in rows) == sorted((n, m) for n in ("200", "64")
                                                        for m in ("ptr", "tma-dev", "tma-host"))
    assert all(float(r[-1]) < 2e-2 for r in rows)
