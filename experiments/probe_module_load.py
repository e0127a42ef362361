"""What the driver charges a fresh process for its first kernel module, and for the ones after it.

The cold-start bench's split (``profile_cold.py --split``, H100) puts ~6.3 ms of one kernel's ~10 ms first call in
module loads. This probe asks whether that is a cost of the process's first module (paid once, whatever is
loaded) or of each cubin (its size, its kernel's shared memory), by timing ``cuModuleLoadData`` and
``cuModuleGetFunction`` straight through libcuda (ctypes: none of lazytriton's driver code) in fresh processes,
after torch's CUDA init and a first allocation, as the bench's processes start.

Scenarios, each in ``--reps`` fresh processes (the cubins from ``--image``: its largest entries and its smallest):

- ``large, large2, large3``: three different large cubins in turn;
- ``small, large``: the smallest cubin first, then the largest;
- ``large, large (again)``: the same cubin twice (two modules).

Each under ``CUDA_MODULE_LOADING=LAZY`` (torch's default) and ``EAGER``. Prints the median ms of each step and the
first load's share; ``--json`` writes the raw rows.

Usage: python3 experiments/probe_module_load.py --image IMAGE.ltimg [--reps 7] [--json rows.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

SCENARIOS = {"large, large2, large3": ("large", "large2", "large3"), "small, large": ("small", "large"),
             "large, large (again)": ("large", "large")}


def pick(image_path: str) -> dict[str, tuple[str, int]]:
    """The image's three largest entries and its smallest: role -> (key, binary bytes)."""
    from lazytriton.cache_format.image_reader import Image

    with Image(image_path) as image:
        sizes = sorted((image.sizes(key)[1], key) for key in image.keys())
    return {"small": (sizes[0][1], sizes[0][0]), "large": (sizes[-1][1], sizes[-1][0]),
            "large2": (sizes[-2][1], sizes[-2][0]), "large3": (sizes[-3][1], sizes[-3][0])}


def child(image_path: str, roles: list[str], keys: dict[str, str]) -> None:
    """One fresh process: torch's CUDA init, then each role's module loaded and its function found, timed."""
    import torch

    from lazytriton.cache_format.image_reader import Image

    with Image(image_path) as image:
        entries = {role: image.read(keys[role]) for role in set(roles)}
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    steps = []
    for role in roles:
        entry = entries[role]
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        rc = cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(entry.binary))
        t1 = time.perf_counter_ns()
        rc2 = cuda.cuModuleGetFunction(ctypes.byref(function), module, entry.name.encode())
        value = ctypes.c_int()
        rc3 = cuda.cuFuncGetAttribute(ctypes.byref(value), 0, function)  # MAX_THREADS_PER_BLOCK: loads it if lazy
        t2 = time.perf_counter_ns()
        c2 = time.thread_time_ns()
        if rc or rc2 or rc3:
            raise SystemExit(f"{role}: cuModuleLoadData {rc}, cuModuleGetFunction {rc2}, cuFuncGetAttribute {rc3}")
        steps.append({"role": role, "bytes": len(entry.binary), "load_ms": (t1 - t0) / 1e6,
                      "function_ms": (t2 - t1) / 1e6, "cpu_ms": (c2 - c0) / 1e6})
    print(json.dumps(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", default="")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--keys", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.image, args.child.split(","), json.loads(args.keys))
        return
    picked = pick(args.image)
    keys = {role: key for role, (key, _) in picked.items()}
    print("cubins: " + ", ".join(f"{role} {size / 1024:.0f} KiB" for role, (_, size) in picked.items()))
    rows = []
    for mode in ("LAZY", "EAGER"):
        for name, roles in SCENARIOS.items():
            for rep in range(args.reps):
                env = dict(os.environ, CUDA_MODULE_LOADING=mode)
                out = subprocess.run([sys.executable, __file__, "--image", args.image, "--child", ",".join(roles),
                                      "--keys", json.dumps(keys)], env=env, capture_output=True, text=True)
                if out.returncode:
                    raise SystemExit(out.stderr[-2000:])
                rows.append({"mode": mode, "scenario": name, "rep": rep,
                             "steps": json.loads(out.stdout.strip().splitlines()[-1])})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    print(f"\n{'mode':<6} {'scenario':<24} {'step':<8} {'KiB':>6} {'load ms':>8} {'function ms':>12} {'cpu ms':>8}")
    for mode in ("LAZY", "EAGER"):
        for name, roles in SCENARIOS.items():
            mine = [r["steps"] for r in rows if r["mode"] == mode and r["scenario"] == name]
            for i, role in enumerate(roles):
                load = statistics.median(s[i]["load_ms"] for s in mine)
                fn = statistics.median(s[i]["function_ms"] for s in mine)
                cpu = statistics.median(s[i]["cpu_ms"] for s in mine)
                print(f"{mode:<6} {name:<24} {role:<8} {mine[0][i]['bytes'] / 1024:6.0f} {load:8.3f} {fn:12.3f} "
                      f"{cpu:8.3f}")


if __name__ == "__main__":
    main()
