"""Variant: everything that decides a binary, and the cache key derived from it.

A Variant is a frozen value with named fields. ``str(v)`` prints it in one line
and ``Variant.parse(str(v)) == v``:

    flash_fwd:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true:BLOCK_M=128,BLOCK_N=64:num_stages=3,num_warps=8

The fields are kernel, target, dtype, then three groups of ``name=value``
pairs, each sorted by name: functional (they change what is computed or what
the binary may assume), tuned (block sizes: change speed only) and compile
options. Values are ints, bools or short strings.

The key is xxh3-128 over a canonical, type-tagged msgpack encoding of the
fields, the kernel's source fingerprint and the launch ABI version. It holds no
path, user or host name, so a cache copied to another machine or folder still
hits. The compiler version is deliberately left out: an entry carries its own
launch metadata and runs wherever the driver can load it (see ARCHITECTURE).
"""

from __future__ import annotations

from collections.abc import Mapping

import xxhash

from lazytriton.cache_format import mpack
from lazytriton.kernels import source_fingerprint
from lazytriton.keys import KEY_LEN as KEY_LEN  # re-exported: the key's form, variant.KEY_LEN
from lazytriton.keys import check_key as check_key  # re-exported: variant.check_key
from lazytriton.record import record
from lazytriton.target import Target
from lazytriton.tma import require_tma

# Bump when the way entries are launched changes (parameter order, hidden
# arguments, grid convention): old entries then miss instead of misbehaving.
LAUNCH_ABI = 1

Value = bool | int | str
Pairs = tuple[tuple[str, Value], ...]

DTYPES = ("fp16", "bf16", "fp32", "e4m3", "e5m2")  # torch.float8_e4m3fn, float8_e5m2 (kernels.TRITON_DTYPES)


# The forms of names and values, as plain string tests (no pattern compiled at import): a name is
# [A-Za-z_][A-Za-z0-9_]{0,63}, a string value [A-Za-z_][A-Za-z0-9_.-]{0,63}, an int -?\d{1,18}.
def _is_name(text: str) -> bool:
    return len(text) <= 64 and text.isascii() and text.isidentifier()


def _is_str_value(text: str) -> bool:
    return (len(text) <= 64 and text.isascii() and text[:1] not in (".", "-")
            and text.replace(".", "_").replace("-", "_").isidentifier())


def _is_int(text: str) -> bool:
    digits = text[1:] if text[:1] == "-" else text
    return 1 <= len(digits) <= 18 and digits.isdecimal()


def _format_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _parse_value(text: str) -> Value:
    if text == "true":
        return True
    if text == "false":
        return False
    if _is_int(text):
        return int(text)
    if _is_str_value(text) and text not in ("true", "false"):
        return text
    raise ValueError(f"bad variant value {text!r}")


def _check_pairs(group: str, pairs: Pairs) -> Pairs:
    names = [name for name, _ in pairs]
    if names != sorted(names) or len(set(names)) != len(names):
        raise ValueError(f"variant {group} names must be sorted and unique, got {names}")
    for name, value in pairs:
        if not _is_name(name):
            raise ValueError(f"bad variant {group} name {name!r}")
        if not isinstance(value, (bool, int, str)):
            raise TypeError(f"variant {group} value {name}={value!r} must be bool, int or str")
        if isinstance(value, str) and (not _is_str_value(value) or value in ("true", "false")):
            raise ValueError(f"bad variant {group} value {name}={value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**18:
            raise ValueError(f"variant {group} value {name}={value} is out of range")
    return pairs


def pairs(mapping: Mapping[str, Value]) -> Pairs:
    """Sorted ``(name, value)`` pairs from a dict, the form Variant fields take."""
    return tuple(sorted(mapping.items()))


@record
class Variant:
    """One compiled form of one kernel: what the key is made of."""

    kernel: str
    target: str
    dtype: str
    functional: Pairs
    tuned: Pairs
    options: Pairs

    def __post_init__(self) -> None:
        if not _is_name(self.kernel):
            raise ValueError(f"bad variant kernel name {self.kernel!r}")
        Target.parse(self.target)  # raises on a bad name
        if str(Target.parse(self.target)) != self.target:
            raise ValueError(f"variant target must be canonical ({Target.parse(self.target)}), got {self.target!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"variant dtype must be one of {DTYPES}, got {self.dtype!r}")
        _check_pairs("functional", self.functional)
        _check_pairs("tuned", self.tuned)
        _check_pairs("options", self.options)

    @classmethod
    def parse(cls, text: str) -> Variant:
        """Parse the one-line form that ``str()`` prints."""
        if not isinstance(text, str):
            raise TypeError(f"variant must be a str, got {type(text).__name__}")
        parts = text.strip().split(":")
        if len(parts) != 6:
            raise ValueError(f"variant must have 6 ':'-separated fields, got {len(parts)} in {text!r}")
        kernel, target, dtype, *groups = parts
        parsed: list[Pairs] = []
        for group in groups:
            items: list[tuple[str, Value]] = []
            for item in filter(None, group.split(",")):
                name, sep, value = item.partition("=")
                if not sep:
                    raise ValueError(f"variant field {item!r} must be name=value in {text!r}")
                items.append((name, _parse_value(value)))
            parsed.append(tuple(items))
        return cls(kernel, target, dtype, parsed[0], parsed[1], parsed[2])

    def __str__(self) -> str:
        groups = [",".join(f"{n}={_format_value(v)}" for n, v in group)
                  for group in (self.functional, self.tuned, self.options)]
        return ":".join([self.kernel, self.target, self.dtype, *groups])

    def get(self, name: str) -> Value:
        """The value of a functional, tuned or option field, by name."""
        for group in (self.functional, self.tuned, self.options):
            for field_name, value in group:
                if field_name == name:
                    return value
        raise KeyError(f"variant {self} has no field {name!r}")

    @property
    def constexprs(self) -> dict[str, Value]:
        """Functional and tuned fields together, as the compiler takes them."""
        return dict(self.functional + self.tuned)

    def canonical(self, fingerprint: str) -> bytes:
        """The type-tagged bytes the key hashes (msgpack keeps bool, int and str apart)."""
        groups = [[list(p) for p in g] for g in (self.functional, self.tuned, self.options)]
        record = ["lazytriton-key", LAUNCH_ABI, fingerprint, self.kernel, self.target, self.dtype, *groups]
        return mpack.packb(record)

    def key(self) -> str:
        """The cache key: 32 hex digits of xxh3-128 over the canonical encoding."""
        return xxhash.xxh3_128_hexdigest(self.canonical(source_fingerprint(self.kernel)))


# Flags: boolean fields that may be absent, meaning false. ALIGN16, SEQ16 and
# INDEX64 are read by the compiler (parameter attributes and types: SEQ16 marks
# the backward's seqlens and lse strides 16-divisible, and comes only with
# ALIGN16, on kernels whose description has such parameters); TMA is also one of
# flash_fwd's constexprs, passed to the kernel (false when absent, so variant
# strings written before it keep their meaning: the pointer kernel). WINDOW
# (sliding window) and SOFTCAP (logit softcapping) are constexprs of all three
# attention kernels, absent meaning off, for the same reason; so are ALIBI, BIAS
# and DROPOUT (ALiBi slopes, an additive bias, dropout), VARLEN (packed
# sequences) with SEQUSED_Q and SEQUSED_K (each sequence's used query and key
# lengths, FlashAttention-3's seqused_q/seqused_k: only with VARLEN), and PAGED
# (a block table), LEFTPAD (cache_leftpad: each sequence's first key),
# PAGE_GATHER (pages not a multiple of 64 keys: each key's page read from the
# table) and ROTARY with ROTARY_INTERLEAVED (rotary_cos/rotary_sin: pairs, else
# halves; also kv_append's) of the decoding kernels (kernels/flash_decode); SINKS (attention sinks: one logit a
# query head in every row's denominator) of the forward kernels and the decoding kernels; VARLEN_Q (queries
# packed by cu_seqlens_q) of the decoding split kernel. BIAS_GRAD (the bias's gradient written by the backward's
# dQ kernel, with BIAS) is flash_bwd_dq's alone. CHUNK (FlashAttention-3's attention_chunk: each query sees the keys
# of its own chunk; the size a runtime argument) is flash_fwd's, flash_bwd_dq's, flash_bwd_dkdv's and the decoding
# split kernel's. QV (FlashAttention-3's qv, DeepSeek's MLA: the scores add qv . v, v's tile read once for both
# products) and KEY_MASK (a per-(batch, key) boolean mask: a transformers decoding step's) are the decoding split
# kernel's.
_FLAGS = ("ALIGN16", "SEQ16", "INDEX64", "TMA", "WINDOW", "SOFTCAP", "PAGED", "ALIBI", "BIAS", "DROPOUT", "VARLEN",
          "LEFTPAD", "PAGE_GATHER", "SEQUSED_Q", "SEQUSED_K", "ROTARY", "ROTARY_INTERLEAVED", "SINKS", "BIAS_GRAD",
          "VARLEN_Q", "CHUNK", "QV", "KEY_MASK")
# Fields that may be absent, meaning "the same as another field": the value head dim's tile and
# evenness (BLOCK_DV, EVEN_DV) of the attention kernels are written only where they differ from
# the query/key head dim's (BLOCK_D, EVEN_D), so the strings of equal-dim calls are what they were.
_SAME_AS = {"BLOCK_DV": "BLOCK_D", "EVEN_DV": "EVEN_D"}
# Tiles that may be absent, meaning 0 (off): flash_fwd's second head-dim chunk (split tiles), and
# flash_fwd_gluon's query tiles per program (absent: its BLOCK_M rows are one tile).
_ZERO_IF_ABSENT = ("BLOCK_D2", "BLOCK_TILES")
# Fields that take one of a few names and may be absent, meaning the first: KV_FP8, the float8 format of the
# KV cache the decoding split kernel reads and kv_append writes (kernels/flash_decode/kv_fp8.py), absent for a
# cache of the queries' dtype.
_CHOICES: dict[str, tuple[str, ...]] = {"KV_FP8": ("none", "e4m3", "e5m2")}
# maxnreg: registers a thread (Triton's CUDA option; flash_decode's split kernel caps its feature variants)
_OPTIONS: dict[str, tuple[int, int]] = {"num_warps": (1, 32), "num_stages": (1, 8), "waves_per_eu": (0, 16),
                                        "maxnreg": (24, 255)}
_REQUIRED_OPTIONS = ("num_warps", "num_stages")
_MAX_BLOCK = 1 << 16


def _check_constexpr(variant: Variant, name: str, value: Value, wide: bool = False) -> None:
    """Refuse a constexpr value of the wrong kind (ValueError naming it).

    ``wide``: the kernel's ``wide_blocks`` names this field, which may also be
    three times a power of two of at least 16 (three parts of whole warps' rows).
    """
    if name.startswith("BLOCK_"):
        part = value // 3 if wide and isinstance(value, int) and value % 3 == 0 and value >= 48 else value
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _MAX_BLOCK \
                or part & (part - 1):  # type: ignore[operator]
            raise ValueError(f"variant {variant}: {name}={_format_value(value)} must be a power of two "
                             f"{'(or three times one of at least 16) ' if wide else ''}in 1..{_MAX_BLOCK}")
    elif name in _CHOICES:
        if value not in _CHOICES[name]:
            raise ValueError(f"variant {variant}: {name}={_format_value(value)} must be one of "
                             f"{', '.join(_CHOICES[name])}")
    elif not isinstance(value, bool):
        raise ValueError(f"variant {variant}: {name}={_format_value(value)} must be true or false")


def check_fields(variant: Variant) -> Variant:
    """Return ``variant`` if it has every field its kernel needs, with values of the right kind; else ValueError.

    ``Variant.parse`` checks syntax only, for any kernel; this checks a parsed
    variant against its kernel's description before anything compiles it, so
    that ``flash_fwd:sm_90:fp16:::`` (a well-formed string naming no tile
    sizes) is refused with the missing fields named instead of failing as a
    KeyError deep in the compiler.
    """
    from lazytriton.kernels import get

    spec = get(variant.kernel)  # ValueError names an unknown kernel
    constexprs = variant.constexprs
    missing = [name for name in spec.constexprs if name not in constexprs and name not in _FLAGS
               and name not in spec.flags and name not in _SAME_AS and name not in _ZERO_IF_ABSENT
               and name not in _CHOICES]
    missing += [name for name in _REQUIRED_OPTIONS if name not in dict(variant.options)]
    if missing:
        raise ValueError(f"variant {variant} lacks {', '.join(missing)} (a {variant.kernel} variant needs "
                         f"{', '.join(spec.constexprs + _REQUIRED_OPTIONS)})")
    unknown = [name for name in constexprs if name not in spec.constexprs and name not in _FLAGS]
    unknown += [name for name, _ in variant.options if name not in _OPTIONS]
    if unknown:
        raise ValueError(f"variant {variant} has unknown fields {', '.join(unknown)}")
    for name, value in constexprs.items():
        _check_constexpr(variant, name, value, name in spec.wide_blocks)
    if constexprs.get("BLOCK_D2") and ("BLOCK_DV" in constexprs or constexprs.get("TMA") is True):
        raise ValueError(f"variant {variant}: split tiles (BLOCK_D2) take neither TMA nor a value head dim of "
                         "its own (BLOCK_DV)")
    if constexprs.get("TMA") is True:
        _check_tma(variant)
    if constexprs.get("PAGE_GATHER") is True and constexprs.get("PAGED") is not True:
        raise ValueError(f"variant {variant}: PAGE_GATHER=true (each key's page read from the block table) needs "
                         "PAGED=true")
    used = [name for name in ("SEQUSED_Q", "SEQUSED_K") if constexprs.get(name) is True]
    if used and constexprs.get("VARLEN") is not True:
        raise ValueError(f"variant {variant}: {' and '.join(f'{name}=true' for name in used)} needs VARLEN=true "
                         "(seqused_q/seqused_k cut packed sequences)")
    if constexprs.get("BIAS_GRAD") is True and ("BIAS_GRAD" not in spec.constexprs or constexprs.get("BIAS") is not True
                                                or constexprs.get("VARLEN") is True):
        raise ValueError(f"variant {variant}: BIAS_GRAD=true (the bias's gradient) needs BIAS=true on a dense call "
                         f"of a kernel whose description has it, got {variant.kernel}")
    if constexprs.get("SEQ16") is True and (constexprs.get("ALIGN16") is not True or not spec.seq_aligned_params):
        raise ValueError(f"variant {variant}: SEQ16=true needs ALIGN16=true and a kernel with seqlen hints "
                         f"(the backward's), got ALIGN16={_format_value(constexprs.get('ALIGN16', False))} on "
                         f"{variant.kernel}")
    for name, value in variant.options:
        low, high = _OPTIONS[name]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"variant {variant}: {name}={_format_value(value)} must be an integer in {low}..{high}")
    if variant.get("num_warps") & (variant.get("num_warps") - 1):  # type: ignore[operator]
        raise ValueError(f"variant {variant}: num_warps={variant.get('num_warps')} must be a power of two")
    return variant


def _check_tma(variant: Variant) -> None:
    """TMA=true only where descriptors work (a miss log or a hand-written string may say otherwise)."""
    try:
        require_tma(Target.parse(variant.target), variant.constexprs.get("ALIGN16") is True,
                    variant.constexprs.get("EVEN_D") is not False and variant.constexprs.get("EVEN_DV") is not False)
    except ValueError as exc:
        raise ValueError(f"variant {variant}: {exc}") from None


def kernel_constexprs(variant: Variant, names: tuple[str, ...]) -> dict[str, Value]:
    """The values of a kernel's constexprs ``names`` in ``variant``, an absent flag as false (KeyError otherwise).

    An absent BLOCK_DV/EVEN_DV takes BLOCK_D's/EVEN_D's value (``_SAME_AS``), an absent BLOCK_D2 is 0, an
    absent choice (``_CHOICES``: KV_FP8) its first name, an absent flag of the kernel's own
    (``KernelSpec.flags``) false.
    """
    from lazytriton.kernels import get

    constexprs = variant.constexprs
    own = get(variant.kernel).flags
    return {name: constexprs.get(name, False) if name in _FLAGS or name in own
            else constexprs.get(name, _CHOICES[name][0]) if name in _CHOICES
            else constexprs.get(name, 0) if name in _ZERO_IF_ABSENT
            else constexprs[name] if name in constexprs or name not in _SAME_AS else constexprs[_SAME_AS[name]]
            for name in names}
