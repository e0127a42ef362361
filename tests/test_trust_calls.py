"""Trust of the call surfaces: index tensors, packed sequences, ``cache explain``'s checks, messages.

The kernels read an index tensor (cache_seqlens, cache_batch_idx,
block_table, ALiBi slopes, cu_seqlens) through its pointer, as if its last
stride were 1, while the checks read its logical values: a strided view
(``x[::2]``) or a tensor subclass must reach the checks and the kernels as
the same plain, contiguous tensor, on every path (the public function, the
torch op called directly, the direct eager path). A packed call on the CPU
walks a grid sized by the real lengths, not by a huge ``max_seqlen_q``.
``cache explain`` refuses what the API refuses, with the API's own checks.
Error messages show a tensor by its shape and dtype, never its values.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import gpu

import lazytriton
from lazytriton import compiler
from lazytriton.cli import main as cli_main
from lazytriton.kernels.arguments import index_tensor, shown
from lazytriton.kernels.flash_fwd import binding as fwd_binding

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")


class Hiding(torch.Tensor):
    """A subclass whose every operation answers zeros: a value check through it would see nothing wrong."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(result, torch.Tensor) and func.__name__ not in ("__get__", "contiguous", "is_contiguous"):
            return torch.zeros_like(result.as_subclass(torch.Tensor))
        return result


def _hiding(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(Hiding)


# ---------------------------------------------------------------------------
# index_tensor and shown


def test_index_tensor_copies_strided_views_and_unwraps_subclasses() -> None:
    base = torch.arange(8, dtype=torch.int32)
    plain = base[:4]
    assert index_tensor(plain) is plain  # the common call: no copy
    strided = index_tensor(base[::2])
    assert strided.is_contiguous() and strided.tolist() == [0, 2, 4, 6]
    param = index_tensor(torch.nn.Parameter(base[::2], requires_grad=False))
    assert type(param) is torch.Tensor and param.is_contiguous() and param.tolist() == [0, 2, 4, 6]
    unwrapped = index_tensor(_hiding(base))
    assert type(unwrapped) is torch.Tensor and unwrapped.tolist() == list(range(8))
    assert index_tensor(None) is None and index_tensor(3) == 3


def test_shown_gives_a_tensors_shape_and_dtype_never_its_values() -> None:
    big = torch.arange(5000.0) + 12345.0
    for value in (big, (big, 1), [big, big]):
        text = shown(value)
        assert "12345" not in text and "(5000,)" in text and "torch.float32" in text
    assert shown((1, 2)) == "(1, 2)" and len(shown("x" * 1000)) < 200


# ---------------------------------------------------------------------------
# flash_attn_with_kvcache: strided and subclassed index tensors, on every path


def _kv_args(lens: torch.Tensor | None = None, **extra: Any) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    b, s_c, hk, d = 2, 48, 1, 16
    args: dict[str, Any] = {"q": torch.randn(b, 1, 2, d, generator=gen), "k_cache": torch.zeros(b, s_c, hk, d),
                            "v_cache": torch.zeros(b, s_c, hk, d), "k": torch.ones(b, 1, hk, d),
                            "v": torch.ones(b, 1, hk, d),
                            "cache_seqlens": torch.tensor([3, 5], dtype=torch.int32) if lens is None else lens}
    args.update(extra)
    return args


def _op_call(args: dict[str, Any], read: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    from lazytriton.kvcache_op import flash_kvcache_op, flash_kvcache_read_op

    op = flash_kvcache_read_op if read else flash_kvcache_op
    k, v = (None, None) if read else (args["k"], args["v"])
    return op(args["q"], args["k_cache"], args["v_cache"], k, v, args.get("cache_seqlens"), -1,
              args.get("cache_batch_idx"), args.get("block_table"), 0.25, False, -1, -1, 0.0,
              args.get("alibi_slopes"), 0)


def _written_rows(cache: torch.Tensor) -> list[list[int]]:
    return [(row.abs().sum((1, 2)) > 0).nonzero().flatten().tolist() for row in cache]


def test_the_op_writes_new_keys_where_the_strided_cache_seqlens_say() -> None:
    # Memory [3, 30, 5, 40]; the view [::2] holds 3 and 5: the new keys go to rows 3 and 5, never 30.
    lens = torch.tensor([3, 30, 5, 40], dtype=torch.int32)[::2]
    args = _kv_args(lens)
    _op_call(args)
    assert _written_rows(args["k_cache"]) == [[3], [5]]
    assert _written_rows(args["v_cache"]) == [[3], [5]]


def test_the_op_checks_the_values_the_kernels_read() -> None:
    # The view's values are [3, 5], fine; memory holds 10**9 after each: read as stride 1, past the cache.
    lens = torch.tensor([3, 10**9, 5, 10**9], dtype=torch.int32)[::2]
    args = _kv_args(lens)
    _op_call(args)
    assert _written_rows(args["k_cache"]) == [[3], [5]]


def _paged_args(table: torch.Tensor, alibi: torch.Tensor | None = None) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 2, 16, generator=gen)
    k_cache, v_cache = torch.randn(8, 16, 1, 16, generator=gen), torch.randn(8, 16, 1, 16, generator=gen)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_table": table,
            "cache_seqlens": torch.tensor([20, 30], dtype=torch.int32), "alibi_slopes": alibi}


@pytest.mark.parametrize("which", ["block_table", "alibi_slopes"])
def test_the_read_op_reads_strided_block_tables_and_slopes_as_their_values(which: str) -> None:
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    slopes = torch.tensor([0.1, 0.3], dtype=torch.float32)
    plain = _paged_args(table, slopes)
    strided = dict(plain)
    if which == "block_table":  # columns 0 and 2 of a wider table: [[0, 1], [2, 3]] again, row stride 4, column 2
        wide = torch.tensor([[0, 7, 1, 7], [2, 7, 3, 7]], dtype=torch.int32)
        strided["block_table"] = wide[:, ::2]
    else:
        strided["alibi_slopes"] = torch.tensor([0.1, 9.0, 0.3, 9.0], dtype=torch.float32)[::2]
    want = lazytriton.flash_attn_with_kvcache(**plain, return_softmax_lse=True)
    got = _op_call(strided, read=True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("path", ["function", "op"])
def test_a_subclass_cannot_hide_bad_values_from_the_checks(no_launch: None, path: str) -> None:
    args = _kv_args(_hiding(torch.tensor([3, 60], dtype=torch.int32)))  # 60 is past the cache's 48 keys
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 60"):
        if path == "op":
            _op_call(args)
        else:
            lazytriton.flash_attn_with_kvcache(**args)
    assert not args["k_cache"].any()


def test_a_parameter_index_tensor_is_checked_and_read_as_a_plain_one(no_launch: None) -> None:
    lens = torch.nn.Parameter(torch.tensor([3, 60], dtype=torch.int32), requires_grad=False)
    args = _kv_args(lens)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 60"):
        _op_call(args)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 60"):
        lazytriton.flash_attn_with_kvcache(**args)


# ---------------------------------------------------------------------------
# flash_attn_varlen_func: subclassed cu_seqlens are checked like plain ones


def _varlen_args() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(8, 2, 16, generator=gen), torch.randn(10, 2, 16, generator=gen)
    return {"q": q, "k": k, "v": torch.randn(10, 2, 16, generator=gen),
            "cu_seqlens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
            "cu_seqlens_k": torch.tensor([0, 4, 10], dtype=torch.int32), "max_seqlen_q": 5, "max_seqlen_k": 6}


@pytest.mark.parametrize("wrap", ["parameter", "hiding"])
@pytest.mark.parametrize("path", ["function", "op"])
def test_subclassed_cu_seqlens_are_value_checked(no_launch: None, wrap: str, path: str) -> None:
    args = _varlen_args()
    bad = torch.tensor([0, 3, 7], dtype=torch.int32)  # ends at 7, not total_q = 8: row 7 would stay unwritten
    args["cu_seqlens_q"] = (torch.nn.Parameter(bad, requires_grad=False) if wrap == "parameter" else _hiding(bad))
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must be the total number of tokens \(8\)"):
        if path == "op":
            from lazytriton.ops_varlen import flash_varlen_fwd_op

            a = args
            flash_varlen_fwd_op(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, 0.25, False)
        else:
            lazytriton.flash_attn_varlen_func(**args)


def test_a_parameter_cu_seqlens_gives_the_plain_result() -> None:
    args = _varlen_args()
    want = lazytriton.flash_attn_varlen_func(**args)
    args["cu_seqlens_k"] = torch.nn.Parameter(args["cu_seqlens_k"], requires_grad=False)
    torch.testing.assert_close(lazytriton.flash_attn_varlen_func(**args), want, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# flash_attn_varlen_func on the CPU: the grid follows the real lengths


def _record_grids(monkeypatch: pytest.MonkeyPatch, run: bool) -> list[tuple[str, tuple[int, ...]]]:
    grids: list[tuple[str, tuple[int, ...]]] = []
    real = compiler.interpret

    def interpret(name: str, grid: Any, *args: Any, **kwargs: Any) -> Any:
        grids.append((name, tuple(grid)))
        return real(name, grid, *args, **kwargs) if run else None

    monkeypatch.setattr(compiler, "interpret", interpret)
    return grids


def test_a_huge_max_seqlen_q_does_not_size_the_cpu_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _varlen_args()
    grids = _record_grids(monkeypatch, run=False)
    lazytriton.flash_attn_varlen_func(**{**args, "max_seqlen_q": 2**31 - 1, "max_seqlen_k": 2**31 - 1})
    (name, grid), = grids
    assert grid[0] * grid[1] * grid[2] <= 2 * 2 * 5, grid  # query blocks of the longest sequence (5) x heads x batch


def test_the_cpu_result_and_gradients_do_not_depend_on_max_seqlen(monkeypatch: pytest.MonkeyPatch) -> None:
    args = _varlen_args()
    leaves = {n: args[n].clone().requires_grad_() for n in ("q", "k", "v")}
    want = lazytriton.flash_attn_varlen_func(**{**args, **leaves}, causal=True)
    want_grads = torch.autograd.grad(want.sum(), list(leaves.values()))
    grids = _record_grids(monkeypatch, run=True)
    leaves = {n: args[n].clone().requires_grad_() for n in ("q", "k", "v")}
    got = lazytriton.flash_attn_varlen_func(**{**args, **leaves, "max_seqlen_q": 10**6, "max_seqlen_k": 10**6},
                                            causal=True)
    got_grads = torch.autograd.grad(got.sum(), list(leaves.values()))
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert torch.equal(g, w)
    assert len(grids) == 3 and all(g[0] * g[1] * g[2] <= 64 for _, g in grids), grids


# ---------------------------------------------------------------------------
# Messages


def test_the_slow_cpu_warning_labels_each_number(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fwd_binding, "_warned_slow", False)
    with caplog.at_level(logging.WARNING, logger="lazytriton.flash"):
        fwd_binding.warn_if_slow(fwd_binding.Shape(1, 16, 4, 1024, 1024, 128))
    text = caplog.text
    assert "(1, 16, 4, 1024, 1024, 128)" not in text
    for label in ("batch 1", "heads_q 16", "heads_k 4", "seqlen_q 1024", "seqlen_k 1024", "head_dim 128"):
        assert label in text, (label, text)


BIG = torch.arange(5000.0) + 12345.0


@pytest.mark.parametrize("options", [{"rotary_cos": BIG, "rotary_sin": BIG}, {"cache_leftpad": BIG.int()},
                                     {"window_size": BIG}, {"softmax_scale": BIG}, {"softcap": BIG},
                                     {"num_splits": BIG}, {"window_size": (BIG, BIG)}])
def test_kvcache_errors_show_tensors_by_shape_not_values(no_launch: None, options: dict[str, Any]) -> None:
    args = _kv_args()
    with pytest.raises((TypeError, ValueError)) as info:
        lazytriton.flash_attn_with_kvcache(**args, **options)
    message = str(info.value)
    assert "12345" not in message and len(message) < 400, message
    assert "(5000,)" in message or "Tensor" in message, message


# ---------------------------------------------------------------------------
# cache explain: the API's own checks, and prewarm's list of targets


EXPLAIN = ["cache", "explain", "--dtype", "bf16"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--head-dim", "0", "--seqlen-q", "128"], "head dim"),
    (["--head-dim", "300", "--seqlen-q", "128"], "head dim"),
    (["--head-dim", "64", "--seqlen-q", str(2**31)], "2**31"),
    (["--head-dim", "64", "--seqlen-q", "128", "--seqlen-k", str(2**31 + 5)], "2**31"),
    (["--head-dim", "64", "--seqlen-q", "128", "--target", "sm_99"], "unknown target 'sm_99'; known targets: sm_80"),
    (["--head-dim", "64", "--seqlen-q", "128", "--kernel", "flash_bwd", "--head-dim-v", "0"], "head dim"),
    (["--head-dim", "0", "--seqlen-q", "1", "--kernel", "flash_decode"], "head dim"),
    (["--head-dim", "64", "--seqlen-q", "1", "--seqlen-k", str(2**31), "--kernel", "flash_decode"], "2**31"),
    (["--head-dim", "0", "--seqlen-q", "128", "--varlen"], "head dim"),
    (["--head-dim", "64", "--seqlen-q", str(2**31), "--varlen"], "max_seqlen_q"),
    (["--head-dim", "0", "--seqlen-q", "1", "--kernel", "kv_append"], "head dim"),
])
def test_explain_refuses_what_the_api_refuses(cache_dir: Any, capsys: pytest.CaptureFixture[str], args: list[str],
                                              needle: str) -> None:
    assert cli_main([*EXPLAIN, *args]) == 2
    err = capsys.readouterr().err
    assert "lazytriton cache explain: error:" in err and needle in err, err
    assert "negative shift count" not in err


def test_explain_still_serves_what_the_api_takes(cache_dir: Any, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--head-dim", "64", "--seqlen-q", "128", "--target", "sm_80"],
                 ["--head-dim", "256", "--seqlen-q", str(2**31 - 1), "--seqlen-k", "1"],
                 ["--head-dim", "64", "--seqlen-q", "4", "--seqlen-k", "0"],
                 ["--head-dim", "64", "--seqlen-q", "4", "--kernel", "flash_decode", "--page-size", "16"],
                 ["--head-dim", "128", "--seqlen-q", "128", "--kernel", "flash_bwd", "--varlen", "--causal",
                  "bottom_right"],
                 ["--head-dim", "64", "--seqlen-q", "128", "--target", "gfx942", "--window", "--softcap"]):
        assert cli_main([*EXPLAIN, *args]) == 0, (args, capsys.readouterr().err)
        assert "served by" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# The same on the GPU: the cached kernels read the index tensors as the checks did


def _to(args: dict[str, Any], device: str) -> dict[str, Any]:
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in args.items()}


@gpu
@pytest.mark.gpu
def test_gpu_strided_cache_seqlens_write_where_their_values_say() -> None:
    lens = torch.tensor([3, 10**9, 5, 10**9], dtype=torch.int32, device="cuda")[::2]
    args = _to(_kv_args(), "cuda")
    args["cache_seqlens"] = lens
    _op_call(args)
    torch.cuda.synchronize()
    assert _written_rows(args["k_cache"].cpu()) == [[3], [5]]
    assert _written_rows(args["v_cache"].cpu()) == [[3], [5]]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["block_table", "alibi_slopes"])
def test_gpu_strided_block_tables_and_slopes_are_read_as_their_values(which: str) -> None:
    plain = _to(_paged_args(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                            torch.tensor([0.1, 0.3], dtype=torch.float32)), "cuda")
    strided = dict(plain)
    if which == "block_table":
        strided["block_table"] = torch.tensor([[0, 7, 1, 7], [2, 7, 3, 7]], dtype=torch.int32, device="cuda")[:, ::2]
    else:
        strided["alibi_slopes"] = torch.tensor([0.1, 9.0, 0.3, 9.0], dtype=torch.float32, device="cuda")[::2]
    want = lazytriton.flash_attn_with_kvcache(**plain, return_softmax_lse=True)
    got = _op_call(strided, read=True)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path", ["function", "op"])
def test_gpu_parameter_cu_seqlens_are_value_checked(path: str) -> None:
    args = _to(_varlen_args(), "cuda")
    args["q"], args["k"], args["v"] = (args[n].half() for n in ("q", "k", "v"))
    bad = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    args["cu_seqlens_q"] = torch.nn.Parameter(bad, requires_grad=False)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must be the total number of tokens \(8\)"):
        if path == "op":
            from lazytriton.ops_varlen import flash_varlen_fwd_op

            a = args
            flash_varlen_fwd_op(a["q"], a["k"], a["v"], a["cu_seqlens_q"], a["cu_seqlens_k"], 5, 6, 0.25, False)
        else:
            lazytriton.flash_attn_varlen_func(**args)
    args["cu_seqlens_q"] = torch.nn.Parameter(torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda"),
                                              requires_grad=False)
    want = lazytriton.flash_attn_varlen_func(**{**args, "cu_seqlens_q": args["cu_seqlens_q"].detach().clone()})
    torch.testing.assert_close(lazytriton.flash_attn_varlen_func(**args), want, rtol=0, atol=0)
