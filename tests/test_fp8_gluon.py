"""flash_fwd_fp8_gluon: its registration, the rule and dispatch to it, sm_90 compiles, and on the GPU its numbers.

The kernel runs only on a Hopper GPU (Triton's interpreter does not run Gluon): the GPU tests below hold it to
FlashAttention-3's FP8 rule against float64 (``test_fp8_fwd.assert_fa3_rule``). On CPU: the spec shares
flash_fwd_fp8's parameters (``fp8.pack`` packs for both), the rule refuses every call the kernel does not
compute exactly, dispatch serves it only where the rule and table hold (the memo key's last bit), and the
installed Triton (3.9 on CI; 3.6 through ``$LAZYTRITON_TEST_OTHER_TRITON_PYTHON``) compiles each tiling for
sm_90 into FP8 wgmmas within shared memory and without a spill.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, gpu, loop_opcodes, opcode_counts, ptxas_report, sass_of
from test_fp8_fwd import E4M3, E5M2, assert_fa3_rule, reference

from lazytriton.kernels import get, launched_warps, source_fingerprint
from lazytriton.kernels.flash_fwd import binding, fp8, fp8_gluon
from lazytriton.kernels.flash_fwd.fp8_spec import FLASH_FWD_FP8
from lazytriton.target import Target
from lazytriton.variant import Variant, check_fields

SM90 = Target.parse("sm_90")
NAME = "flash_fwd_fp8_gluon"
TILINGS = [(d, tiles) for d in fp8_gluon.HEAD_DIMS for tiles in fp8_gluon.configs(d)]


@pytest.fixture(autouse=True)
def gluon_fp8_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel served by dispatch at every head dim of its table (the library serves it at
    ``fp8_gluon.DEFAULT_HEAD_DIMS``, those where it measured faster): these tests hold its rule, reach and numbers."""
    monkeypatch.setattr(fp8_gluon, "BY_DEFAULT", True)
    monkeypatch.setattr(fp8_gluon, "DEFAULT_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))
    monkeypatch.setattr(fp8_gluon, "KEY_ORDER_HEAD_DIMS", frozenset(fp8_gluon.HEAD_DIMS))



def meta_call(head_dim: int = 128, causal: bool | str = False, sq: int = 4096, sk: int = 4096,
              dtype: torch.dtype = E4M3, **kw: object) -> binding.Call:
    q = torch.empty(2, 8, sq, head_dim, dtype=dtype, device="meta")
    k = torch.empty(2, 2, sk, head_dim, dtype=dtype, device="meta")
    return binding.check(q, k, k, causal, None, fp8=True, **kw)  # type: ignore[arg-type]


def served(call: binding.Call, target: Target = SM90, aligned: bool = True, index64: bool = False,
           packed: tuple[bool, bool, bool] = (False, False, False), dtype: str = "e4m3") -> Variant:
    return fp8.variant(target, call, call.shape, aligned, index64, packed, dtype=dtype)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# Registration and parameter layout


def test_the_spec_shares_flash_fwd_fp8s_parameters_and_has_its_own_source() -> None:
    spec = get(NAME)
    assert spec.params == FLASH_FWD_FP8.params and spec.aligned_params == FLASH_FWD_FP8.aligned_params
    assert spec.source_path.name == "fp8_gluon_kernel.py"
    assert [p.name for p in spec.source_paths[1:]] == ["gluon_tma.py"]  # what it imports
    assert source_fingerprint(NAME) not in {source_fingerprint("flash_fwd_fp8"), source_fingerprint("flash_fwd_gluon")}
    source = spec.source_path.read_text()
    imported = set(re.findall(r"^from (lazytriton\.[\w.]+) import", source, re.M))
    assert imported == set(spec.helpers)


@pytest.mark.parametrize(("head_dim", "tiles"), TILINGS)
def test_each_tiling_is_a_complete_variant_that_round_trips(head_dim: int, tiles: tuple[int, int, int]) -> None:
    v = fp8_gluon.variant("sm_90", "e4m3", head_dim, "top_left", True, False, 4096, 4096, tiles=tiles)
    assert v is not None and check_fields(v) is v and Variant.parse(str(v)) == v
    assert v.get("BLOCK_M") == tiles[0] and v.get("BLOCK_N") == tiles[1]
    assert v.get("num_stages") == fp8_gluon.stages(head_dim, tiles[1])
    assert launched_warps(v) == 12  # two consumer warpgroups of 4 warps, the producer warp padded to a warpgroup
    e5m2 = fp8_gluon.variant("sm_90", "e5m2", head_dim, "top_left", True, False, 4096, 4096, tiles=tiles)
    assert e5m2 is not None and e5m2.key() != v.key()


def test_tiles_outside_the_configs_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"tiles must be one of .* got \(128, 256, 4\)"):
        fp8_gluon.variant("sm_90", "e4m3", 128, "none", True, False, 4096, 4096, tiles=(128, 256, 4))  # spills
    with pytest.raises(ValueError, match="tiles must be one of"):
        fp8_gluon.variant("sm_90", "e4m3", 96, "none", True, False, 4096, 4096)


# ---------------------------------------------------------------------------
# The rule


@pytest.mark.parametrize(("target", "dtype", "d", "dv", "causal", "aligned", "index64", "sq", "sk", "features",
                          "why"), [
    ("sm_80", "e4m3", 128, 128, "none", True, False, 4096, 4096, False, "target"),
    ("sm_100", "e4m3", 128, 128, "none", True, False, 4096, 4096, False, "target"),
    ("sm_90", "bf16", 128, 128, "none", True, False, 4096, 4096, False, "dtype"),
    ("sm_90", "e4m3", 96, 96, "none", True, False, 4096, 4096, False, "head dims"),
    ("sm_90", "e4m3", 128, 64, "none", True, False, 4096, 4096, False, "head dims"),
    ("sm_90", "e4m3", 128, 128, "none", False, False, 4096, 4096, False, "aligned"),
    ("sm_90", "e4m3", 128, 128, "none", True, True, 4096, 4096, False, "32-bit"),
    ("sm_90", "e4m3", 128, 128, "none", True, False, 4096, 4096, True, "not implemented"),
    ("sm_90", "e4m3", 128, 128, "none", True, False, 4000, 4096, False, "multiples"),
    ("sm_90", "e4m3", 128, 128, "none", True, False, 4096, 4000, False, "multiples"),
    ("sm_90", "e4m3", 128, 128, "none", True, False, 0, 4096, False, "positive"),
    ("sm_90", "e4m3", 128, 128, "bottom_right", True, False, 2048, 1024, False, "without keys"),
])
def test_reason_refuses_what_the_kernel_does_not_compute(target: str, dtype: str, d: int, dv: int, causal: str,
                                                         aligned: bool, index64: bool, sq: int, sk: int,
                                                         features: bool, why: str) -> None:
    got = fp8_gluon.reason(target, dtype, d, dv, causal, aligned, index64, sq, sk, 128, 128, features)
    assert got is not None and why in got
    assert fp8_gluon.explain(target, dtype, d, dv, causal, aligned, index64, sq, sk, features).startswith(
        "flash_fwd_fp8 serves it")


def test_reason_refuses_a_softmax_scale_that_is_not_positive() -> None:
    for scale in (0.0, -0.125, float("nan")):
        got = fp8_gluon.reason("sm_90", "e4m3", 128, 128, "none", True, False, 4096, 4096, 128, 128, scale=scale)
        assert got is not None and "not positive" in got
        assert not fp8_gluon.fits(128, 128, False, 0, scale, 4096, 4096, False)


# ---------------------------------------------------------------------------
# Dispatch: sm_90 FP8 calls the table and rule take run the Gluon kernel; the rest flash_fwd_fp8


@pytest.mark.parametrize("head_dim", fp8_gluon.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, "top_left", "bottom_right"])
@pytest.mark.parametrize(("dtype", "name"), [(E4M3, "e4m3"), (E5M2, "e5m2")])
def test_fitting_calls_are_served_by_the_gluon_kernel(head_dim: int, causal: bool | str, dtype: torch.dtype,
                                                      name: str) -> None:
    call = meta_call(head_dim, causal, 4096, 4096, dtype)
    v = served(call, dtype=name)
    assert v.kernel == NAME and v.dtype == name and v.get("CAUSAL") == (causal is not False)
    assert (v.get("BLOCK_M"), v.get("BLOCK_N"), v.get("num_warps")) == fp8_gluon.TABLE[(head_dim, causal is not False)]
    assert fp8.memo_key(0, call, call.shape, True, False, dtype=name)[-1] is True
    assert fp8_gluon.reads_operand_order(v)  # its plan has V's copy written in operand order


@pytest.mark.parametrize(("call_kw", "serve_kw", "why"), [
    ({"head_dim": 96}, {}, "padded head dim"),
    ({"sq": 4000}, {}, "ragged query tile"),
    ({"sk": 4096 + 64}, {}, "ragged key tile"),
    ({"causal": "bottom_right", "sq": 4096, "sk": 2048}, {}, "rows without keys"),
    ({"window": (64, 64)}, {}, "window"),
    ({"softcap": 30.0}, {}, "softcap"),
    ({}, {"aligned": False}, "unaligned"),
    ({}, {"index64": True}, "64-bit offsets"),
    ({}, {"packed": (True, False, False)}, "packed sequences"),
    ({}, {"target": Target.parse("sm_100")}, "not Hopper"),
])
def test_the_rest_keeps_flash_fwd_fp8(call_kw: dict, serve_kw: dict, why: str) -> None:
    call = meta_call(**call_kw)
    chosen = served(call, **serve_kw)
    assert chosen.kernel == "flash_fwd_fp8" and not fp8_gluon.reads_operand_order(chosen), why


def test_sm80_is_still_refused_by_name() -> None:
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        served(meta_call(), target=Target.parse("sm_80"))


def test_the_switch_off_serves_flash_fwd_fp8_and_keys_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    call = meta_call()
    on = fp8.memo_key(0, call, call.shape, True, False, dtype="e4m3")
    monkeypatch.setattr(fp8_gluon, "BY_DEFAULT", False)
    assert served(call).kernel == "flash_fwd_fp8"
    off = fp8.memo_key(0, call, call.shape, True, False, dtype="e4m3")
    assert on[:-1] == off[:-1] and on != off  # a plan made for one is never used for the other
    assert "BY_DEFAULT is off" in fp8_gluon.explain("sm_90", "e4m3", 128, 128, "none", True, False, 4096, 4096, False)


def test_the_python_calls_read_v_in_operand_order_and_the_c_apis_twin_in_key_order() -> None:
    call = meta_call(256)
    operand = served(call)
    keys = fp8_gluon.default_variant("sm_90", "e4m3", 256, False, True, False, 4096, 4096, operand_order=False)
    assert keys is not None and keys.kernel == operand.kernel == NAME and keys.key() != operand.key()
    assert fp8_gluon.reads_operand_order(operand) and not fp8_gluon.reads_operand_order(keys)


def test_the_library_serves_it_at_the_head_dims_where_it_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """As shipped: on at every head dim for the Python calls; the C API's twin (V's keys in order) at 256 only,
    flash_fwd_fp8 keeping 64 and 128 there."""
    monkeypatch.undo()  # the module's own switches, not the fixture's
    assert fp8_gluon.BY_DEFAULT is True and fp8_gluon.DEFAULT_HEAD_DIMS == frozenset(fp8_gluon.HEAD_DIMS)
    assert fp8_gluon.served_head_dims(operand_order=False) == frozenset({256})
    for head_dim in fp8_gluon.HEAD_DIMS:
        for causal in (False, True):
            chosen = served(meta_call(head_dim=head_dim, causal=causal))
            assert chosen.kernel == NAME and fp8_gluon.reads_operand_order(chosen), (head_dim, causal)
        twin = fp8_gluon.default_variant("sm_90", "e4m3", head_dim, False, True, False, 4096, 4096,
                                         operand_order=False)
        assert (twin is not None) is (head_dim == 256), head_dim
    monkeypatch.setattr(fp8_gluon, "DEFAULT_HEAD_DIMS", frozenset({256}))
    why = fp8_gluon.explain("sm_90", "e4m3", 128, 128, "none", True, False, 4096, 4096, False)
    assert "flash_fwd_fp8 is faster at head dim 128" in why


def test_cache_explain_names_the_kernel_that_serves(capsys: pytest.CaptureFixture[str]) -> None:
    from lazytriton.cli import main

    assert main(["cache", "explain", "--dtype", "e4m3", "--head-dim", "256", "--seqlen-q", "4096", "--causal",
                 "bottom_right", "--target", "sm_90", "--json"]) == 0
    out = capsys.readouterr().out
    assert "the Gluon FP8 forward serves it: flash_fwd_fp8_gluon:sm_90:e4m3:" in out
    assert main(["cache", "explain", "--dtype", "e4m3", "--head-dim", "128", "--seqlen-q", "1000", "--target",
                 "sm_90"]) == 0
    assert "flash_fwd_fp8 serves it, not the Gluon FP8 forward" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# V's keys in the P V wgmma's operand order


def _operand_keys(group: int = fp8_gluon.KEY_GROUP) -> list[int]:
    """Of every 32 keys, the key whose probability the 8-bit A operand's position k holds when P keeps its thread.

    From the PTX ISA's fragments of wgmma .m64nNk32: the f32 accumulator gives the thread of lane l the columns
    8i + 2(l % 4) + e (i < N / 8, e < 2) of its two rows, its values in order i, e; the 8-bit A operand wants,
    of the same two rows, the positions 4(l % 4) + j and 16 + 4(l % 4) + j (j < 4), in that order. Position by
    position, the thread's accumulator values taken in order fill its operand positions in order.
    """
    keys = [0] * group
    for quad in range(4):
        held = [8 * i + 2 * quad + e for i in range(group // 8) for e in range(2)]
        wanted = [16 * half + 4 * quad + j for half in range(group // 16) for j in range(4)]
        for position, key in zip(wanted, held, strict=True):
            keys[position] = key
    return keys


def test_operand_order_is_what_the_wgmma_fragments_need() -> None:
    assert sorted(_operand_keys()) == list(range(32))
    torch.manual_seed(0)
    v = torch.randn(2, 3, 96, 16).to(E4M3)
    vt = fp8.transposed_v(v, operand_order=True)
    keys = [32 * c + key for c in range(3) for key in _operand_keys()]
    assert torch.equal(vt.view(torch.uint8), v.transpose(2, 3)[..., keys].contiguous().view(torch.uint8))
    assert vt.stride(-1) == 1 and vt.stride(-2) == 96  # the same copy as in key order: rows padded to 16 keys
    plain = fp8.transposed_v(v)
    assert torch.equal(plain.view(torch.uint8), v.transpose(2, 3).view(torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8.transposed_v(v[:, :, :80], operand_order=True)


def test_the_kernel_permutes_ps_keys_as_copy_v_writes_vs() -> None:
    """The kernel's reshape and permute of P (its source) applied to key indices give ``copy_v``'s order."""
    source = (REPO / "kernels/flash_fwd/fp8_gluon_kernel.py").read_text()
    body = source[source.index("def _operand("):source.index("def _descale(")]
    split = re.search(r"gl\.reshape\(p, \[ROWS, KEYS // 32, ([\d, ]+)\]\)", body)
    order = re.search(r"gl\.permute\(p, \[0, 1, ([\d, ]+)\]\)", body)
    assert split and order and "assert_trivial=True" in body
    digits = [int(n) for n in split.group(1).split(",")]
    dims = [int(n) - 2 for n in order.group(1).split(",")]
    keys = torch.arange(32).view(*digits).permute(*dims).reshape(32).tolist()
    assert keys == _operand_keys()
    # P at position kA times V's copy at kA, summed, is P . V: the same keys in the same order on both sides
    p, v = torch.rand(4, 64, dtype=torch.float64), torch.rand(1, 1, 64, 8, dtype=torch.float64)
    p_operand = p.view(4, 2, *digits).permute(0, 1, *(d + 2 for d in dims)).reshape(4, 64)
    vt = torch.empty(1, 1, 8, 64, dtype=torch.float64)
    fp8.copy_v(vt.transpose(2, 3), v, operand_order=True)
    torch.testing.assert_close(p_operand @ vt[0, 0].T, p @ v[0, 0], rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------
# Compiled for sm_90 by the installed Triton


def sm90_ptx(variant: Variant) -> str:
    """The PTX of a flash_fwd_fp8_gluon variant, compiled by the installed Triton for cuda:90."""
    import triton
    from triton.backends.compiler import GPUTarget
    try:
        from triton.experimental.gluon import GluonASTSource
    except ImportError:  # Triton 3.6
        from triton.experimental.gluon._runtime import GluonASTSource

    from lazytriton.variant import kernel_constexprs

    spec = get(NAME)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    source = GluonASTSource(fn, spec.signature(variant.dtype), constexprs=kernel_constexprs(variant, spec.constexprs),
                            attrs={(i,): [["tt.divisibility", 16]] for i, (name, _) in enumerate(spec.params)
                                   if name in spec.aligned_params})
    options = {"num_warps": variant.get("num_warps"), "enable_fp_fusion": True}
    return str(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"])


@pytest.mark.parametrize(("head_dim", "tiles"), TILINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_each_tiling_compiles_to_fp8_wgmmas_within_shared_memory_without_a_spill(
        head_dim: int, tiles: tuple[int, int, int], causal: bool, tmp_path: Path) -> None:
    from lazytriton.compiler import compile_variant

    v = fp8_gluon.variant("sm_90", "e4m3", head_dim, "top_left" if causal else "none", True, False, 4096, 4096,
                          tiles=tiles)
    assert v is not None
    entry = compile_variant(v)
    assert entry.num_warps == launched_warps(v) == 12
    shared = fp8_gluon.shared_bytes(head_dim, tiles[0], tiles[1])
    assert 0 <= entry.shared - shared <= fp8_gluon.SHARED_SLACK
    assert entry.shared + fp8_gluon.SHARED_SLACK <= fp8_gluon.SM90_SHARED
    ptx = sm90_ptx(v)
    dots = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.(e[45]m[23]\.e[45]m[23])", ptx))
    assert dots == {(str(tiles[1]), "e4m3.e4m3"), (str(head_dim), "e4m3.e4m3")}  # S = Q K^T and O += P V
    assert "mma.sync" not in ptx and "ld.local" not in ptx and "st.local" not in ptx
    # P becomes the A operand in its threads (no lane shuffle: the kernel asserts the conversion trivial), four
    # probabilities a register by two cvts, with no byte taken apart and packed again
    assert "prmt" not in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
    assert ptx.count("cp.async.bulk.tensor.2d.shared") >= 3  # Q (each consumer), K and Vt by the producer
    _, stores, loads = ptxas_report(ptx, tmp_path)
    assert (stores, loads) == (0, 0)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_ps_conversion_leaves_the_loop_to_the_softmax(head_dim: int, tmp_path: Path) -> None:
    """The operand-order variant's loop (SASS of one consumer step): no lane shuffle, one PRMT a register of P.

    The key-order variant (the C API's twin) moves P between lanes (SHFL.IDX) and takes bytes apart: the loop
    the operand order saves.
    """
    from lazytriton.compiler import compile_variant

    loops = {}
    for order in (True, False):
        v = fp8_gluon.variant("sm_90", "e4m3", head_dim, "none", True, False, 4096, 4096, operand_order=order)
        assert v is not None and fp8_gluon.reads_operand_order(v) is order
        loops[order] = opcode_counts(loop_opcodes(sass_of(compile_variant(v).binary, tmp_path), "MUFU"))
    served, keys = loops[True], loops[False]
    rows, keys_a_step, threads = 64, 128, 128  # a consumer warpgroup's step, both head dims' served tiles
    exps = rows * keys_a_step // threads + 2  # a thread's probabilities and its two rows' rescale factors
    assert served["MUFU"] == keys["MUFU"] == exps and served["QGMMA"] == keys["QGMMA"] > 0
    assert served["F2FP"] == 32 and served["PRMT"] <= 16 and "SHFL.IDX" not in served and "SEL" not in served
    assert keys["SHFL.IDX"] > 0 and sum(keys.values()) - sum(served.values()) > 150


def test_e5m2_inputs_take_e4m3_probabilities_against_e5m2_values() -> None:
    v = fp8_gluon.variant("sm_90", "e5m2", 128, "none", True, False, 4096, 4096)
    assert v is not None
    dots = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.(e[45]m[23]\.e[45]m[23])",
                          sm90_ptx(v)))
    assert dots == {("128", "e5m2.e5m2"), ("128", "e4m3.e5m2")}


OTHER_TRITON = "LAZYTRITON_TEST_OTHER_TRITON_PYTHON"


def test_every_tiling_compiles_under_the_other_triton_with_the_same_shared_memory() -> None:
    """Triton 3.6 on the GPU host, 3.9 on CI: each tiling compiles under both, to the same shared memory."""
    python = os.environ.get(OTHER_TRITON)
    if not python:
        pytest.skip(f"set {OTHER_TRITON} to a Python with the other Triton version (3.6 beside 3.9): .ci/run does")
    code = ("from lazytriton.compiler import compile_variant, triton_version\n"
            "from lazytriton.kernels.flash_fwd import fp8_gluon\n"
            f"for d, tiles in {TILINGS!r}:\n"
            "    for dtype in ('e4m3', 'e5m2'):\n"
            "        v = fp8_gluon.variant('sm_90', dtype, d, 'top_left', True, False, 4096, 4096, tiles=tiles)\n"
            "        print('ENTRY', triton_version(), d, tiles[1], dtype, compile_variant(v).shared)\n")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=1200, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    from lazytriton.compiler import triton_version

    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("ENTRY")]
    assert len(lines) == 2 * len(TILINGS) and all(line[1] != triton_version() for line in lines)
    for _, _, d, block_n, _, shared in lines:
        assert 0 <= int(shared) - fp8_gluon.shared_bytes(int(d), 128, int(block_n)) <= fp8_gluon.SHARED_SLACK


# ---------------------------------------------------------------------------
# GPU: FlashAttention-3's FP8 rule against float64 from the dequantised inputs


def _check_group(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scales: tuple,
                 causal: bool | str) -> None:
    """FA3's rule on kv head 0's query heads (B, H, S, D tensors): a float64 reference of one group fits memory."""
    group = q.shape[1] // k.shape[1]
    sl = tuple(x[:, :1] for x in scales)
    args = (q[:, :group], k[:, :1], v[:, :1], sl, causal)
    assert_fa3_rule(out[:, :group], reference(*args), reference(*args, same_precision=True))


@gpu
@pytest.mark.parametrize(("head_dim", "tiles"), TILINGS)
@pytest.mark.parametrize("causal", [False, "bottom_right"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("order", [True, False])  # V's keys in operand order (the Python calls') or in order (C API)
def test_gpu_every_tiling_by_fa3_rule(head_dim: int, tiles: tuple[int, int, int], causal: bool | str,
                                      dtype: torch.dtype, order: bool) -> None:
    torch.manual_seed(head_dim + tiles[1])
    b, hq, hk, sq, sk = 2, 4, 2, 1024, 2048  # GQA, more keys than queries (bottom-right: offset 1024)
    q = torch.randn(b, hq, sq, head_dim, device="cuda").to(dtype)
    k, v = (torch.randn(b, hk, sk, head_dim, device="cuda").to(dtype) for _ in range(2))
    scales = tuple(torch.rand(b, hk, device="cuda") * 2 + 0.05 for _ in range(3))
    call = binding.check(q, k, v, causal, None, fp8=True)
    chosen = fp8_gluon.variant("sm_90", binding.FP8_DTYPES[dtype], head_dim, call.causal, True, False, sq, sk,
                               tiles=tiles, operand_order=order)
    assert chosen is not None
    out, lse = fp8.run_variant(q, k, v, call, scales, chosen)
    _check_group(out, q, k, v, scales, causal)
    assert torch.isfinite(lse).all()


@gpu
@pytest.mark.parametrize("head_dim", fp8_gluon.HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_flash_attn_func_serves_the_gluon_kernel_and_agrees_with_flash_fwd_fp8(head_dim: int,
                                                                                    causal: bool) -> None:
    import lazytriton
    from lazytriton import machine

    torch.manual_seed(3 * head_dim)
    b, s, hq, hk = 1, 4096, 8, 2
    q = torch.randn(b, s, hq, head_dim, device="cuda").to(E4M3)
    k, v = (torch.randn(b, s, hk, head_dim, device="cuda").to(E4M3) for _ in range(2))
    scales = tuple(torch.rand(b, hk, device="cuda") + 0.5 for _ in range(3))
    call = binding.check(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, None, fp8=True)
    assert served(call, target=machine.target_of_device(q.device)).kernel == NAME
    out = lazytriton.flash_attn_func(q, k, v, causal=causal, q_descale=scales[0], k_descale=scales[1],
                                     v_descale=scales[2])
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    _check_group(out.transpose(1, 2), qt, kt, vt, scales, "bottom_right" if causal else False)
    triton_variant = fp8.variant(machine.target_of_device(q.device), call, call.shape, False, False, dtype="e4m3")
    assert triton_variant.kernel == "flash_fwd_fp8"  # unaligned: the Triton kernel's variant for the same call
    other, _ = fp8.run_variant(qt, kt, vt, call, scales, triton_variant)
    _check_group(other, qt, kt, vt, scales, "bottom_right" if causal else False)


# ---------------------------------------------------------------------------
# lazytriton tune --dtype e4m3: flash_fwd_fp8's tiles


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_tuners_e4m3_candidates_are_flash_fwd_fp8_variants(head_dim: int) -> None:
    from lazytriton.cli.tune import flash_fwd as tuner
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch

    found = tuner.candidates("e4m3", head_dim, 4096)
    assert found and all(c.block_n >= 32 for c in found)  # FP8 dots take 32 keys and more
    for config in found:
        v = fwd_dispatch.flash_fwd_variant(SM90, "e4m3", head_dim, False, True, 4096, config=config, seqlen_k=4096)
        assert v.kernel == "flash_fwd_fp8" and v.get("BLOCK_N") == config.block_n
