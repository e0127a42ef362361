"""The warm forward's records are described once: the entry's fields, the memo key's, the C++ tail's record.

``hot.ENTRY`` orders the fields of describe's entry (the templates name them, written out as indices);
``binding.PLAIN_KEY`` orders the memo key that ``binding.memo_key`` builds and describe writes out;
``hotpath_record.RECORD`` orders the record ``cpp_record`` makes and ``_hotpath.cpp`` reads through
``lt_record.h``. These tests hold each side to its description; the end-to-end checks (the warm paths launch
what the general path launches) are in test_hot.py and test_hotpath_cpp.py.
"""

from __future__ import annotations

import re

import pytest
import torch

from lazytriton import tuning
from lazytriton.kernels.flash_fwd import binding, hot, hotpath_record

CPP = hot.hotpath.__file__.replace("hotpath.py", "_hotpath.cpp")


def test_memo_key_builds_the_plain_key_in_its_described_order() -> None:
    shape = binding.Shape(2, 8, 2, 300, 5000, 96)
    key = binding.memo_key(3, torch.bfloat16, shape, True, False, True)
    expected = {"device_index": 3, "dtype": torch.bfloat16, "head_dim": 96, "causal": True, "aligned": False,
                "index64": True, "bucket_q": tuning.bucket_index(300), "bucket_k": tuning.bucket_index(5000)}
    assert len(binding.PLAIN_KEY) == len(expected) == len(key)
    assert dict(zip(binding.PLAIN_KEY, key, strict=True)) == expected


@pytest.mark.parametrize("aligned", [True, False])
def test_describe_writes_the_key_of_memo_key(aligned: bool) -> None:
    text = hot.ENTRY["key_aligned" if aligned else "key_unaligned"]
    names = {"di": 3, "dtype": torch.float16, "d": 64, "is_causal": False, "index64": False, "bucket_q": 7,
             "bucket_k": 9, "tail": ("gluon", 4)}
    shape = binding.Shape(1, 1, 1, 100, 300, 64)  # buckets 7 and 9
    assert eval(text, {}, names) == binding.memo_key(3, torch.float16, shape, False, aligned, False) + ("gluon", 4)


def test_the_templates_name_only_described_fields_and_the_text_carries_no_name() -> None:
    named = set()
    parts = (hot._TEMPLATE, hot._LOOKUP, hot._LOOKUP_CPP, hot._REMEMBER, *hot._LSE.values(), *hot._LSE_CPP.values(),
             *hot._LSE_CPP_INSIDE.values())
    for template in (text for part in parts for text in (part if isinstance(part, tuple) else (part,)) if text):
        named |= {a or b for a, b in re.findall(r"known\[([a-z_]+)\]|plan_of\(known, ([a-z_]+)\)", template)}
    assert {"floats", "launch_aligned", "cpp_record", "lse_numel"} <= named <= set(hot.FIELD), named - set(hot.FIELD)
    text = hot.source("bhsd", "forward", cpp=True, stream_inside=True)
    assert not re.search(r"known\[[a-z_]", text)
    assert f"plan_of(known, {hot.FIELD['launch_aligned']})" in text
    assert "entry = [" + ", ".join(list(hot.ENTRY.values())[:3]) in text  # the literal in ENTRY's order


def test_the_indices_follow_the_description() -> None:
    assert list(hot.FIELD) == list(hot.ENTRY) and list(hot.FIELD.values()) == list(range(len(hot.ENTRY)))
    assert hot.indexed("known[floats] plan_of(known, launch_unaligned)") == (
        f"known[{hot.FIELD['floats']}] plan_of(known, {hot.FIELD['launch_unaligned']})")
    with pytest.raises(KeyError):
        hot.indexed("known[no_such_field]")


def test_the_cpp_tail_reads_its_record_through_the_generated_header_only() -> None:
    source = open(CPP).read()
    assert '#include "lt_record.h"' in source
    assert not re.search(r"PyTuple_GET_ITEM\(record, *\d", source), "a record field read by a literal index"
    header = hotpath_record.header()
    for index, name in enumerate(hotpath_record.RECORD):
        assert f"#define LT_RECORD_{name.upper()} {index}\n" in header
    assert f"#define LT_RECORD_SIZE {len(hotpath_record.RECORD)}\n" in header
    used = set(re.findall(r"LT_RECORD_([A-Z_]+)", source)) - {"SIZE"}
    assert used <= {name.upper() for name in hotpath_record.RECORD}, used
