"""Write a tracing copy of kernels/flash_bwd/fused_kernel.py for ``probe_fused_steps.py --trace``.

The copy's kernel takes a ``Trace`` pointer (int64, 16 a program) after ``sm_scale`` and stamps %globaltimer at a
program's start (0), its partitions' start (1), K and V in (2), the first Q tile in (3), the steps done (4), the
last dQ reduction out of shared memory (8), dK and dV stored (5) and the producer's descriptors made (6), with the
SM in 7. The edits are exact-string replacements: a change to the kernel that moves one of those lines fails here
loudly (an AssertionError quoting it) rather than tracing the wrong spot.

Usage: python experiments/make_trace_kernel.py [SRC [DST]]
       (defaults: kernels/flash_bwd/fused_kernel.py, experiments/fused_trace_kernel.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def traced(s: str) -> str:
    """The tracing copy of the kernel source ``s``."""

    def rep(old: str, new: str, count: int = 1) -> None:
        nonlocal s
        n = s.count(old)
        assert n == count, (old[:70], n)
        s = s.replace(old, new)

    rep('LOG2E = gl.constexpr(1.4426950408889634)\n', '''LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _stamp(Trace, slot: gl.constexpr):
    pid = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    t = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
    gl.store(Trace + pid * 16 + slot, t)


@gluon.jit
def _stamp_sm(Trace):
    pid = gl.program_id(0) + gl.num_programs(0) * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
    sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.store(Trace + pid * 16 + 7, sm.to(gl.int64))
''')
    rep('''    group_size, heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale,
    BLOCK_M: gl.constexpr,''', '''    group_size, heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, Trace,
    BLOCK_M: gl.constexpr,''')
    rep('''heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, BLOCK_M, BLOCK_D, CAUSAL,''',
        '''heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, Trace, BLOCK_M, BLOCK_D, CAUSAL,''', 2)
    rep('''heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, BLOCK_M: gl.constexpr,''',
        '''heads_q, seqlen_q, seqlen_k, head_dim, causal_offset, sm_scale, Trace, BLOCK_M: gl.constexpr,''', 2)
    rep('''    start_n, kv_head, batch, k_smem, v_smem = kv_tile(''', '''    _stamp(Trace, 0)
    _stamp_sm(Trace)
    start_n, kv_head, batch, k_smem, v_smem = kv_tile(''', 2)
    rep('''    gl.warp_specialize([''', '''    _stamp(Trace, 1)
    gl.warp_specialize([''', 2)
    for wg in ("0", "1"):
        rep(f"CAUSAL, PREFETCH, {wg}, SPLIT)),", f"CAUSAL, PREFETCH, {wg}, SPLIT, Trace)),", 2)
    rep("m_first, n_steps, BLOCK_M, SPLIT)),", "m_first, n_steps, BLOCK_M, SPLIT, Trace)),", 2)
    rep("PREFETCH: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr):",
        "PREFETCH: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr, Trace):")
    rep("WG: gl.constexpr,\n             SPLIT: gl.constexpr):",
        "WG: gl.constexpr,\n             SPLIT: gl.constexpr, Trace):")
    rep("BLOCK_M: gl.constexpr, SPLIT: gl.constexpr):\n    \"\"\"The producer",
        "BLOCK_M: gl.constexpr, SPLIT: gl.constexpr, Trace):\n    \"\"\"The producer", 2)
    rep('''    mbarrier.wait(kv_bar.index(0), 0)
''', '''    mbarrier.wait(kv_bar.index(0), 0)
    if WG == 0:
        _stamp(Trace, 2)
''', 2)
    rep('''        mbarrier.wait(q_full.index(slot), (cur // STAGES) & 1)
''', '''        mbarrier.wait(q_full.index(slot), (cur // STAGES) & 1)
        if WG == 0:
            if cur == 0:
                _stamp(Trace, 3)
''')
    rep('''            mbarrier.wait(full.index(slot), (cur // STAGES) & 1)
''', '''            mbarrier.wait(full.index(slot), (cur // STAGES) & 1)
            if WG == 0:
                if cur == 0:
                    _stamp(Trace, 3)
''')
    rep('''    tma.store_wait(0)
    # dK and dV through''', '''    if WG == 0:
        _stamp(Trace, 4)
    tma.store_wait(0)
    if WG == 0:
        _stamp(Trace, 8)
    # dK and dV through''', 2)
    rep('''        _store_tile(dv2, dq2_smem, dv_base, stride_dvs, start_n, BLOCK_D + WG * COLS2, head_dim)
''', '''        _store_tile(dv2, dq2_smem, dv_base, stride_dvs, start_n, BLOCK_D + WG * COLS2, head_dim)
    if WG == 0:
        _stamp(Trace, 5)
''')
    rep('''row0, BLOCK_D, head_dim)
''', '''row0, BLOCK_D, head_dim)
    if WG == 0:
        _stamp(Trace, 5)
''')
    rep('''        it += any_step.to(gl.int32)
''', '''        if g == 0:
            _stamp(Trace, 6)
        it += any_step.to(gl.int32)
''')
    rep('''        for step in range(n_steps):
            row = (m_first + step) * BLOCK_M''', '''        if g == 0:
            _stamp(Trace, 6)
        for step in range(n_steps):
            row = (m_first + step) * BLOCK_M''')
    return s


def main(argv: list[str]) -> int:
    src = Path(argv[0]) if argv else ROOT / "kernels" / "flash_bwd" / "fused_kernel.py"
    dst = Path(argv[1]) if len(argv) > 1 else ROOT / "experiments" / "fused_trace_kernel.py"
    dst.write_text(traced(src.read_text()))
    print(f"{dst}: tracing copy of {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
