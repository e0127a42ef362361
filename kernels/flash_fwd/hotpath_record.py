"""The record the C++ warm-path tail's ``run()`` reads: its fields, in order, and the C header that names them.

``kernels/flash_fwd/hot.py``'s ``cpp_record`` builds the record in this order; ``_hotpath.cpp`` reads it through
``lt_record.h``, written from ``RECORD`` beside the source when it is built (``hotpath_build``), and the header's
text is part of the helper's source hash: the two sides cannot disagree, and a changed layout is a new build.
"""

from __future__ import annotations

# template: the packed template bytes (hot.CPP_TEMPLATE, then the int64 and float32 values); plan_*: the compiled
# launch helper's plan of the kernel for 16-byte aligned pointers and for the others (None: none memoised);
# fail_*: the kernel's ``fail(status, grid)``, which raises its launch error; restock: the lse stocks' refill, or
# None. Each *_unaligned field follows its *_aligned one.
NAME = "hotpath"  # the compiled helper's name (``lazytriton.driver.helpers``: its key and cache-dir folder)
RECORD = ("template", "plan_aligned", "plan_unaligned", "fail_aligned", "fail_unaligned", "restock")


def header() -> str:
    """``lt_record.h``: one ``LT_RECORD_<FIELD>`` index a field, and ``LT_RECORD_SIZE``."""
    lines = ["// Generated from kernels/flash_fwd/hotpath_record.py's RECORD: the fields of run()'s record, in order.",
             "#pragma once"]
    lines += [f"#define LT_RECORD_{name.upper()} {index}" for index, name in enumerate(RECORD)]
    lines.append(f"#define LT_RECORD_SIZE {len(RECORD)}")
    return "\n".join(lines) + "\n"
