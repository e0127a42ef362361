"""Probe: registers, spills, shared memory and occupancy of the backward's kernels, compiled here (no GPU).

Each variant is built as the tuner builds it (``dispatch.kernel_variant`` with
a config, aligned, then ``lazytriton.compiler.compile_variant``) for a CUDA
target (sm_90 by default), with Triton's own ptxas log switched on
(``TRITON_DUMP_PTXAS_LOG``: Triton runs its bundled ptxas with ``-v``, 3.6 and
3.9 alike). From that log: registers per thread, stack frame, spill stores and
loads (bytes), and whether ptxas serialised the wgmma instructions for want of
registers (its C7512 warning). From the cubin's SASS (Triton's bundled
cuobjdump): which matrix instructions the kernel uses (``wgmma``: Hopper's
HGMMA; ``mma``: the older HMMA, mma.sync) and how many local-memory loads and
stores (LDL/STL: the spill code) it holds. Shared memory is the Entry's.
Occupancy is an estimate of CTAs per SM from registers and from shared memory
(``occupancy``).

Why: the dK/dV kernel at head dim 256 keeps two float32 accumulators of
BLOCK_N x 256, which at BLOCK_N=64 and 4 warps is 256 registers a thread before
anything else; its tuned tiles spilled kilobytes a thread and ptxas serialised
their wgmma (benchmarks/NOTES.md, "backward hd256"). A few hundred bytes of
spill are common in tiles that tuned well at head dims 64 and 128: the figures
rank candidates, the GPU decides.

Usage:
  python experiments/probe_bwd_regs.py --head-dims 64,128,256 --sweep        # tune_bwd's candidates
  python experiments/probe_bwd_regs.py --head-dims 256 --config dkdv:64/64/8/2 --config dq:128/32/8/3
  PYTHONPATH=/path/to/triton-3.6 python experiments/probe_bwd_regs.py ...      # the GPU host's Triton

A config is ``KERNEL:BLOCK_M/BLOCK_N/num_warps/num_stages`` (KERNEL dq or dkdv;
BLOCK_M is the query tile and BLOCK_N the key tile in both kernels). Without
``--sweep`` or ``--config``, dispatch's choice (table row, else default) is probed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from lazytriton.kernels import dispatch
from lazytriton.tiles import Config

KERNELS = ("flash_bwd_dq", "flash_bwd_dkdv")
SHORT = {"dq": "flash_bwd_dq", "dkdv": "flash_bwd_dkdv"}


class PtxasInfo(NamedTuple):
    """What ptxas -v says of one entry function."""

    function: str
    registers: int
    stack: int  # bytes of stack frame (spills live here)
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    wgmma_serialized: bool  # C7512: wgmma serialised for want of registers


class SmLimits(NamedTuple):
    """Per-SM resources of one CUDA target (CUDA programming guide, compute capability table)."""

    registers: int = 65536
    max_warps: int = 64
    max_ctas: int = 32
    shared: int = 228 * 1024  # per SM, of which each CTA also takes ``reserved``
    reserved: int = 1024
    reg_unit: int = 256  # registers are allocated per warp in units of 256


SM_LIMITS = {
    "sm_90": SmLimits(),
    "sm_80": SmLimits(shared=164 * 1024, max_warps=64),
    "sm_86": SmLimits(shared=100 * 1024, max_warps=48, max_ctas=16),
    "sm_89": SmLimits(shared=100 * 1024, max_warps=48, max_ctas=24),
}

_FUNCTION = re.compile(r"Function properties for (\S+)")
_COMPILING = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SERIAL = re.compile(r"C7512\).*serialized.*function '([^']+)'")


def parse_ptxas(log: str, function: str | None = None) -> PtxasInfo:
    """The figures of ``function`` (None: the first entry function) in a ``ptxas -v`` log (pure).

    The log has, per function, "Compiling entry function 'f'", "Function
    properties for f" followed by the stack/spill line, and "Used N
    registers"; the C7512 line names the function whose wgmma was serialised.
    ValueError when the log has no register count for it.
    """
    current: str | None = None
    found: dict[str, dict[str, int]] = {}
    for line in log.splitlines():
        if m := _COMPILING.search(line) or _FUNCTION.search(line):
            current = m.group(1)
            found.setdefault(current, {"stack": 0, "spill_stores": 0, "spill_loads": 0})
        elif (m := _FRAME.search(line)) and current is not None:
            found[current].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif (m := _USED.search(line)) and current is not None:
            found[current]["registers"] = int(m.group(1))
    serialized = set(_SERIAL.findall(log))
    names = [n for n, f in found.items() if "registers" in f]
    name = function if function is not None else (names[0] if names else None)
    if name is None or name not in names:
        raise ValueError(f"ptxas log has no register count for function {name!r}; functions found: {names}")
    f = found[name]
    return PtxasInfo(name, f["registers"], f["stack"], f["spill_stores"], f["spill_loads"], name in serialized)


_SASS_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def sass_ops(sass: str) -> dict[str, int]:
    """Instructions per opcode (``HGMMA``, ``HMMA``, ``LDL``...; modifiers dropped) in a SASS listing (pure)."""
    counts: dict[str, int] = {}
    for op in _SASS_OP.findall(sass):
        counts[op] = counts.get(op, 0) + 1
    return counts


def mma_kind(ops: dict[str, int]) -> str:
    """``wgmma`` (HGMMA), ``mma`` (HMMA), both joined by ``+``, or ``none`` (IEEE fp32 dots use neither)."""
    kinds = [name for op, name in (("HGMMA", "wgmma"), ("HMMA", "mma")) if ops.get(op)]
    return "+".join(kinds) or "none"


def occupancy(registers: int, num_warps: int, shared: int, limits: SmLimits | None = None) -> tuple[int, int, int]:
    """(CTAs per SM by registers, by shared memory, both) for one kernel (pure).

    Registers: each warp takes ``registers * 32`` rounded up to the unit, each
    of the 4 sub-partitions holds a quarter of the file and of a CTA's warps.
    Shared memory: the SM's shared memory over the CTA's plus its reserved KiB.
    """
    lim = limits or SmLimits()
    if registers <= 0 or num_warps <= 0:
        raise ValueError(f"registers and num_warps must be positive, got {registers} and {num_warps}")
    per_warp = -(-registers * 32 // lim.reg_unit) * lim.reg_unit
    warps_by_regs = 4 * ((lim.registers // 4) // per_warp)
    by_regs = min(warps_by_regs, lim.max_warps) // num_warps
    by_smem = lim.shared // (shared + lim.reserved) if shared > 0 else lim.max_ctas
    return by_regs, by_smem, min(by_regs, by_smem, lim.max_ctas)


class Probe(NamedTuple):
    """One compiled variant's resources."""

    kernel: str
    dtype: str
    head_dim: int
    causal: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    info: PtxasInfo | None
    shared: int
    seconds: float
    error: str = ""
    ops: dict[str, int] | None = None  # SASS opcode counts (``sass_ops``); None when cuobjdump was not there


def _sass(cubin: bytes) -> str | None:
    """The cubin's SASS from the cuobjdump Triton bundles; None where it has none."""
    import subprocess
    import tempfile

    from triton import knobs

    try:
        tool = knobs.nvidia.cuobjdump.path
    except (AttributeError, RuntimeError):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


@contextlib.contextmanager
def _ptxas_log() -> Iterator[io.StringIO]:
    """Triton prints ptxas's -v log to stdout when TRITON_DUMP_PTXAS_LOG is set: capture it."""
    old = os.environ.get("TRITON_DUMP_PTXAS_LOG")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    finally:
        if old is None:
            os.environ.pop("TRITON_DUMP_PTXAS_LOG", None)
        else:
            os.environ["TRITON_DUMP_PTXAS_LOG"] = old


def probe(kernel: str, target: str, dtype: str, head_dim: int, causal: bool, seqlen: int,
          config: Config | None) -> Probe:
    """Compile one variant as the tuner does and read its resources (``config`` None: dispatch's choice)."""
    from lazytriton.compiler import compile_variant
    from lazytriton.target import Target

    variant = dispatch.kernel_variant(kernel, Target.parse(target), dtype, head_dim, causal, True, seqlen, seqlen,
                                      config=config)
    m, n, w, s = (int(variant.get(k)) for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
    start = time.perf_counter()
    try:
        with _ptxas_log() as log:
            entry = compile_variant(variant)
        info = parse_ptxas(log.getvalue(), entry.name)
        sass = _sass(entry.binary)
    except Exception as exc:  # noqa: BLE001 (a variant that does not build is a row of the table)
        return Probe(kernel, dtype, head_dim, causal, m, n, w, s, None, 0, time.perf_counter() - start,
                     f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}")
    return Probe(kernel, dtype, head_dim, causal, m, n, w, s, info, entry.shared, time.perf_counter() - start,
                 ops=None if sass is None else sass_ops(sass))


def parse_config(text: str) -> tuple[str, Config]:
    """``dq:128/32/8/3`` -> (kernel, Config); ValueError naming the text otherwise."""
    name, _, rest = text.partition(":")
    parts = rest.split("/")
    if name not in SHORT or len(parts) != 4 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--config must be KERNEL:BLOCK_M/BLOCK_N/num_warps/num_stages with KERNEL dq or dkdv, "
                         f"got {text!r}")
    return SHORT[name], Config(*(int(p) for p in parts))


def plan(args: argparse.Namespace) -> list[tuple[str, str, int, bool, Config | None]]:
    """(kernel, dtype, head dim, causal, config) of every variant to probe, in print order."""
    from lazytriton.cli.tune import flash_bwd as tune_bwd
    from lazytriton.target import Target

    explicit = [parse_config(text) for text in args.config]
    out: list[tuple[str, str, int, bool, Config | None]] = []
    for hd in args.head_dims:
        for dtype in args.dtypes:
            for causal in args.causal:
                for kernel in args.kernels:
                    if args.sweep:
                        configs: Sequence[Config | None] = tune_bwd.candidates(
                            kernel, Target.parse(args.target), dtype, hd, args.seqlen, args.seqlen)
                    else:
                        configs = [c for k, c in explicit if k == kernel] or ([] if explicit else [None])
                    out.extend((kernel, dtype, hd, causal, c) for c in configs)
    return out


HEADER = ("kernel", "dtype", "hd", "causal", "M/N/w/s", "regs", "stack", "spill_st", "spill_ld", "wgmma_ser",
          "mma", "ldl+stl", "smem_KiB", "cta_regs", "cta_smem", "cta_sm", "warps_sm", "compile_s")


def table_row(p: Probe, limits: SmLimits) -> tuple[str, ...]:
    """One printed/CSV row of a probe (pure)."""
    tiles = f"{p.block_m}/{p.block_n}/{p.num_warps}/{p.num_stages}"
    head = (p.kernel.removeprefix("flash_bwd_"), p.dtype, str(p.head_dim), str(int(p.causal)), tiles)
    if p.info is None:
        return (*head, "error", p.error, *("",) * (len(HEADER) - len(head) - 2))
    by_regs, by_smem, ctas = occupancy(p.info.registers, p.num_warps, p.shared, limits)
    i = p.info
    return (*head, str(i.registers), str(i.stack), str(i.spill_stores), str(i.spill_loads),
            "yes" if i.wgmma_serialized else "", "?" if p.ops is None else mma_kind(p.ops),
            "?" if p.ops is None else str(p.ops.get("LDL", 0) + p.ops.get("STL", 0)), f"{p.shared / 1024:.1f}",
            str(by_regs), str(by_smem), str(ctas),
            str(ctas * p.num_warps), f"{p.seconds:.1f}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", type=_ints, default=[256])
    p.add_argument("--dtypes", type=lambda s: s.split(","), default=["bf16"])
    p.add_argument("--causal", type=lambda s: [bool(int(x)) for x in s.split(",")], default=[False, True],
                   help="0, 1 or 0,1 (default)")
    p.add_argument("--kernels", type=lambda s: [SHORT.get(x, x) for x in s.split(",")], default=list(KERNELS))
    p.add_argument("--target", default="sm_90")
    p.add_argument("--seqlen", type=int, default=4096, help="seqlen_q = seqlen_k of the variants (its bucket)")
    p.add_argument("--sweep", action="store_true", help="tune_bwd.candidates for each kernel and shape")
    p.add_argument("--config", action="append", default=[], help="KERNEL:M/N/warps/stages (repeatable)")
    p.add_argument("--csv", help="also write the rows to this CSV file")
    a = p.parse_args(argv)
    for kernel in a.kernels:
        if kernel not in KERNELS:
            raise ValueError(f"--kernels must name dq, dkdv or {KERNELS}, got {kernel!r}")
    limits = SM_LIMITS.get(a.target, SmLimits())
    import triton  # the version that compiled is part of the result

    print(f"# Triton {triton.__version__}, target {a.target}, seqlen {a.seqlen}", flush=True)
    print(" ".join(f"{h:>9}" for h in HEADER), flush=True)
    rows = []
    for kernel, dtype, hd, causal, config in plan(a):
        row = table_row(probe(kernel, a.target, dtype, hd, causal, a.seqlen, config), limits)
        rows.append(row)
        print(" ".join(f"{c:>9}" for c in row), flush=True)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            csv.writer(f).writerows([HEADER, *rows])


if __name__ == "__main__":
    main()
