"""The decoding call's warm path in C++ (kernels/flash_decode/_hotpath.cpp) launches what the Python one launches.

On CPU: the extension is built once for this session against the installed torch (a missing C++ compiler or
header fails the test, with the build's own message). The warm path (``hot.make(cuda=False)``) runs on CPU tensors
through the real ``CudaApi``, ``LoadedKernel`` and compiled launch helper, each decoding kernel on its own copy of
the fake libcuda (tests/fake_libcuda.py: a copy records its own last launch), with the C++ tail (run()), with the
entry lookup in C++ too (serve(), the ``test_front_*`` tests) and in Python alone; each kernel's launch (every
parameter, grid, block, stream) must agree, pointers by the tensor they point at and the fresh ones (out, lse, the
workspace) by their place in what the call allocated. On a GPU: results, no synchronisation and CUDA graph capture
through the loaded module.
"""

from __future__ import annotations

import logging
import math
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hotpathlib
import pytest
import torch
from conftest import gpu, syncs_raise
from fake_libcuda import Fake
from hotpathlib import Runtime, arg_types
from test_driver import _entry
from test_kvcache_hot import _clone, _fresh_out, _nothing, bits, cold, random_call

import lazytriton
from lazytriton import runtime
from lazytriton.driver import DriverError, fastlaunch, helpers, helpers_build
from lazytriton.driver import gpu as driver_gpu
from lazytriton.kernels.flash_decode import (
    FLASH_DECODE_COMBINE,
    FLASH_DECODE_SPLIT,
    binding,
    checks,
    cpp_record,
    dispatch,
    hot,
    hotpath,
    hotpath_build,
    hotpath_record,
)
from lazytriton.kernels.kv_append import KV_APPEND
from lazytriton.kernels.kv_append import binding as append_binding
from lazytriton.kernels.trust import indices_trusted

KERNELS = (FLASH_DECODE_SPLIT.name, FLASH_DECODE_COMBINE.name, KV_APPEND.name)
STREAM = 0x5EED
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log2:RuntimeWarning")
built, cpp, helper = hotpathlib.tail_fixtures(hotpath, hotpath_build, "decode-hotpath")


@pytest.fixture(scope="module")
def fakes(fake_library: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Fake]:
    """A copy of the fake libcuda a kernel (each records its own last launch), by kernel name."""
    made = {}
    for name in KERNELS:
        copy = tmp_path_factory.mktemp(f"fake-{name}") / fake_library.name
        shutil.copyfile(fake_library, copy)
        fake = Fake(copy)
        fake.library = copy  # type: ignore[attr-defined]
        made[name] = fake
    return made


@pytest.fixture
def setup(fakes: dict[str, Fake], helper: Any, cpp: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The fake kernels, a runtime, both warm paths (Python, C++) and the general path's GPU launches on CPU."""
    monkeypatch.setattr(fastlaunch, "_module", lambda: helper)
    kernels = {}
    for name, fake in fakes.items():
        kernels[name] = driver_gpu.CudaApi(str(fake.library)).load(_entry(arg_types(name)), 0)  # type: ignore[attr-defined]
        assert fastlaunch.plan_bytes(kernels[name].fast) is not None
        fake.configure(hotpathlib.param_sizes(arg_types(name)))
    rt = Runtime()
    served: list[Any] = []

    def run(*args: Any) -> Any:
        done = cpp.run(*args)
        served.append(done)
        return done

    tail = type("Tail", (), {"run": staticmethod(run), "STREAM_INSIDE": cpp.STREAM_INSIDE})
    fronted: list[Any] = []

    def serve(*args: Any) -> Any:
        done = cpp.serve(*args)
        fronted.append(done)
        return done

    front = type("Front", (), {"run": staticmethod(cpp.run), "serve": staticmethod(serve),
                               "remember": staticmethod(cpp.remember), "STREAM_INSIDE": cpp.STREAM_INSIDE})
    monkeypatch.setattr(binding, "gpu_slots", lambda device_index, shared=0: binding.INTERPRETER_SMS)
    monkeypatch.setattr(binding, "min_split_keys", lambda head_dim: 0)
    paths = {name: hot.make(cuda=False, get_runtime=lambda: rt, raw_stream=lambda device_index: STREAM, cpp=module)
             for name, module in (("python", False), ("cpp", tail))}
    return {"runtime": rt, "kernels": kernels, "fakes": fakes, "paths": paths, "served": served, "fronted": fronted,
            "front": hot.make(cuda=False, get_runtime=lambda: rt, raw_stream=lambda device_index: STREAM, cpp=front)}


def memoise(rt: Runtime, kernels: dict[str, Any], args: dict[str, Any], tiles: tuple[int, int, int] = (16, 16, 16),
            fused: bool = False) -> None:
    """The plans the general path memoises for a call, both alignments, as the fake kernels."""
    from lazytriton import kvcache

    t = kvcache.inputs(args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"),
                       args.get("cache_seqlens"), None, args.get("block_table"))._replace(key_mask=args.get("key_mask"))
    call = checks.check(t, args.get("softmax_scale"), args.get("causal", False), num_splits=args.get("num_splits", 0))
    out, _ = binding.empty_outputs(t.q, call)
    _, index64 = binding.layout_flags(t, out)
    combine = (binding.FUSED, binding.FUSED) if fused else (kernels[FLASH_DECODE_COMBINE.name], tiles[2])
    for aligned in (False, True):
        rt.plans[binding.memo_key(None, t.q.dtype, call, aligned, index64, fused)] = (
            kernels[FLASH_DECODE_SPLIT.name], tiles[0], tiles[1], *combine)
        if t.k is not None:
            rt.plans[append_binding.memo_key(None, t.q.dtype, call, aligned, append_binding.layout_flags(t)[1])] = (
                kernels[KV_APPEND.name],)


def _served_args(args: dict[str, Any]) -> tuple[Any, ...]:
    return (args["q"], args["k_cache"], args["v_cache"], args.get("k"), args.get("v"), args.get("cache_seqlens"),
            args.get("block_table"), args.get("softmax_scale"), args.get("causal", False), args.get("num_splits", 0),
            True, args.get("return_softmax_lse", False), args.get("out"), args.get("key_mask"))


def _launches(fakes: dict[str, Fake], since: dict[str, int]) -> dict[str, tuple[Any, ...]]:
    """Each kernel's last launch since ``since`` (its launch count then): (ints, floats, grid, block, stream)."""
    found = {}
    for name, fake in fakes.items():
        params, state = fake.last_launch()
        if state["launches"] == since[name]:
            continue
        ints, floats = hotpathlib.decoded(params, arg_types(name))
        found[name] = (ints, floats, (state["grid_x"], state["grid_y"], state["grid_z"]), state["block_x"],
                       state["stream"], state["launches"] - since[name])
    return found


def _by_role(launches: dict[str, tuple[Any, ...]], args: dict[str, Any], result: Any) -> dict[str, tuple[Any, ...]]:
    """The launches with each pointer named: the call's tensors by name, the rest by its offset from the lowest."""
    named = {x.data_ptr(): n for n, x in args.items() if isinstance(x, torch.Tensor)}
    for n, x in zip(("out", "lse"), result if isinstance(result, tuple) else (result,), strict=False):
        named[x.data_ptr()] = n
    fresh = [v for name, (ints, *_) in launches.items() for v, kind in zip(ints, _pointer_kinds(name), strict=False)
             if kind and v not in named]
    base = min(fresh, default=0)
    shown = {}
    for name, (ints, floats, *rest) in launches.items():
        shown[name] = (tuple(named.get(v, ("fresh", v - base)) if kind else v
                             for v, kind in zip(ints, _pointer_kinds(name), strict=False)), tuple(floats), *rest)
    return shown


def _pointer_kinds(name: str) -> list[bool]:
    return [kind.startswith("*") for kind in arg_types(name) if kind != "fp32"]


def _call_both(setup: dict[str, Any], fakes: dict[str, Fake], args: dict[str, Any], trusted: bool,
               paths: dict[str, Any] | None = None, calls: int = 2) -> dict[str, Any]:
    """Each path's launches by role in its last of ``calls`` calls: the first describes, the others are served from
    the entry (``paths``: name -> warm function; default the Python and the C++ tail's)."""
    seen = {}
    for name, warm in (paths or setup["paths"]).items():
        with lazytriton.trusted_indices() if trusted else _nothing():
            for _ in range(calls):
                call = _fresh_out(_clone(args))
                since = {kernel: fake.last_launch()[1]["launches"] for kernel, fake in fakes.items()}
                result = warm(*_served_args(call))
                assert result is not None, name
        seen[name] = _by_role(_launches(fakes, since), call, result)
        if "out" in call:
            assert (result[0] if isinstance(result, tuple) else result) is call["out"], "the caller's out, returned"
    return seen


@pytest.mark.parametrize("seed", range(200, 232))
def test_cpp_tail_launches_what_the_python_tail_launches(setup: dict[str, Any], fakes: dict[str, Fake],
                                                         seed: int) -> None:
    args = random_call(seed)
    if random.Random(seed).random() < 0.3:  # a key mask (kvcache.with_key_mask's), any strides
        batch, capacity = args["q"].shape[0], args["k_cache"].shape[1] * (
            args["block_table"].shape[1] if "block_table" in args else 1)
        args["key_mask"] = torch.ones(capacity, batch, dtype=torch.bool).t()
    memoise(setup["runtime"], setup["kernels"], args)
    seen = _call_both(setup, fakes, args, trusted=seed % 2 == 0)
    assert seen["cpp"] == seen["python"]
    assert [done is not None for done in setup["served"]] == [False, True], (
        "the first call: no item yet (the Python run makes it); the second: the C++ tail")
    splits = seen["python"][FLASH_DECODE_SPLIT.name][0][binding.SPLIT_INT_PARAMS.index("num_splits")]
    assert set(seen["python"]) == {FLASH_DECODE_SPLIT.name} | ({KV_APPEND.name} if "k" in args else set()) | (
        {FLASH_DECODE_COMBINE.name} if splits > 1 else set())
    assert all(launch[-1] == 1 for launch in seen["cpp"].values()), "each kernel launched once a call"


def test_cpp_tail_checks_what_no_key_holds(setup: dict[str, Any]) -> None:
    """An int length out of range, caches sharing memory, out overlapping an input: declined in C++ and in Python
    (the general path raises its error)."""
    gen = torch.Generator().manual_seed(3)
    args = {"q": torch.randn(2, 1, 4, 32, generator=gen), "k_cache": torch.randn(2, 40, 2, 32, generator=gen),
            "v_cache": torch.randn(2, 40, 2, 32, generator=gen), "k": torch.randn(2, 1, 2, 32, generator=gen),
            "v": torch.randn(2, 1, 2, 32, generator=gen), "cache_seqlens": 5, "out": torch.empty(2, 1, 4, 32)}
    memoise(setup["runtime"], setup["kernels"], args)
    warm, served = setup["paths"]["cpp"], setup["served"]
    for _ in range(2):
        assert warm(*_served_args(_clone(args))) is not None
    assert [done is not None for done in served] == [False, True], "served in C++ from the second call"
    declined = {"length -1": lambda a: {"cache_seqlens": -1}, "length past the cache": lambda a: {"cache_seqlens": 40},
                "length past int64": lambda a: {"cache_seqlens": 1 << 70},
                "caches sharing memory": lambda a: {"v_cache": a["k_cache"]}, "out is q": lambda a: {"out": a["q"]},
                "out in v_cache": lambda a: {"out": a["v_cache"].view(-1)[:256].view(2, 1, 4, 32)}}
    for why, change in declined.items():
        served.clear()
        call = _clone(args)
        assert warm(*_served_args({**call, **change(call)})) is None, why
        assert served == [None], why


def test_cpp_tail_runs_the_eager_value_check(setup: dict[str, Any], fakes: dict[str, Fake],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    args = random_call(5)
    args["cache_seqlens"] = torch.full((args["q"].shape[0],), 1, dtype=torch.int32)
    memoise(setup["runtime"], setup["kernels"], args)
    warm = setup["paths"]["cpp"]
    checked: list[int] = []
    real = hot.Entry.check_values
    monkeypatch.setattr(hot.Entry, "check_values", lambda *a: (checked.append(1), real(*a))[1])
    for _ in range(2):
        assert warm(*_served_args(_clone(args))) is not None
    assert setup["served"][-1] is not None and len(checked) == 2
    bad = _clone(args)
    bad["cache_seqlens"][0] = 1 << 20
    launches = {name: fake.last_launch()[1]["launches"] for name, fake in fakes.items()}
    with pytest.raises(ValueError, match="cache_seqlens"):
        warm(*_served_args(bad))
    assert {name: fake.last_launch()[1]["launches"] for name, fake in fakes.items()} == launches, "nothing launched"
    with lazytriton.trusted_indices():
        checked.clear()
        assert warm(*_served_args(_clone(args))) is not None and checked == []


def test_cpp_tail_leaves_unmemoised_plans_and_the_fused_combine_to_python(setup: dict[str, Any]) -> None:
    args = {**random_call(9), "num_splits": 3}
    warm = setup["paths"]["cpp"]
    assert warm(*_served_args(_clone(args))) is None, "nothing memoised: the general path's turn"
    assert setup["served"] == [None], "no item: declined in C++, then in Python"
    setup["served"].clear()
    memoise(setup["runtime"], setup["kernels"], args, fused=True)
    with pytest.MonkeyPatch.context() as patch:
        from lazytriton.kernels.flash_decode import dispatch

        patch.setattr(dispatch, "FUSED_COMBINE_BY_DEFAULT", True)
        for _ in range(2):
            assert warm(*_served_args(_clone(args))) is not None
        assert setup["served"] == [], "the fused combine: the Python run alone (the entry has no record)"
    memoise(setup["runtime"], setup["kernels"], args)
    for _ in range(2):
        assert warm(*_served_args(_clone(args))) is not None
    assert setup["served"] and setup["served"][-1] is not None


def test_cpp_tail_raises_the_launch_error_as_the_kernel_does(setup: dict[str, Any], fakes: dict[str, Fake]) -> None:
    args = {**random_call(11), "num_splits": 1}
    args.pop("k", None), args.pop("v", None)
    memoise(setup["runtime"], setup["kernels"], args)
    for warm in setup["paths"].values():
        warm(*_served_args(_clone(args)))
    setup["served"].clear()
    split = fakes[FLASH_DECODE_SPLIT.name]
    split.configure(split.sizes, status=700)
    for warm in setup["paths"].values():
        with pytest.raises(DriverError, match=r"cuLaunchKernel\(k, grid=.*CUDA error 700"):
            warm(*_served_args(_clone(args)))
    assert setup["served"] == [], "the C++ tail raised (it returned nothing)"


def test_a_record_of_another_layout_is_refused(cpp: Any) -> None:
    assert cpp.LAYOUT == hotpath_record.LAYOUT and cpp.INTERFACE == hot.CPP_INTERFACE
    q = torch.empty(1)
    with pytest.raises(TypeError, match=r"run\(record"):
        cpp.run((b"",), q, q, q, None, None, None, None, None, None, False, 0, None)
    with pytest.raises(ValueError, match="malformed header"):
        cpp.run([b"short", None, None, None, None], q, q, q, None, None, None, None, None, None, False, 0, None)


def test_a_module_built_for_another_torch_is_never_loaded(built: Path, tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    hotpathlib.never_loads_another_torchs_build(hotpath, built, tmp_path, caplog)


def test_a_module_of_another_calling_convention_is_refused(built: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """A build of an older _hotpath.cpp (left in the package folder) is refused at load: the cache dir's is next."""
    monkeypatch.setattr(hotpath_record, "INTERFACE", hotpath_record.INTERFACE + 1)
    with caplog.at_level(logging.WARNING, logger="lazytriton.driver"):
        assert hotpath.load(built.parent, torch.__version__, fastlaunch.PLAN_VERSION) is None
    assert f"calling convention {hotpath_record.INTERFACE - 1}" in caplog.text and "not used" in caplog.text


def test_the_background_builder_builds_the_cpp_tail_under_its_key(built: Path, cache_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(helpers.VARIABLE, raising=False)
    helpers.reset()
    monkeypatch.setattr(hotpath_build, "build", hotpathlib.build_by_copying(hotpath, built))
    assert hotpath.NAME in helpers.registry() and helpers.registry()[hotpath.NAME] is hotpath.HELPER
    version = torch.__version__
    with hotpathlib.builder_lock(hotpath, cache_dir, version) as (where, lock):
        assert helpers_build.child(hotpath.NAME, cache_dir, where.name, lock) == 0
    target = where / hotpath.file_name(version)
    assert target.is_file()
    module = helpers.load_cached(hotpath.NAME, version, lambda at, path: hotpath.load_file(
        at, path, version, fastlaunch.PLAN_VERSION))
    assert module is not None and module.TORCH_VERSION == version
    helpers.reset()


# ---------------------------------------------------------------------------
# The entry lookup in C++ (serve(), remember())


def _with_mask(args: dict[str, Any], seed: int) -> dict[str, Any]:
    """``args`` with a key mask (kvcache.with_key_mask's, any strides) for about a third of the seeds."""
    if random.Random(seed).random() < 0.3:
        batch, capacity = args["q"].shape[0], args["k_cache"].shape[1] * (
            args["block_table"].shape[1] if "block_table" in args else 1)
        args["key_mask"] = torch.ones(capacity, batch, dtype=torch.bool).t()
    return args


@pytest.mark.parametrize("seed", range(300, 332))
def test_front_serves_from_its_table_what_the_python_path_launches(setup: dict[str, Any], fakes: dict[str, Fake],
                                                                   seed: int) -> None:
    args = _with_mask(random_call(seed), seed)
    memoise(setup["runtime"], setup["kernels"], args)
    paths = {"python": setup["paths"]["python"], "front": setup["front"]}
    seen = _call_both(setup, fakes, args, trusted=seed % 2 == 0, paths=paths, calls=3)
    assert seen["front"] == seen["python"]
    assert [done is not None for done in setup["fronted"]] == [False, True, True], (
        "the first call filed by the Python lookup, then served from the C++ table")
    assert len(setup["front"].__closure__[_cell(setup["front"], "table")].cell_contents) == 1
    assert all(launch[-1] == 1 for launch in seen["front"].values()), "each kernel launched once a call"


def _cell(fn: Any, name: str) -> int:
    """The index of the closure cell of ``fn`` holding its free variable ``name``."""
    return fn.__code__.co_freevars.index(name)


def _front_state(setup: dict[str, Any]) -> tuple[dict[int, Any], Any]:
    """(the C++ table, the serve() arguments after the call's: table, plans, fused, require_cuda, stream, trusted)."""
    warm = setup["front"]
    table = warm.__closure__[_cell(warm, "table")].cell_contents
    return table, (table, setup["runtime"].plans, False, False, lambda device_index: STREAM, indices_trusted)


BASES = {  # a paged step (new keys, lengths tensor, out, key mask) and a read with an int length
    "step": lambda: {**_step(), "key_mask": torch.ones(2, 48, dtype=torch.bool)},
    "read": lambda: {n: x for n, x in _step().items() if n not in ("k", "v", "block_table", "out")}
    | {"cache_seqlens": 7, "k_cache": torch.randn(2, 24, 2, 32), "v_cache": torch.randn(2, 24, 2, 32)},
}


def _step() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    return {"q": torch.randn(2, 1, 4, 32, generator=gen), "k_cache": torch.randn(6, 16, 2, 32, generator=gen),
            "v_cache": torch.randn(6, 16, 2, 32, generator=gen), "k": torch.randn(2, 1, 2, 32, generator=gen),
            "v": torch.randn(2, 1, 2, 32, generator=gen), "cache_seqlens": torch.tensor([5, 30], dtype=torch.int32),
            "block_table": torch.randperm(6, generator=gen).view(2, 3).int(), "causal": True,
            "out": torch.empty(2, 1, 4, 32)}


class _Sub(torch.Tensor):
    pass


# Calls the Python lookup declines though their key may equal a filed one's (a bool is an int, 1 == True, ...), or
# whose types it does not take: (name, the change to the served arguments, the bases it applies to).
LOOK_ALIKES: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], tuple[str, ...]]] = [
    ("q a subclass", lambda a: {"q": a["q"].as_subclass(_Sub)}, ("step", "read")),
    ("k_cache a subclass", lambda a: {"k_cache": a["k_cache"].as_subclass(_Sub)}, ("step", "read")),
    ("v_cache not a tensor", lambda a: {"v_cache": object()}, ("step", "read")),
    ("q on meta", lambda a: {"q": a["q"].to("meta")}, ("step", "read")),
    ("causal 1", lambda a: {"causal": int(a.get("causal", False))}, ("step", "read")),
    ("causal None", lambda a: {"causal": None}, ("read",)),
    ("an int scale", lambda a: {"softmax_scale": 1}, ("step", "read")),
    ("a nan scale", lambda a: {"softmax_scale": math.nan}, ("step", "read")),
    ("num_splits a bool", lambda a: {"num_splits": False}, ("step", "read")),
    ("num_splits a float", lambda a: {"num_splits": 0.0}, ("step", "read")),
    ("num_splits past int64", lambda a: {"num_splits": 1 << 70}, ("step", "read")),
    ("rotary_interleaved 1", lambda a: {"rotary_interleaved": 1}, ("step", "read")),
    ("cache_seqlens a bool", lambda a: {"cache_seqlens": True}, ("read",)),
    ("cache_seqlens a float", lambda a: {"cache_seqlens": 7.0}, ("read",)),
    ("cache_seqlens a subclass", lambda a: {"cache_seqlens": a["cache_seqlens"].as_subclass(_Sub)}, ("step",)),
    ("k without v", lambda a: {"v": None}, ("step",)),
    ("v without k", lambda a: {"v": a["q"][:, :, :2]}, ("read",)),
    ("k a subclass", lambda a: {"k": a["k"].as_subclass(_Sub)}, ("step",)),
    ("block_table a list", lambda a: {"block_table": a["block_table"].tolist()}, ("step",)),
    ("out a subclass", lambda a: {"out": a["out"].as_subclass(_Sub)}, ("step",)),
    ("key_mask a subclass", lambda a: {"key_mask": a["key_mask"].as_subclass(_Sub)}, ("step",)),
    ("key_mask not a tensor", lambda a: {"key_mask": 1}, ("step",)),
]
LOOK_ALIKE_CASES = [(base, *case) for case in LOOK_ALIKES for base in case[2]]


def _named_args(args: dict[str, Any]) -> dict[str, Any]:
    """hot.serve's arguments by name (the public function's names), the defaults filled in."""
    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "softmax_scale", "causal",
             "num_splits", "rotary_interleaved", "return_softmax_lse", "out", "key_mask")
    return dict(zip(names, (*_served_args(args)[:10], args.get("rotary_interleaved", True),
                            *_served_args(args)[11:]), strict=True))


def _filed(setup: dict[str, Any], base: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the base call's arguments, hot.serve's named arguments) once the front serves it, its plans memoised."""
    args = BASES[base]()
    memoise(setup["runtime"], setup["kernels"], args)
    for warm in (setup["paths"]["python"], setup["front"]):
        for _ in range(2):
            assert warm(*_served_args(_clone(args))) is not None
    assert setup["fronted"][-1] is not None, "served from the C++ table"
    return args, _named_args(args)


@pytest.mark.parametrize(("base", "why", "change", "bases"), LOOK_ALIKE_CASES, ids=[f"{c[0]}: {c[1]}"
                                                                                    for c in LOOK_ALIKE_CASES])
def test_front_declines_what_the_python_lookup_declines(setup: dict[str, Any], cpp: Any, base: str, why: str,
                                                       change: Any, bases: Any) -> None:
    args, named = _filed(setup, base)
    _, state = _front_state(setup)
    given = {**named, **change(args)}
    launches = {name: fake.last_launch()[1]["launches"] for name, fake in setup["fakes"].items()}
    assert cpp.serve(*given.values(), *state) is None, why
    assert setup["paths"]["python"](*given.values()) is None, why
    assert setup["front"](*given.values()) is None, why
    assert {name: fake.last_launch()[1]["launches"] for name, fake in setup["fakes"].items()} == launches, why


def test_front_reads_every_key_field_and_its_own_arguments(setup: dict[str, Any], cpp: Any) -> None:
    """Each key field's change misses the table (the Python lookup describes it); so do another runtime's plans, the
    fused combine, q where another device is required, and a stream read in C++ where torch has no getter."""
    args, named = _filed(setup, "step")
    table, state = _front_state(setup)
    assert cpp.serve(*named.values(), *state) is not None, "the filed call"
    other_keys = {
        "q's strides": {"q": torch.cat([args["q"], args["q"]], dim=-1)[..., :32]},
        "q's batch stride alone": {"q": torch.cat([args["q"], args["q"]])[::2]},
        "k_cache's block stride alone": {"k_cache": torch.cat([args["k_cache"], args["k_cache"]])[::2]},
        "lengths' stride": {"cache_seqlens": torch.stack([args["cache_seqlens"]] * 2, dim=1)[:, 0]},
        "q's dtype": {"q": args["q"].double()},
        "k_cache's sizes": {"k_cache": args["k_cache"][:5]},
        "v_cache's strides": {"v_cache": args["v_cache"].transpose(0, 1).contiguous().transpose(0, 1)},
        "k's dtype": {"k": args["k"].half()},
        "v's sizes": {"v": torch.cat([args["v"]] * 2, dim=1)},
        "no new keys": {"k": None, "v": None},
        "lengths an int": {"cache_seqlens": 5},
        "no lengths": {"cache_seqlens": None},
        "lengths' dtype": {"cache_seqlens": args["cache_seqlens"].long()},
        "block_table's strides": {"block_table": torch.stack([args["block_table"]] * 2, dim=-1)[..., 0]},
        "no out": {"out": None},
        "out's strides": {"out": torch.empty(2, 1, 4, 40)[..., :32]},
        "out's batch stride alone": {"out": torch.empty(4, 1, 4, 32)[::2]},
        "key mask's stride": {"key_mask": torch.ones(2, 96, dtype=torch.bool)[:, ::2]},
        "no key mask": {"key_mask": None},
        "key mask's dtype": {"key_mask": args["key_mask"].to(torch.uint8)},
        "not causal": {"causal": False},
        "a scale": {"softmax_scale": 0.25},
        "-0.0, a scale Python's dict finds as 0.0's": {"softmax_scale": -0.0},
        "num_splits": {"num_splits": 2},
    }
    for why, change in other_keys.items():
        assert cpp.serve(*{**named, **change}.values(), *state) is None, why
    table_, plans, fused, cuda, stream, trusted = state
    for why, changed in {"another runtime's plans": (table_, dict(plans), fused, cuda, stream, trusted),
                         "the fused combine": (table_, plans, True, cuda, stream, trusted),
                         "CUDA required": (table_, plans, fused, True, stream, trusted)}.items():
        assert cpp.serve(*named.values(), *changed) is None, why
    read_here = cpp.serve(*named.values(), table_, plans, fused, cuda, None, trusted)
    assert (read_here is None) == (not cpp.STREAM_INSIDE), "the stream read in C++: declined without torch's getter"
    with pytest.raises(TypeError, match=r"serve\(q, k_cache"):
        cpp.serve(*named.values(), [], plans, fused, cuda, stream, trusted)
    assert len(table) == 1


def test_front_compares_the_whole_key_and_follows_the_runtime(setup: dict[str, Any], cpp: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    args, named = _filed(setup, "step")
    table, _ = _front_state(setup)
    warm, fronted, rt = setup["front"], setup["fronted"], setup["runtime"]
    ((hashed, (key, plans, record, check)),) = table.items()
    assert len(key) == 9 * 80 + 32 and plans is rt.plans and record[0] is not None and check is not None
    table[hashed] = (key[:-1] + bytes([key[-1] ^ 1]), plans, record, check)  # same hash, another key: a collision
    assert warm(*_served_args(_clone(args))) is not None and fronted[-1] is None, "a miss: the Python path serves it"
    assert table[hashed][0] == key, "and files it again"
    assert warm(*_served_args(_clone(args))) is not None and fronted[-1] is not None
    rt.plans = dict(rt.plans)  # settings changed: the runtime's new plans (memoised again, here copied)
    assert warm(*_served_args(_clone(args))) is not None and fronted[-1] is None, "another runtime: described again"
    assert warm(*_served_args(_clone(args))) is not None and fronted[-1] is not None
    assert table[hashed][1] is rt.plans and table[hashed][2] is not record, "the new entry's record"
    other = {**named, "q": named["q"][:1], "k_cache": named["k_cache"][:1]}
    for most in (2, 2):  # the table starts again once it holds max entries
        assert cpp.remember(*other.values(), table, rt.plans, False, record, None, most)
        other["q"] = other["q"][:, :, :2]
    assert len(table) == 1
    assert not cpp.remember(*{**named, "q": named["q"][None]}.values(), table, rt.plans, False, record, None, 9), (
        "5 dims: no key, not filed")
    with pytest.raises(TypeError, match=r"remember\(q, k_cache"):
        cpp.remember(*named.values(), table, rt.plans, False, tuple(record), None, 9)
    monkeypatch.setattr(hot, "MAX_SHAPES", 1)
    fronted.clear()
    for _ in range(2):
        assert warm(*_served_args(_clone({**args, "causal": False}))) is not None
    assert len(table) == 1 and fronted[-1] is not None, "hot.py's MAX_SHAPES bounds the C++ table too"


def test_front_checks_the_values_eagerly_and_declines_what_run_declines(setup: dict[str, Any], fakes: dict[str, Fake],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    real = hot.Entry.check_values
    monkeypatch.setattr(hot.Entry, "check_values", lambda *a: (checked.append(1), real(*a))[1])
    args, _ = _filed(setup, "step")
    warm, fronted = setup["front"], setup["fronted"]
    checked.clear()
    for _ in range(2):
        assert warm(*_served_args(_clone(args))) is not None and fronted[-1] is not None
    assert len(checked) == 2, "every eager call, from the C++ front"
    with lazytriton.trusted_indices():
        assert warm(*_served_args(_clone(args))) is not None and fronted[-1] is not None
    assert len(checked) == 2, "none inside trusted_indices()"
    bad = _clone(args)
    bad["cache_seqlens"][0] = 1 << 20
    launches = {name: fake.last_launch()[1]["launches"] for name, fake in fakes.items()}
    fronted.clear()
    with pytest.raises(ValueError, match="cache_seqlens"):
        warm(*_served_args(bad))
    assert fronted == [] and len(checked) == 3, "raised by the C++ front's check, once"
    assert {name: fake.last_launch()[1]["launches"] for name, fake in fakes.items()} == launches, "nothing launched"
    read, _ = _filed(setup, "read")
    declined = {"length -1": lambda a: {"cache_seqlens": -1}, "length past the cache": lambda a: {"cache_seqlens": 25},
                "caches sharing memory": lambda a: {"v_cache": a["k_cache"]}}
    for why, change in declined.items():
        fronted.clear()
        call = _clone(read)
        assert warm(*_served_args({**call, **change(call)})) is None, why
        assert fronted == [None], why
    fronted.clear()
    call = _clone(args)
    assert warm(*_served_args({**call, "out": call["q"]})) is None and fronted == [None], "out is q"


def test_front_leaves_a_dropped_record_and_the_fused_combine_to_python(setup: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    args, _ = _filed(setup, "read")
    table, _ = _front_state(setup)
    warm, fronted = setup["front"], setup["fronted"]
    ((_, (_, _, record, _)),) = table.items()
    cpp_record.drop(record)  # what an entry whose launch the record cannot hold does to its record
    assert record[1:] == [None] * (len(hotpath_record.RECORD) - 1)
    fronted.clear()
    for _ in range(2):
        assert warm(*_served_args(_clone(args))) is not None
    assert fronted == [None, None], "declined in C++; the Python run serves it"
    monkeypatch.setattr(dispatch, "FUSED_COMBINE_BY_DEFAULT", True)
    memoise(setup["runtime"], setup["kernels"], {**args, "num_splits": 3}, fused=True)
    fronted.clear()
    for _ in range(2):
        assert warm(*_served_args({**_clone(args), "num_splits": 3})) is not None
    assert fronted == [None, None], "the fused combine: no record filed, the Python run"


def test_a_float8_q_passes_the_warm_path_to_widened(setup: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The public function tries the warm path before it widens a float8 q: declined at its key, nothing
    described, and a bad float8 call raises widened's error."""
    described: list[int] = []
    real = hot.describe
    monkeypatch.setattr(hot, "describe", lambda *a: (described.append(1), real(*a))[1])
    monkeypatch.setattr(hot, "serve", setup["front"])
    args, _ = _filed(setup, "read")
    described.clear()
    fp8 = {**args, "q": args["q"].to(torch.float8_e4m3fn), "k_cache": args["k_cache"].to(torch.bfloat16),
           "v_cache": args["v_cache"].to(torch.float8_e4m3fn)}
    with pytest.raises(TypeError, match="k_cache must be torch.float8_e4m3fn"):
        lazytriton.flash_attn_with_kvcache(**fp8)
    assert setup["fronted"][-1] is None and described == [1], "declined in C++, refused by describe's checks"


# ---------------------------------------------------------------------------
# On a GPU


def _gpu_rounds(monkeypatch: pytest.MonkeyPatch, counted: Any, counts: list[bool], seed: int, calls: int,
                out: bool) -> tuple[list[dict[str, Any]], list[bool]]:
    """bench_decode.py's decoding steps on the GPU through the Python warm path and through ``counted`` (the C++
    module, its calls counted in ``counts``): the last of ``calls`` calls of each (with an ``out`` of their own, or
    none) gives the general path's bits. Then each step, trusted, through ``counted`` twice, the second under
    ``syncs_raise()``: ``counts`` holds those second calls'. (the steps, ``counts`` after the first part)."""
    from test_kvcache_hot import _gpu_step, _results

    runtime.reset()
    steps = [_gpu_step(batch, keys, paged, lens, new, seed=seed) for batch, keys in ((1, 1024), (1, 4096), (8, 4096))
             for paged in (False, True) for lens, new in (("int", False), ("tensor", True))]
    for args in steps:
        want = None
        for name, tail in (("python", False), ("cpp", counted)):
            monkeypatch.setattr(hot, "serve", hot.make(cpp=tail))
            for _ in range(calls):
                again = {**_clone(args), "out": torch.empty_like(args["q"])} if out else _clone(args)
                got = _results(lazytriton.flash_attn_with_kvcache(**again, return_softmax_lse=True), again)
            if want is None:
                base = _clone(args)
                want = _results(cold(base, return_softmax_lse=True), base)
            for w, g in zip(want, got, strict=True):
                assert torch.equal(bits(w), bits(g)), name
    compared = list(counts)
    monkeypatch.setattr(hot, "serve", hot.make(cpp=counted))
    with lazytriton.trusted_indices():
        for args in steps:
            lazytriton.flash_attn_with_kvcache(**_clone(args))
        counts.clear()
        with syncs_raise():
            for args in steps:
                lazytriton.flash_attn_with_kvcache(**_clone(args))
    return steps, compared


def _counted(counts: list[bool], *names: str) -> Any:
    """The C++ module the warm path uses on this GPU (the test skips where there is none), as ``hot.make`` reads it:
    its ``STREAM_INSIDE`` and functions ``names``, the last one's calls counted in ``counts`` (whether each served)."""
    module = hot.cpp_tail()
    if module is False:
        pytest.skip(f"the decoding call's C++ warm path is not built for this torch ({hotpath.BUILD}) or the launch "
                    "helper is missing")

    def counted(*args: Any) -> Any:
        done = getattr(module, names[-1])(*args)
        counts.append(done is not None)
        return done

    functions = {name: staticmethod(getattr(module, name)) for name in names[:-1]}
    return type("Counted", (), {"STREAM_INSIDE": module.STREAM_INSIDE, **functions, names[-1]: staticmethod(counted)})


@gpu
@pytest.mark.gpu
def test_gpu_cpp_tail_equals_the_python_tail_never_synchronises_and_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ and the Python tail (and the general path) give the same bits; trusted warm steps through the C++
    tail synchronise nothing; a captured step replays to the general path's bits."""
    from test_kvcache_hot import replays_cold_bits

    served: list[bool] = []
    steps, compared = _gpu_rounds(monkeypatch, _counted(served, "run"), served, seed=7, calls=2, out=False)
    # a new entry's first call declines (its launches are prepared by the Python run), the second is served
    assert len(compared) == 2 * len(steps) and all(compared[1::2]), compared
    assert served == [True] * len(steps)
    for args in steps[:4]:  # described before the capture
        assert replays_cold_bits(args, served, {"return_softmax_lse": True}) == [True], "captured through the C++ tail"
    runtime.reset()


@gpu
@pytest.mark.gpu
def test_gpu_front_equals_the_python_path_never_synchronises_and_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The entry lookup in C++ (serve(), then run()'s tail) gives the Python path's bits and the general path's;
    trusted warm steps through it synchronise nothing; a step captured through it replays to the general path's
    bits."""
    from test_kvcache_hot import replays_cold_bits

    fronted: list[bool] = []
    front = _counted(fronted, "run", "remember", "serve")
    # the first call files the entry, the others are served from the C++ table
    steps, compared = _gpu_rounds(monkeypatch, front, fronted, seed=9, calls=3, out=True)
    assert compared == [False, True, True] * len(steps), compared
    assert fronted == [True] * len(steps), "served in C++, no synchronisation"
    for args in steps[:4]:  # filed, then served in C++: its items made before the capture
        assert replays_cold_bits(args, fronted, {"return_softmax_lse": True}, describe=2) == [True], (
            "captured through the C++ front")
    runtime.reset()


def test_profile_kvcache_runs_every_case(cpp: Any, helper: Any, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/profile_kvcache.py's cases, a few calls each, through both tails and the general path."""
    import sys

    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setattr(fastlaunch, "_module", lambda: helper)
    monkeypatch.setattr(hot, "serve", hot.serve)  # the profile swaps it and puts it back
    sys.modules.pop("profile_kvcache", None)
    import profile_kvcache

    for made in (profile_kvcache.cases(), profile_kvcache.transformers_cases()):
        found = profile_kvcache.rows(rounds=1, calls=2, made=made, cpp=cpp)
        assert [row[0] for row in found] == list(made)
        assert all(0 < spent < 1e6 for row in found for spent in row[1:]), found
    assert profile_kvcache.main(["--rounds", "1", "--calls", "2", "--light"]) == 0
    assert "read, int length" in capsys.readouterr().out
