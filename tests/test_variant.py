"""Variant and Target: parse/print round trips, validation, and the cache key's stability."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import xxhash
from conftest import run_python
from hypothesis import given, settings
from hypothesis import strategies as st

import lazytriton.keys as keys_module
import lazytriton.target as target_module
import lazytriton.variant as variant_module
from lazytriton import record
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.target import Target, target_from_cuda_capability, target_from_gcn_arch
from lazytriton.variant import KEY_LEN, LAUNCH_ABI, Variant, check_key, pairs

BASE = ("flash_fwd:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true:BLOCK_M=128,BLOCK_N=64"
        ":num_stages=3,num_warps=8")

FIXED = [
    BASE,
    "flash_fwd:sm_80:fp16:ALIGN16=false,BLOCK_D=64,CAUSAL=true,EVEN_D=false:BLOCK_M=64,BLOCK_N=32:num_stages=2,num_warps=4",
    "flash_fwd:gfx942:fp32:BLOCK_D=256:BLOCK_M=16,BLOCK_N=16:num_stages=1,num_warps=4,waves_per_eu=2",
    "flash_fwd:gfx1100:fp16:::",
    "k:sm_100:fp16:A=-5,B=0,C=999999999999999999,D=-999999999999999999:x=abc,y=Some_Name.v1-2:z=True",
    "_k9:gfx90a:bf16:mode=bottom_right::",
]


# --- parse and print -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", FIXED)
def test_parse_str_round_trip_fixed(text: str) -> None:
    v = Variant.parse(text)
    assert str(v) == text
    assert Variant.parse(str(v)) == v
    assert hash(Variant.parse(text)) == hash(v)


def test_parse_types_values() -> None:
    v = Variant.parse(BASE)
    assert v.kernel == "flash_fwd" and v.target == "sm_90" and v.dtype == "bf16"
    assert v.get("ALIGN16") is True and v.get("CAUSAL") is False
    assert v.get("BLOCK_D") == 128 and type(v.get("BLOCK_D")) is int
    assert v.get("num_warps") == 8
    assert v.constexprs == {"ALIGN16": True, "BLOCK_D": 128, "CAUSAL": False, "EVEN_D": True,
                            "BLOCK_M": 128, "BLOCK_N": 64}
    with pytest.raises(KeyError, match="nope"):
        v.get("nope")


def test_parse_strips_surrounding_whitespace() -> None:
    assert Variant.parse(f"  {BASE}\n") == Variant.parse(BASE)


def test_variant_is_frozen_and_hashable() -> None:
    v = Variant.parse(BASE)
    with pytest.raises(record.FrozenRecordError):
        v.dtype = "fp16"  # type: ignore[misc]
    assert len({v, Variant.parse(BASE)}) == 1


def test_dispatch_variants_round_trip() -> None:
    for target in ("sm_90", "sm_80", "gfx942", "gfx950"):
        for dtype in ("fp16", "bf16", "fp32"):
            for head_dim in (1, 48, 64, 80, 256):
                for causal in (False, True):
                    aligned = head_dim % 8 == 0
                    v = fwd_dispatch.flash_fwd_variant(Target.parse(target), dtype, head_dim, causal, aligned, 500)
                    assert Variant.parse(str(v)) == v
                    assert str(Variant.parse(str(v))) == str(v)


try:
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - the fixed set above still runs
    given = None

if given is not None:
    _names = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_]{0,20}\Z", fullmatch=True)
    _str_values = st.from_regex(r"\A[A-Za-z_][A-Za-z0-9_.-]{0,20}\Z", fullmatch=True).filter(
        lambda s: s not in ("true", "false"))
    _values = st.one_of(st.booleans(), st.integers(-(10**18) + 1, 10**18 - 1), _str_values)
    _pairs = st.dictionaries(_names, _values, max_size=6).map(pairs)
    _targets = st.one_of(
        st.integers(10, 999).map(lambda n: f"sm_{n}"),
        st.from_regex(r"\Agfx[1-9a-f][0-9a-f]{2,3}\Z", fullmatch=True),
    )
    _variants = st.builds(Variant, _names, _targets, st.sampled_from(["fp16", "bf16", "fp32"]), _pairs, _pairs, _pairs)

    @settings(max_examples=300, deadline=None, database=None)
    @given(_variants)
    def test_parse_str_round_trip_hypothesis(v: Variant) -> None:
        text = str(v)
        assert Variant.parse(text) == v
        assert str(Variant.parse(text)) == text


BAD = [
    "",  # no fields
    "flash_fwd:sm_90:bf16:::x",  # 7 fields
    "flash_fwd:sm_90:bf16::",  # 5 fields
    "flash-fwd:sm_90:bf16:::",  # kernel name
    "9kernel:sm_90:bf16:::",
    ":sm_90:bf16:::",
    "flash_fwd:sm_9:bf16:::",  # target
    "flash_fwd:nvidia:bf16:::",
    "flash_fwd:cuda:90:bf16:::",  # not canonical (and too many fields)
    "flash_fwd:SM_90:bf16:::",  # not canonical
    "flash_fwd:sm_90:fp8:::",  # dtype
    "flash_fwd:sm_90:BF16:::",
    "flash_fwd:sm_90:bf16:B=1,A=2::",  # unsorted
    "flash_fwd:sm_90:bf16:A=1,A=2::",  # duplicate
    "flash_fwd:sm_90:bf16:A::",  # missing '='
    "flash_fwd:sm_90:bf16:A=::",  # empty value
    "flash_fwd:sm_90:bf16:A=a b::",  # space
    "flash_fwd:sm_90:bf16:A=1.5::",  # float
    "flash_fwd:sm_90:bf16:A=1e3::",
    "flash_fwd:sm_90:bf16:A=0x10::",
    "flash_fwd:sm_90:bf16:A=1000000000000000000::",  # 19 digits: out of range
    "flash_fwd:sm_90:bf16:A=../etc::",
    "flash_fwd:sm_90:bf16:A=x/y::",
    "flash_fwd:sm_90:bf16:9A=1::",  # name
    "flash_fwd:sm_90:bf16:A-B=1::",
    "flash_fwd:sm_90:bf16:=1::",
    "flash_fwd:sm_90:bf16:" + "A" * 65 + "=1::",  # name too long
    "flash_fwd:sm_90:bf16:A=" + "a" * 65 + "::",  # value too long
    "flash_fwd:sm_90:bf16:A=1=2::",
]


@pytest.mark.parametrize("text", BAD)
def test_parse_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ValueError):
        Variant.parse(text)


@pytest.mark.parametrize("value", [None, b"flash_fwd:sm_90:bf16:::", 1])
def test_parse_rejects_non_str(value: object) -> None:
    with pytest.raises(TypeError):
        Variant.parse(value)  # type: ignore[arg-type]


def test_constructor_validates_values() -> None:
    with pytest.raises(TypeError):
        Variant("k", "sm_90", "fp16", (("A", 1.5),), (), ())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Variant("k", "sm_90", "fp16", (("A", "true"),), (), ())  # a str that would print as a bool
    with pytest.raises(ValueError):
        Variant("k", "sm_90", "fp16", (("A", 10**18),), (), ())
    with pytest.raises(ValueError):
        Variant("k", "cuda:90", "fp16", (), (), ())


# --- the key ---------------------------------------------------------------------------------------------------


def test_key_shape() -> None:
    key = Variant.parse(BASE).key()
    assert len(key) == KEY_LEN and check_key(key) == key


def test_key_encoding_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    # With a fixed fingerprint the key depends on the canonical encoding only. If this fails, the
    # encoding changed: every existing cache misses. Do that on purpose (bump LAUNCH_ABI), then update.
    monkeypatch.setattr(variant_module, "source_fingerprint", lambda kernel: "0123456789abcdef")
    v = Variant.parse(BASE)
    assert v.canonical("0123456789abcdef").startswith(b"\x99\xaelazytriton-key\x01")  # msgpack: 9-list, tag, ABI
    assert v.key() == xxhash.xxh3_128_hexdigest(v.canonical("0123456789abcdef"))
    assert LAUNCH_ABI == 1
    assert v.key() == "c7cd8aead2e20bd9655edb29ddefb28a"


_KEY_CODE = """
import json, os
from lazytriton.variant import Variant
texts = json.loads(os.environ["VARIANTS"])
print(json.dumps([Variant.parse(t).key() for t in texts]))
"""


def test_key_stable_across_processes_and_independent_of_environment(tmp_path: Path) -> None:
    texts = FIXED[:3]
    here = [Variant.parse(t).key() for t in texts]
    elsewhere = tmp_path / "elsewhere"
    home = tmp_path / "home"
    elsewhere.mkdir()
    home.mkdir()
    code = f"import os; os.chdir({str(elsewhere)!r})\n" + _KEY_CODE
    env = {"VARIANTS": json.dumps(texts), "HOME": str(home), "USER": "someone_else", "LOGNAME": "someone_else",
           "LAZYTRITON_CACHE_DIR": str(tmp_path / "other-cache"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "PYTHONHASHSEED": "12345"}
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == here


def test_key_changes_when_any_field_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(variant_module, "source_fingerprint", lambda kernel: "fixed")
    base = Variant.parse(BASE)
    changed = [
        record.replace(base, kernel="other_kernel"),
        record.replace(base, target="sm_80"),
        record.replace(base, target="gfx942"),
        record.replace(base, dtype="fp16"),
        record.replace(base, dtype="fp32"),
        record.replace(base, options=()),
        record.replace(base, tuned=()),
        record.replace(base, functional=()),
        record.replace(base, options=base.options + (("waves_per_eu", 2),)),
    ]
    for group in ("functional", "tuned", "options"):
        items = getattr(base, group)
        for i, (name, value) in enumerate(items):
            if isinstance(value, bool):
                new: object = not value
            else:
                new = value * 2
            bumped = items[:i] + ((name, new),) + items[i + 1:]
            changed.append(record.replace(base, **{group: bumped}))
            # Same value with another type: bool and int must not collide (True vs 1).
            if isinstance(value, bool):
                retyped = items[:i] + ((name, int(value)),) + items[i + 1:]
                changed.append(record.replace(base, **{group: retyped}))
            # Dropping a field changes the key too.
            changed.append(record.replace(base, **{group: items[:i] + items[i + 1:]}))
    # A field moved to another group is a different variant.
    moved = record.replace(base, tuned=(("BLOCK_M", 128),), options=pairs({"BLOCK_N": 64, **dict(base.options)}))
    changed.append(moved)
    keys = [v.key() for v in changed]
    assert base.key() not in keys
    assert len(set(keys)) == len(keys), "two different variants share a key"


def test_keys_of_all_dispatch_variants_are_distinct() -> None:
    variants = {
        fwd_dispatch.flash_fwd_variant(Target.parse(t), dt, hd, c, a, sq, index64=i)
        for t in ("sm_90", "sm_80", "gfx942", "gfx950") for dt in ("fp16", "bf16", "fp32")
        for hd in (16, 32, 48, 64, 128, 256) for c in (False, True) for a in (False, True) for sq in (1, 64, 4096)
        for i in (False, True)
    }
    assert len({v.key() for v in variants}) == len(variants)


def test_key_changes_with_source_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    v = Variant.parse(BASE)
    real = v.key()
    monkeypatch.setattr(variant_module, "source_fingerprint", lambda kernel: "aaaaaaaaaaaaaaaa")
    first = v.key()
    monkeypatch.setattr(variant_module, "source_fingerprint", lambda kernel: "aaaaaaaaaaaaaaab")
    second = v.key()
    assert len({real, first, second}) == 3


def test_key_uses_the_kernels_real_fingerprint() -> None:
    from lazytriton.kernels import source_fingerprint

    v = Variant.parse(BASE)
    assert v.key() == xxhash.xxh3_128_hexdigest(v.canonical(source_fingerprint("flash_fwd")))


GOOD_KEY = "0123456789abcdef0123456789abcdef"


def test_check_key_accepts_a_key() -> None:
    assert check_key(GOOD_KEY) == GOOD_KEY


@pytest.mark.parametrize("key", [
    "../x", "../" + GOOD_KEY[3:], GOOD_KEY.upper(), GOOD_KEY[:-1], GOOD_KEY + "0", "", GOOD_KEY[:-1] + "g",
    GOOD_KEY + "\n", "/" + GOOD_KEY[1:], GOOD_KEY[:16] + "/" + GOOD_KEY[17:], GOOD_KEY[:-1] + "\0",
    None, 1, GOOD_KEY.encode(),
])
def test_check_key_rejects(key: object) -> None:
    with pytest.raises(ValueError):
        check_key(key)


# --- the forms, tested as plain strings: the same answers as the patterns they stand for -------------------------

# Digits, letters around the hex range, the separators a variant uses, other scripts' digits (the patterns' \\d takes
# them) and characters a pattern could stumble on.
FORM_CHARS = "0123456789abcdefgxzABFGZ_.-:= \n\x00\u0669\u0660\u00b2\u00e9"
FORMS = [
    (keys_module.is_key, r"[0-9a-f]{32}"),
    (variant_module._is_name, r"[A-Za-z_][A-Za-z0-9_]{0,63}"),
    (variant_module._is_str_value, r"[A-Za-z_][A-Za-z0-9_.-]{0,63}"),
    (variant_module._is_int, r"-?\d{1,18}"),
    (target_module._is_sm, r"sm_([1-9]\d{1,2})"),
    (target_module._is_gfx, r"gfx[0-9a-f]{3,4}"),
]


def _near(pattern: str) -> st.SearchStrategy[str]:
    """Strings the pattern takes, each possibly edited by one character: both sides of its edge."""
    def edit(text: str, data: st.DataObject) -> str:
        i = data.draw(st.integers(0, len(text)))
        how = data.draw(st.sampled_from(["keep", "insert", "replace", "delete"]))
        c = data.draw(st.sampled_from(FORM_CHARS))
        return {"keep": text, "insert": text[:i] + c + text[i:], "replace": text[:i] + c + text[i + 1:],
                "delete": text[:i] + text[i + 1:]}[how]

    return st.builds(edit, st.from_regex(pattern, fullmatch=True), st.data())


@pytest.mark.parametrize(("test", "pattern"), FORMS, ids=[test.__name__ for test, _ in FORMS])
@settings(max_examples=400, deadline=None, database=None)
@given(data=st.data())
def test_each_form_answers_as_its_pattern(test: Any, pattern: str, data: st.DataObject) -> None:
    text = data.draw(st.one_of(_near(pattern), st.text(FORM_CHARS, max_size=70)))
    assert test(text) == bool(re.fullmatch(pattern, text)), text


def test_the_forms_at_their_bounds() -> None:
    assert keys_module.is_key("0" * 32) and not keys_module.is_key("0" * 31) and not keys_module.is_key(None)
    assert variant_module._is_name("a" * 64) and not variant_module._is_name("a" * 65)
    assert variant_module._is_str_value("a.b-c") and not variant_module._is_str_value("-a")
    assert variant_module._is_int("-" + "9" * 18) and not variant_module._is_int("9" * 19)
    assert not variant_module._is_int("-") and not variant_module._is_int("")
    assert target_module._is_sm("sm_100") and not target_module._is_sm("sm_090")
    assert target_module._is_gfx("gfx90a") and not target_module._is_gfx("gfx90A")


# --- Target ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "canonical", "backend", "warp_size", "kind"), [
    ("sm_90", "sm_90", "cuda", 32, "cubin"),
    ("sm_80", "sm_80", "cuda", 32, "cubin"),
    ("sm_100", "sm_100", "cuda", 32, "cubin"),
    ("cuda:90", "sm_90", "cuda", 32, "cubin"),
    (" SM_86 ", "sm_86", "cuda", 32, "cubin"),
    ("gfx942", "gfx942", "hip", 64, "hsaco"),
    ("gfx950", "gfx950", "hip", 64, "hsaco"),
    ("gfx90a", "gfx90a", "hip", 64, "hsaco"),
    ("hip:gfx942", "gfx942", "hip", 64, "hsaco"),
    ("gfx1100", "gfx1100", "hip", 32, "hsaco"),
])
def test_target_parse(text: str, canonical: str, backend: str, warp_size: int, kind: str) -> None:
    t = Target.parse(text)
    assert str(t) == canonical
    assert Target.parse(str(t)) == t
    assert (t.backend, t.warp_size, t.binary_kind) == (backend, warp_size, kind)


def test_target_capability_and_device_helpers() -> None:
    assert Target.parse("sm_90").capability == 90
    assert Target.parse("gfx942").capability == 0
    assert target_from_cuda_capability(9, 0) == Target.parse("sm_90")
    assert target_from_cuda_capability(8, 0) == Target.parse("cuda:80")
    assert target_from_gcn_arch("gfx942:sramecc+:xnack-") == Target.parse("gfx942")


@pytest.mark.parametrize("text", [
    "", "sm_", "sm_9", "sm_1000", "sm90", "sm_90a", "sm_9x", "sm_090", "cuda:", "cuda:9", "cuda:gfx942", "hip:sm_90",
    "gfx", "gfx94", "gfx94g", "gfx12345", "nvidia", "h100", "sm_90 sm_80", "../sm_90",
])
def test_target_rejects_junk(text: str) -> None:
    with pytest.raises(ValueError):
        Target.parse(text)


@pytest.mark.parametrize("value", [None, 90, b"sm_90"])
def test_target_rejects_non_str(value: object) -> None:
    with pytest.raises(TypeError):
        Target.parse(value)  # type: ignore[arg-type]


# --- check_fields: a parsed variant against its kernel's description -------------------------------------------

CHECK_BAD = [
    ("flash_fwd:sm_90:fp16:::", "lacks BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, CAUSAL, num_warps, num_stages"),
    (BASE.replace("BLOCK_N=64", ""), "lacks BLOCK_N"),
    (BASE.replace(":num_stages=3,num_warps=8", ":num_warps=8"), "lacks num_stages"),
    (BASE.replace("BLOCK_M=128", "BLOCK_M=48"), "BLOCK_M=48 must be a power of two"),
    (BASE.replace("BLOCK_M=128", "BLOCK_M=0"), "BLOCK_M=0 must be a power of two"),
    (BASE.replace("BLOCK_M=128", "BLOCK_M=true"), "BLOCK_M=true must be a power of two"),
    (BASE.replace("CAUSAL=false", "CAUSAL=1"), "CAUSAL=1 must be true or false"),
    (BASE.replace("ALIGN16=true", "ALIGN16=yes"), "ALIGN16=yes must be true or false"),
    (BASE.replace("EVEN_D=true", "EVEN_D=true,XTRA=1"), "unknown fields XTRA"),
    (BASE.replace("num_warps=8", "num_warps=8,zz=1"), "unknown fields zz"),
    (BASE.replace("num_warps=8", "num_warps=6"), "num_warps=6 must be a power of two"),
    (BASE.replace("num_stages=3", "num_stages=99"), "num_stages=99 must be an integer in 1..8"),
    ("nope:sm_90:fp16:::", "unknown kernel 'nope'"),
]


@pytest.mark.parametrize(("text", "needle"), CHECK_BAD)
def test_check_fields_names_what_is_wrong(text: str, needle: str) -> None:
    variant = Variant.parse(text)  # well-formed: parse checks syntax only, for any kernel
    with pytest.raises(ValueError) as caught:
        variant_module.check_fields(variant)
    assert needle in str(caught.value)


def test_check_fields_passes_every_dispatch_variant() -> None:
    for target in ("sm_90", "sm_80", "gfx942"):
        for dtype in ("fp16", "fp32"):
            for head_dim in (1, 80, 256):
                v = fwd_dispatch.flash_fwd_variant(Target.parse(target), dtype, head_dim, True, False, 16, index64=True)
                assert variant_module.check_fields(v) is v
    assert variant_module.check_fields(Variant.parse(BASE)) == Variant.parse(BASE)  # INDEX64 may be absent


def test_a_kernel_source_reads_the_same_with_either_line_ending(tmp_path: Path) -> None:
    from lazytriton.kernels import source_bytes

    plain, crlf, lone = tmp_path / "plain.py", tmp_path / "crlf.py", tmp_path / "lone.py"
    plain.write_bytes(b"a = 1\nb = 2\n")
    crlf.write_bytes(b"a = 1\r\nb = 2\r\n")
    lone.write_bytes(b"a = 1\rb = 2\n")  # a lone \r is not a line ending here: kept
    assert source_bytes(plain) == source_bytes(crlf) == b"a = 1\nb = 2\n"
    assert source_bytes(lone) == b"a = 1\rb = 2\n"
