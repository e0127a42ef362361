"""Paged KV caches with pages of any size in ``flash_attn_with_kvcache`` (FlashAttention-3's, FlashInfer's).

A key block read through one block-table entry must lie in one page, so the
split kernel's BLOCK_N divides the page size where it can (pages of 16 keys
or a multiple: the variants and code path of before); pages no key tile
divides (1 key, as SGLang's radix cache, 2, 3, 4, 8, 12...) are gathered,
each key's page read from the table (PAGE_GATHER=true). The kernels run
through Triton's interpreter over a covering design of page sizes 1, 2, 3,
4, 8, 12, 16, 48 and 256 against the float64 reference with FlashAttention's
rule (``test_kvcache.check_against_reference``): new keys appended across
pages, MHA/GQA/MQA, causal, windows, softcap, ALiBi, cache_leftpad, split
counts, one query and a few, scattered block tables whose unused entries
hold -1 or a block past the cache, and every key outside a sequence's
[cache_leftpad, length) NaN (never read: the output stays finite). Then what
the page size reaches: the variants (unchanged where the tile divides the
page), a real sm_90 compile, the C API, prewarm, ``cache explain`` and the
tuner; and on the GPU, serving shapes against SDPA on the gathered cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from capilib import KVCACHE_PRELUDE, report_of
from conftest import gpu
from test_flash_fwd import seed_of
from test_kvcache import DTYPES, HEADS, check_against_reference, run

import lazytriton
from lazytriton.cli import main as cli_main
from lazytriton.kernels import FAMILIES, dispatch
from lazytriton.kernels.flash_decode import binding, checks
from lazytriton.kernels.flash_decode import dispatch as decode_dispatch
from lazytriton.kernels.flash_decode.reference import kvcache_reference
from lazytriton.prewarm.enumeration import Axes, enumerate_variants
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.tuning import Table
from lazytriton.variant import Variant, check_fields

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")

SM90 = Target.parse("sm_90")
DECODE = FAMILIES["flash_decode"]
EMPTY = Table(())
PAGES = (1, 2, 3, 4, 8, 12, 16, 48, 256)
GATHERED = (1, 2, 3, 4, 8, 12)  # no key tile (16 or more, a power of two) divides them
KEYS = 40  # keys a sequence's table holds, rounded up to whole pages


@dataclass(frozen=True)
class PageCase:
    page: int
    dtype: torch.dtype
    head_dim: int
    seqlen_q: int
    heads: tuple[int, int]
    new: int  # 0: no k/v
    causal: bool
    window: tuple[int, int]
    softcap: float
    alibi: str  # "", "heads", "batch"
    leftpad: bool
    splits: int
    unused: str  # what table entries of pages a sequence does not use hold: "minus1" or "past" (past the cache)

    def __str__(self) -> str:
        return (f"page{self.page}-{checks.DTYPES[self.dtype]}-d{self.head_dim}-q{self.seqlen_q}-h{self.heads[0]}_"
                f"{self.heads[1]}-new{self.new}-causal{int(self.causal)}-w{self.window[0]}_{self.window[1]}-cap"
                f"{self.softcap}-alibi_{self.alibi or 'no'}-pad{int(self.leftpad)}-s{self.splits}-{self.unused}")


def covering_cases() -> list[PageCase]:
    """Each page size twice, every option of each axis in varied company (moduli mostly coprime)."""
    windows = ((-1, -1), (9, 0), (-1, -1), (20, 3), (-1, 5))
    return [PageCase(page, DTYPES[i % 3], (64, 40, 32)[i % 3], (1, 3)[(i // 3) % 2], HEADS[i % 4], (0, 1, 5)[i % 3],
                     bool(i % 2), windows[i % 5], (0.0, 2.0)[(i // 3) % 2], ("", "heads", "batch")[(i // 2) % 3],
                     (i // 4) % 2 == 1, (0, 1, 2, 5)[(i + 1) % 4], ("minus1", "past")[(i // 5) % 2])
            for i, page in enumerate(PAGES + PAGES[::-1])]


CASES = covering_cases()


def _used(pages: int, page: int, pad: int, length: int) -> list[bool]:
    """Which pages hold a key of [pad, length): ``checks._used_pages``'s rule, the only pages read or written."""
    return [p * page < length and (p + 1) * page > pad for p in range(pages)]


def make_inputs(case: PageCase, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(clean, poisoned) arguments of one call of 3 sequences on a scattered paged cache.

    ``clean``: random caches, every table entry a distinct block of a pool
    twice the size needed. ``poisoned``: the same call with NaN in every key
    and value outside each sequence's [cache_leftpad, cache_seqlens) (unused
    blocks, the rest of used pages, where the new keys land) and the table
    entries of unused pages set to ``case.unused``: what the kernels must
    never read.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(case.dtype)

    hq, hk = case.heads
    batch, pages = 3, -(-KEYS // case.page)
    capacity, blocks = pages * case.page, 2 * batch * pages + 1
    table = torch.randperm(blocks, generator=gen)[:batch * pages].reshape(batch, pages).to(torch.int32)
    top = capacity - case.new
    cached = [int(torch.randint(0, top + 1, (1,), generator=gen)), top, min(top, 5)]
    pads = [int(torch.randint(0, c + 1, (1,), generator=gen)) for c in cached] if case.leftpad else [0] * batch
    clean: dict[str, Any] = {"q": randn(batch, case.seqlen_q, hq, case.head_dim),
                             "k_cache": randn(blocks, case.page, hk, case.head_dim),
                             "v_cache": randn(blocks, case.page, hk, case.head_dim), "block_table": table,
                             "cache_seqlens": torch.tensor(cached, dtype=torch.int32)}
    if case.new:
        clean["k"], clean["v"] = randn(batch, case.new, hk, case.head_dim), randn(batch, case.new, hk, case.head_dim)
    if case.alibi:
        clean["alibi_slopes"] = torch.rand((hq,) if case.alibi == "heads" else (batch, hq), generator=gen) * 0.3
    if case.leftpad:
        clean["cache_leftpad"] = torch.tensor(pads, dtype=torch.int32)
    k_cache, v_cache = torch.full_like(clean["k_cache"], float("nan")), torch.full_like(clean["v_cache"], float("nan"))
    poisoned_table = table.clone()
    for b in range(batch):
        for p in range(pads[b], cached[b]):
            block, row = int(table[b, p // case.page]), p % case.page
            k_cache[block, row], v_cache[block, row] = clean["k_cache"][block, row], clean["v_cache"][block, row]
        for j, used in enumerate(_used(pages, case.page, pads[b], cached[b] + case.new)):
            if not used:
                poisoned_table[b, j] = -1 if case.unused == "minus1" else blocks + 10**6
    return clean, {**clean, "k_cache": k_cache, "v_cache": v_cache, "block_table": poisoned_table}


def appended(cache: torch.Tensor, new: torch.Tensor | None, args: dict[str, Any]) -> torch.Tensor:
    """``cache`` with the new keys (or values) written where FlashAttention puts them: through the block table."""
    cache = cache.clone()
    page = cache.shape[1]
    for b in range(0 if new is None else new.shape[0]):
        for n in range(new.shape[1]):  # type: ignore[union-attr]
            p = int(args["cache_seqlens"][b]) + n
            cache[int(args["block_table"][b, p // page]), p % page] = new[b, n]  # type: ignore[index]
    return cache


def check_poisoned(clean: dict[str, Any], poisoned: dict[str, Any], **opts: Any) -> None:
    """The call on the poisoned cache: finite, FlashAttention's rule against the clean call's reference, and the
    new keys and values written through the table, nothing else touched."""
    out, lse, k_cache, v_cache = run(poisoned, **opts)
    assert torch.isfinite(out).all(), "a key or table entry outside the sequences was read"
    numerics = {n: v for n, v in opts.items() if n != "num_splits"}
    _, _, same_k, same_v = kvcache_reference(**clean, **numerics)  # the caches are checked below, NaN and all
    check_against_reference(clean, (out, lse, same_k, same_v), **numerics)
    for got, cache, new in ((k_cache, poisoned["k_cache"], clean.get("k")), (v_cache, poisoned["v_cache"],
                                                                             clean.get("v"))):
        torch.testing.assert_close(got, appended(cache, new, clean), rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------
# The kernels on CPU, through Triton's interpreter


def test_the_covering_design_covers_every_option() -> None:
    for axis, values in (("page", PAGES), ("dtype", DTYPES), ("seqlen_q", (1, 3)), ("heads", HEADS),
                         ("new", (0, 1, 5)), ("causal", (False, True)), ("softcap", (0.0, 2.0)),
                         ("alibi", ("", "heads", "batch")), ("leftpad", (False, True)), ("splits", (0, 1, 2, 5)),
                         ("unused", ("minus1", "past"))):
        assert {getattr(c, axis) for c in CASES} == set(values), axis
    assert {c.window for c in CASES} == {(-1, -1), (9, 0), (20, 3), (-1, 5)}
    assert {c.page for c in CASES if c.new and c.leftpad} & set(GATHERED)
    assert {c.page for c in CASES if c.seqlen_q > 1 and c.causal and c.new} & set(GATHERED)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_pages_of_any_size_cpu(case: PageCase) -> None:
    clean, poisoned = make_inputs(case, seed=seed_of(str(case)))
    check_poisoned(clean, poisoned, causal=case.causal, window_size=case.window, softcap=case.softcap,
                   num_splits=case.splits)


def test_split_counts_agree_on_pages_of_one_key() -> None:
    case = PageCase(1, torch.float32, 64, 2, (4, 2), 1, True, (-1, -1), 0.0, "batch", True, 1, "minus1")
    clean, poisoned = make_inputs(case, seed=5)
    results = [run(poisoned, causal=True, num_splits=n) for n in (1, 2, 3, 7)]
    for out, lse, _, _ in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-6, atol=1e-6)
    check_poisoned(clean, poisoned, causal=True, num_splits=7)


@pytest.mark.parametrize("page", [1, 3, 16])
def test_a_paged_call_is_the_contiguous_call(page: int) -> None:
    """The same keys, scattered over pages of ``page`` keys or in one contiguous row: the same result."""
    gen = torch.Generator().manual_seed(page)
    q, k, v = torch.randn(2, 2, 6, 32, generator=gen), torch.randn(2, 1, 2, 32, generator=gen), \
        torch.randn(2, 1, 2, 32, generator=gen)
    rows_k, rows_v = torch.randn(2, 48, 2, 32, generator=gen), torch.randn(2, 48, 2, 32, generator=gen)
    pages = 48 // page
    order = torch.randperm(2 * pages, generator=gen)
    k_cache, v_cache = torch.empty(2 * pages, page, 2, 32), torch.empty(2 * pages, page, 2, 32)
    k_cache[order], v_cache[order] = rows_k.reshape(2 * pages, page, 2, 32), rows_v.reshape(2 * pages, page, 2, 32)
    table = order.reshape(2, pages).to(torch.int32)
    lens = torch.tensor([47, 20], dtype=torch.int32)
    opts: dict[str, Any] = {"causal": True, "window_size": (30, 0), "num_splits": 3}
    paged = run({"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "cache_seqlens": lens,
                 "block_table": table}, **opts)
    contiguous = run({"q": q, "k_cache": rows_k, "v_cache": rows_v, "k": k, "v": v, "cache_seqlens": lens}, **opts)
    torch.testing.assert_close(paged[0], contiguous[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(paged[1], contiguous[1], rtol=1e-6, atol=1e-6)
    assert torch.equal(paged[2][order].reshape(2, 48, 2, 32), contiguous[2]), "the new keys landed elsewhere"


def test_bad_pages_and_tables_are_refused_before_anything_runs(no_launch: None) -> None:
    case = PageCase(3, torch.float16, 64, 1, (4, 2), 1, False, (-1, -1), 0.0, "", False, 0, "minus1")
    clean, poisoned = make_inputs(case)
    used_minus1 = poisoned["block_table"].clone()
    used_minus1[1, 1] = -1  # sequence 1 holds 41 + 1 keys: every page is used
    for args, error, match in (
            ({**clean, "k_cache": clean["k_cache"][:, :0], "v_cache": clean["v_cache"][:, :0]}, ValueError,
             r"k_cache.shape\[1\] is the page size and must be >= 1"),
            ({**clean, "block_table": clean["block_table"][:2]}, ValueError, "block_table has 2 rows"),
            ({**clean, "block_table": clean["block_table"].long()}, TypeError, "block_table"),
            ({**poisoned, "block_table": used_minus1}, ValueError, r"block_table\[1, 1\] = -1 points past the cache"),
            ({**clean, "cache_seqlens": torch.tensor([0, 42, 0], dtype=torch.int32)}, ValueError,
             r"cache_seqlens\[1\] = 42: must be in 0..41")):
        before = args["k_cache"].clone()
        with pytest.raises(error, match=match):
            lazytriton.flash_attn_with_kvcache(**args)
        torch.testing.assert_close(args["k_cache"], before, rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------
# Variants: the flag only where the pages are small (no tile of GATHER_BELOW keys divides them)


def test_which_pages_are_gathered() -> None:
    assert decode_dispatch.GATHER_BELOW == 64
    assert [p for p in range(1, 200) if decode_dispatch.page_gather(p)] == [p for p in range(1, 200) if p % 64]
    assert not decode_dispatch.page_gather(0) and not decode_dispatch.page_gather(4096)
    assert decode_dispatch.key_block_limit(192) == 64 and decode_dispatch.key_block_limit(128) == 128
    assert decode_dispatch.key_block_limit(48) >= 1 << 20 and decode_dispatch.key_block_limit(3) >= 1 << 20


def test_variant_strings_hold_where_the_tile_divides_the_page() -> None:
    def split(page: int, **flags: Any) -> Variant:
        return decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 32768,
                                              page_size=page, paged=page > 0, table=EMPTY, **flags)

    assert str(split(256)) == ("flash_decode_split:sm_90:bf16:ALIGN16=true,BLOCK_D=128,CAUSAL=false,EVEN_D=true,"
                               "INDEX64=false,PAGED=true:BLOCK_M=16,BLOCK_N=64:num_stages=5,num_warps=4")
    for page in (64, 192, 256, 1024, 65536):
        chosen = split(page)
        assert "PAGE_GATHER" not in str(chosen) and page % int(chosen.get("BLOCK_N")) == 0, page
    for page in (1, 2, 3, 4, 5, 8, 12, 16, 24, 32, 48, 80, 100, 1000):
        chosen = split(page, leftpad=True)
        assert chosen.get("PAGE_GATHER") is True and chosen.get("BLOCK_N") == 64, page  # a paged call's tiles
        # the 256-key page's variant, gathered and without its feature register cap (a pointer a key)
        assert str(chosen).replace(",PAGE_GATHER=true", "") == str(split(256, leftpad=True)).replace("maxnreg=128,", "")
        assert check_fields(Variant.parse(str(chosen))) == chosen
    combine = decode_dispatch.decode_variant("flash_decode_combine", SM90, "bf16", 128, False, True, 4, 32768,
                                             page_size=1, paged=True, table=EMPTY)
    assert "PAGE_GATHER" not in str(combine) and "PAGED" not in str(combine)
    assert dispatch.kernel_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 32768, table=EMPTY,
                                   paged=True, page_size=4) == split(4)
    assert "PAGE_GATHER" not in str(dispatch.kernel_variant("flash_fwd", SM90, "bf16", 128, False, True, 128, 128,
                                                            paged=True, page_size=4))
    wide = Config(16, 128, 4, 5)  # a given config (prewarm, tune) is served as the page allows, as a table row is
    assert split(192, config=wide).get("BLOCK_N") == 64 and split(32, config=wide).get("BLOCK_N") == 128
    assert split(1, config=wide).get("BLOCK_N") == 128
    with pytest.raises(ValueError, match="PAGE_GATHER=true .* needs PAGED=true"):
        check_fields(Variant.parse(str(split(0)).replace("INDEX64=false", "INDEX64=false,PAGE_GATHER=true")))


def test_the_binding_and_the_c_planner_choose_the_gathered_variant() -> None:
    from lazytriton.capi import embedded_kvcache

    q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16, device="meta")
    table = torch.empty(2, 40, dtype=torch.int32, device="meta")
    calls = {}
    for page in (1, 3, 8, 16, 48, 64, 192):
        cache = torch.empty(80, page, 2, 64, dtype=torch.bfloat16, device="meta")
        call = checks.check(checks.Inputs(q, cache, cache, block_table=table[:, :-(-40 // page)]))
        calls[page] = call
        split, combine = binding.variants(SM90, torch.bfloat16, call, True, False)
        assert dict(split.functional).get("PAGE_GATHER", False) == (page % 64 != 0), page
        assert binding.interpreter_constexprs(call)[0]["PAGE_GATHER"] == (page % 64 != 0)
        got = embedded_kvcache.plan_variants(90, 2, 64, call.causal, True, False, call.rows, call.capacity,
                                             call.page_size, False, False, False, 64)
        assert got == binding.variants(Target("cuda", "90", 32), torch.bfloat16, call, True, False), page
    memo = {page: binding.memo_key(0, torch.bfloat16, call, True, False) for page, call in calls.items()}
    assert memo[48] != memo[64]  # gathered pages of 48 keys; tiles of 64
    assert memo[1] == memo[3] and memo[16] == memo[48]  # the same variants at the same buckets: one plan each


def test_a_gathered_variant_compiles_to_what_the_c_launcher_passes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A real sm_90 entry (Triton's compiler, not the interpreter), at the shared memory of a paged one."""
    from compiled_once import compiled, shared_dir

    from lazytriton.capi import embedded_kvcache

    def split(page: int) -> Variant:
        return decode_dispatch.decode_variant("flash_decode_split", SM90, "fp16", 64, True, True, 4, 4096,
                                              page_size=page, paged=True, table=EMPTY, leftpad=True)

    gathered, paged = (compiled(split(page), shared_dir(tmp_path_factory)) for page in (1, 64))
    embedded_kvcache.check_launch_layout(gathered, "flash_decode_split")
    assert gathered.arg_types == paged.arg_types and gathered.shared <= paged.shared + 4096


# ---------------------------------------------------------------------------
# Prewarm, cache explain, the tuner


def test_prewarm_plans_the_page_sizes_asked_for() -> None:
    plain = enumerate_variants(Axes((SM90,), kernels=DECODE), EMPTY)
    assert not any("PAGE_GATHER" in str(p.variant) for p in plain)
    paged = enumerate_variants(Axes((SM90,), kernels=DECODE, paged=(True,), page_sizes=(1, 16)), EMPTY)
    planned = {p.key for p in paged}
    gathered = [p.variant for p in paged if dict(p.variant.functional).get("PAGE_GATHER") is True]
    assert gathered and {v.kernel for v in gathered} == {"flash_decode_split"}
    for dtype, head_dim, causal, rows, page in (("bf16", 128, False, 4, 1), ("fp16", 64, True, 33, 3),
                                                 ("bf16", 64, False, 64, 8), ("fp16", 128, True, 16, 16)):
        for kernel in DECODE:
            chosen = decode_dispatch.decode_variant(kernel, SM90, dtype, head_dim, causal, True, rows, 32768,
                                                    page_size=page, paged=True, table=EMPTY)
            assert chosen.key() in planned, chosen
    assert all(dict(p.variant.functional).get("PAGED") for p in paged if p.variant.kernel == "flash_decode_split")
    with pytest.raises(ValueError, match="page sizes must be ints"):
        Axes((SM90,), page_sizes=(0,))


def test_prewarm_cli_takes_page_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["prewarm", "--target", "sm_90", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128",
            "--paged", "paged", "--list"]
    assert cli_main(base) == 0
    plain = capsys.readouterr().out
    assert cli_main([*base, "--page-size", "1,16"]) == 0
    listed = capsys.readouterr().out
    assert "PAGE_GATHER=true" not in plain and "PAGE_GATHER=true" in listed and "BLOCK_N=16" not in listed
    assert cli_main([*base, "--page-size", "192"]) == 0  # a tile of 64 keys divides it: not gathered
    assert "PAGE_GATHER=true" not in capsys.readouterr().out
    assert cli_main([*base[:-3], "--paged", "contiguous", "--page-size", "4", "--list"]) == 2
    assert "--page-size describes a paged cache" in capsys.readouterr().err
    misses = tmp_path / "misses.jsonl"
    variant = decode_dispatch.decode_variant("flash_decode_split", SM90, "bf16", 128, False, True, 4, 4096,
                                             page_size=1, paged=True)
    misses.write_text(json.dumps({"variant": str(variant), "key": variant.key(), "compile_s": 1.0}) + "\n")
    assert cli_main(["prewarm", "--from-misses", str(misses), "--list"]) == 0
    assert capsys.readouterr().out.split()[0] == variant.key()
    assert cli_main(["prewarm", "--from-misses", str(misses), "--page-size", "1", "--list"]) == 2
    assert "--page-size cannot narrow it" in capsys.readouterr().err


def test_explain_describes_a_gathered_call(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["cache", "explain", "--kernel", "flash_decode", "--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4",
            "--seqlen-k", "32768", "--target", "sm_90"]
    reports = {}
    for page in ("1", "12", "256"):
        assert cli_main([*args, "--page-size", page, "--json"]) == 0
        reports[page] = json.loads(capsys.readouterr().out)
    split = Variant.parse(reports["1"]["kernels"][0]["variant"])
    assert split.get("PAGE_GATHER") is True
    assert reports["1"]["kernels"][0]["config"]["block_n"] == split.get("BLOCK_N")  # the H200 row's, uncut
    assert reports["12"]["kernels"][0]["variant"] == reports["1"]["kernels"][0]["variant"]
    assert reports["1"]["kernels"][0]["variant"].replace(",PAGE_GATHER=true", "") == \
        reports["256"]["kernels"][0]["variant"]
    assert reports["1"]["kernels"][1]["key"] == reports["256"]["kernels"][1]["key"]
    assert cli_main([*args, "--page-size", "1"]) == 0
    assert "each key's page from the block table (PAGE_GATHER=true)" in capsys.readouterr().out
    assert cli_main([*args, "--page-size", "256"]) == 0
    assert "PAGE_GATHER" not in capsys.readouterr().out


def test_the_tuner_takes_small_pages() -> None:
    from lazytriton.cli.tune import flash_decode as tune_decode

    case = tune_decode.Case("paged", 8, 4096, 32, 8, 128, "bf16", page_size=1)
    wide = Config(16, 128, 4, 3)
    assert tune_decode.cut_to_page(wide, case) == wide
    assert tune_decode.cut_to_page(wide, case._replace(page_size=192)).block_n == 64
    assert tune_decode.cut_to_page(wide, case._replace(page_size=32)) == wide  # gathered
    assert tune_decode.variant_for("flash_decode_split", SM90, case, wide).get("PAGE_GATHER") is True


# ---------------------------------------------------------------------------
# The C API on CPU


C_PAGES = KVCACHE_PRELUDE + r"""
torch.manual_seed(0)
report = {}
for page, splits in ((1, 3), (3, 0), (12, 2)):
    pages = -(-40 // page)
    k_cache, v_cache = torch.randn(2 * pages + 3, page, 2, 32), torch.randn(2 * pages + 3, page, 2, 32)
    table = torch.randperm(2 * pages + 3, dtype=torch.int32)[:2 * pages].reshape(2, pages).contiguous()
    table[0, -(-11 // page):] = -1  # sequence 0 holds 9 + 2 keys: its later pages are unused
    t = {"q": torch.randn(2, 2, 4, 32), "k_cache": k_cache, "v_cache": v_cache, "k": torch.randn(2, 2, 2, 32),
         "v": torch.randn(2, 2, 2, 32), "cache_seqlens": torch.tensor([9, 38], dtype=torch.int32),
         "block_table": table, "cache_leftpad": torch.tensor([4, 30], dtype=torch.int32)}
    clones = {n: x.clone() for n, x in t.items()}
    out, lse = torch.full((2, 2, 4, 32), 7.0), torch.full((2, 4, 2), 7.0)
    status = call("lt_attn_kvcache", params({**t, "out": out, "lse": lse}, causal=1, num_splits=splits), ffi.NULL)
    want, want_lse = lazytriton.flash_attn_with_kvcache(
        clones["q"], clones["k_cache"], clones["v_cache"], clones["k"], clones["v"], clones["cache_seqlens"],
        block_table=clones["block_table"], cache_leftpad=clones["cache_leftpad"], causal=True, num_splits=splits,
        return_softmax_lse=True)
    report[page] = [status, dll.lt_last_error().decode() if status else "", torch.equal(out, want),
                    torch.equal(lse, want_lse), torch.equal(t["k_cache"], clones["k_cache"]),
                    bool(torch.isfinite(out).all())]
empty = {"q": torch.randn(2, 1, 4, 32), "k_cache": torch.randn(4, 1, 2, 32)[:, :0],
         "v_cache": torch.randn(4, 1, 2, 32)[:, :0], "block_table": torch.zeros(2, 2, dtype=torch.int32)}
status = call("lt_attn_kvcache", params({**empty, "out": torch.empty(2, 1, 4, 32), "lse": torch.empty(2, 4, 1)}),
              ffi.NULL)
report["empty"] = [status, dll.lt_last_error().decode()]
print(json.dumps(report))
"""


def test_the_c_call_takes_small_pages_on_the_cpu(prefix: Path, cache_dir: Path) -> None:

    report = report_of(C_PAGES, prefix)
    for page in ("1", "3", "12"):
        status, error, same_out, same_lse, same_caches, finite = report[page]
        assert status == 0, (page, error)
        assert same_out and same_lse and same_caches and finite, (page, report[page])
    status, error = report["empty"]
    assert status == 5 and "k_cache.sizes[1] is the page size and must be >= 1" in error, (status, error)


# ---------------------------------------------------------------------------
# On the GPU


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("page", "new"), [(1, 0), (1, 1), (16, 1), (3, 1)])
def test_pages_gpu_serving_shapes(page: int, new: int) -> None:
    """32/8 heads, head dim 128, bf16, 32k keys a sequence on scattered pages: SDPA on the gathered cache."""
    gen = torch.Generator(device="cuda").manual_seed(page + 10 * new)
    batch, capacity = 4, 32768
    pages = -(-capacity // page)
    blocks = batch * pages
    k_cache = torch.randn(blocks, page, 8, 128, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(blocks, device="cuda", generator=gen).reshape(batch, pages).int()
    lens = torch.randint(1, capacity - new, (batch,), device="cuda", generator=gen).int()
    lens[0] = capacity - new
    q = torch.randn(batch, 1 + new, 32, 128, device="cuda", generator=gen).bfloat16()
    k = v = None
    if new:
        k = torch.randn(batch, new, 8, 128, device="cuda", generator=gen).bfloat16()
        v = torch.randn_like(k)
    for splits in (0, 1, 9):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = lazytriton.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                                 num_splits=splits)
        keys = kc[table.long()].reshape(batch, pages * page, 8, 128)  # the gathered cache, after the append
        values = vc[table.long()].reshape(batch, pages * page, 8, 128)
        for b in range(batch):
            length = int(lens[b]) + new
            mask = torch.ones(1 + new, length, dtype=torch.bool, device="cuda").tril(length - 1 - new)
            want = torch.nn.functional.scaled_dot_product_attention(
                q[b].transpose(0, 1).float(), keys[b, :length].transpose(0, 1).float(),
                values[b, :length].transpose(0, 1).float(), attn_mask=mask, enable_gqa=True).transpose(0, 1)
            torch.testing.assert_close(out[b].float(), want, rtol=2e-2, atol=2e-2)
            if new:
                assert torch.equal(keys[b, int(lens[b]):length], k[b])  # type: ignore[index]
