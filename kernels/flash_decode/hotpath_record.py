"""The record flash_decode's C++ warm-path tail (``_hotpath.cpp``'s ``run()``) reads, and the C header naming it.

An entry's record is a list: ``RECORD``'s fields in order. ``header`` is ``HEADER``'s bytes (what every call of the
entry shares); each ``*_aligned``/``*_unaligned`` field is an item, None until the plan of that alignment is
memoised: ``ITEM``'s fields, a kernel's packed launch (``LAUNCH``, then its int64 and float32 values), its plan (the
compiled launch helper's bytes) and its ``fail``, then the same three for the combine kernel (None: none). A
launch's pointer slots each name a role (``ROLES``): run() writes that pointer there. ``header()`` writes all of
it as ``lt_record.h`` beside the source when it is built (``hotpath_build``); the header's text enters the
helper's source hash, so a changed layout is a new build, and the module says the layout it was built with
(``LAYOUT``) and the calling convention of its functions (``INTERFACE``): hotpath.py refuses one built with
another.
"""

from __future__ import annotations

import struct

NAME = "decode_hotpath"  # the compiled helper's name (``lazytriton.driver.helpers``: its key and cache-dir folder)
RECORD = ("header", "split_unaligned", "split_aligned", "append_unaligned", "append_aligned")
ITEM = ("launch", "plan", "fail", "combine", "combine_plan", "combine_fail")
# The pointers run() knows: the call's tensors, the lse and the workspace's two partial parts.
ROLES = ("q", "k_cache", "v_cache", "k", "v", "out", "lse", "part_out", "part_lse", "lens", "table", "key_mask")
SPANS = ("q", "k_cache", "v_cache", "k", "v", "out", "key_mask")  # the tensors whose byte spans the overlap checks read
MAX_POINTERS = 32
# out's sizes, lse's sizes, lse's numel, the largest int length, the spans; allocate_out, lens_int, the two
# strides-aligned flags.
HEADER = struct.Struct(f"<4q3qqq{len(SPANS)}q4i")
# splits, the workspace's floats before lse, the partial lse's byte offset; grid; n_ints, n_floats, n_pointers,
# length_slot; a role a pointer slot.
LAUNCH = struct.Struct(f"<3q3I4i{MAX_POINTERS}b4x")
LAYOUT = f"{HEADER.format} {LAUNCH.format} {','.join(ROLES)}"
INTERFACE = 2  # run()'s, serve()'s and remember()'s calling convention: _hotpath.cpp's LT_INTERFACE


def header() -> str:
    """``lt_record.h``: the fields' indices, the roles and spans, the structs' sizes and ``LT_LAYOUT``."""
    lines = ["// Generated from kernels/flash_decode/hotpath_record.py: the record run() reads.", "#pragma once"]
    lines += [f"#define LT_RECORD_{name.upper()} {index}" for index, name in enumerate(RECORD)]
    lines.append(f"#define LT_RECORD_SIZE {len(RECORD)}")
    lines += [f"#define LT_ITEM_{name.upper()} {index}" for index, name in enumerate(ITEM)]
    lines.append(f"#define LT_ITEM_SIZE {len(ITEM)}")
    lines += [f"#define LT_ROLE_{name.upper()} {index}" for index, name in enumerate(ROLES)]
    lines.append(f"#define LT_ROLE_COUNT {len(ROLES)}")
    lines += [f"#define LT_SPAN_{name.upper()} {index}" for index, name in enumerate(SPANS)]
    lines.append(f"#define LT_SPAN_COUNT {len(SPANS)}")
    lines += [f"#define LT_MAX_POINTERS {MAX_POINTERS}", f"#define LT_HEADER_SIZE {HEADER.size}",
              f"#define LT_LAUNCH_SIZE {LAUNCH.size}", f'#define LT_LAYOUT "{LAYOUT}"']
    return "\n".join(lines) + "\n"
