"""What a cold process imports stays what it needs: checked on sys.modules in fresh interpreters, never on time.

- ``import lazytriton.flash`` (after torch) imports no other family's
  descriptions, no zstandard (the images' codec), no triton and not the FP8
  forward's calls (imported by the first FP8 call); planning the
  forward's first call (its variant and key, on sm_90 and sm_80) imports no
  other family either.
- ``kernels.get`` imports the module of the kernel's description alone
  (``kernels.SPEC_HOMES``), not every family's; each row of SPEC_HOMES
  names its kernel's description, in the kernel's family's folder.
- An image opened and listed imports no zstandard; reading an entry does,
  unless the image stores its entries as they are (codec ``none``).
- ``import lazytriton.flash`` imports none of ``NOT_ON_IMPORT``: the warm
  paths' module (hot.py, imported once a warm path can serve:
  ``forward_routes.WarmPathsLater``), the local tier, the Gluon FP8 forward's
  rule, the other public surfaces, the torch ops and the image writer
  (``cache_format/image.py``: a lookup needs ``image_reader.py`` alone);
  ``import lazytriton.sdpa`` imports no FP8 forward.
- ``import lazytriton.flash`` compiles no generated text (flash_fwd's
  ``pack`` is a module, ``pack_generated.py``): every ``compile`` it makes is
  of a module's own file, and none where the files have bytecode.
- An image hit through the runtime's chain never makes the local tier (nor
  imports its module) and imports none of ``NOT_ON_A_HIT`` (the image
  writer); a miss makes the local tier.
- The driver's first use (its modules, the launch helper's file name and
  the package's own build looked for) imports neither the launch helper's
  build recipe (``driver/fastlaunch_build.py``) nor ``fsutil``: only a
  helper the package lacks needs its source.
- A call whose q, k or v requires grad never imports hot.py (the warm paths
  decline it), plans memoised or not.
- On a GPU, a first call imports no hot.py; a second call of its shape
  makes the warm path (hot.py's generated function) and gets the same
  result (GPU test).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python
from test_flash_fwd import on_gpu
from test_image import synthetic_entries

from lazytriton import kernels
from lazytriton.cache_format.image import write_image

# What ``import lazytriton.flash`` (after torch) leaves for a first use that needs it.
NOT_ON_IMPORT = (
    "lazytriton.kernels.flash_fwd.hot", "lazytriton.store.local", "lazytriton.kernels.flash_fwd.fp8_gluon",
    "lazytriton.kernels.flash_fwd.fp8_gluon_spec", "lazytriton.fp8_calls", "lazytriton.mla_calls",
    "lazytriton.sdpa", "lazytriton.kvcache", "lazytriton.combine", "lazytriton.kvcache_slots", "lazytriton.ops",
    "lazytriton.ops_varlen", "lazytriton.eager", "lazytriton.preloading", "lazytriton.compiler",
    "lazytriton.misslog", "lazytriton.cli", "lazytriton.prewarm", "diskcache", "sqlite3", "zstandard", "triton",
    "lazytriton.cache_format.image", "lazytriton.fsutil",
)
# What an image hit through the runtime's chain leaves: the image writer (its reader is image_reader.py) and the
# files' helpers the writers use.
NOT_ON_A_HIT = ("lazytriton.store.local", "lazytriton.cache_format.image", "lazytriton.fsutil")
FOLDERS = tuple(kernels.FAMILIES)  # each family has its folder, kernels/<family>/
# The folders whose parameter lists a folder's descriptions are built from (flash_bwd's take flash_fwd's sizes and
# pointers): looking up one of its kernels imports them too.
BUILT_ON = {"flash_bwd": {"flash_fwd"}}


def _family_modules(imported: list[str]) -> set[str]:
    """The kernel folders (kernels/<family>/) that the modules in ``imported`` belong to."""
    prefix = "lazytriton.kernels."
    return {name[len(prefix):].split(".")[0] for name in imported
            if name.startswith(prefix) and name[len(prefix):].split(".")[0] in FOLDERS}


def _imported(code: str) -> dict[str, list[str]]:
    """Run ``code`` fresh; it prints a JSON dict of module lists as its last line."""
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, list[str]] = json.loads(result.stdout.splitlines()[-1])
    return report


FORWARD = """
import json, sys, torch
torch_modules = set(sys.modules)
import lazytriton.flash
after_import = set(sys.modules)
from lazytriton.kernels.flash_fwd import binding
from lazytriton.target import Target
q, k, v = (torch.empty((1, 2, 128, 64), dtype=torch.float16, device="meta") for _ in range(3))
call = binding.check(q, k, v, True)
out, lse = binding.empty_outputs(q, call.shape, call.head_dim_v)
_, aligned, index64 = binding.pack(q, k, v, out, lse, call)
key = binding.memo_key(0, q.dtype, call.shape, True, aligned, index64, offset=call.offset, scale=call.scale)
kernels = []
for target in ("sm_90", "sm_80"):
    variant = binding.variant(Target.parse(target), q.dtype, call.shape, True, aligned, index64,
                              gluon=binding.gluon_key(key))
    variant.key()  # the source fingerprint: the kernel's description, looked up
    kernels.append(variant.kernel)
print(json.dumps({"import": sorted(after_import - torch_modules), "plan": sorted(set(sys.modules) - after_import),
                  "kernels": kernels}))
"""


def test_the_forward_imports_no_other_family_no_codec_no_compiler_and_no_fp8_path() -> None:
    report = _imported(FORWARD)
    assert report["kernels"] == ["flash_fwd_gluon", "flash_fwd"]  # the lookups the check below covers
    assert _family_modules(report["import"]) == {"flash_fwd"}
    assert _family_modules(report["plan"]) <= {"flash_fwd"}, report["plan"]
    imported = report["import"] + report["plan"]
    for name in ("zstandard", "triton", "lazytriton.compiler", "lazytriton.interpreter", "lazytriton.fp8_calls",
                 "lazytriton.kernels.flash_fwd.fp8"):
        assert not any(module == name or module.startswith(name + ".") for module in imported), name


LOOKUP = """
import json, sys
before = set(sys.modules)
from lazytriton import kernels
imported = set(sys.modules)
spec = kernels.get({kernel!r})
assert spec is kernels.get({kernel!r})  # looked up once
print(json.dumps({{"registry": sorted(imported - before), "lookup": sorted(set(sys.modules) - imported),
                  "name": [spec.name]}}))
"""


@pytest.mark.parametrize("kernel", sorted(kernels.SPEC_HOMES))
def test_a_lookup_imports_its_own_folder_only(kernel: str) -> None:
    module, attribute = kernels.SPEC_HOMES[kernel]
    folder = module.split(".")[2]
    report = _imported(LOOKUP.format(kernel=kernel))
    assert report["name"] == [kernel]
    assert _family_modules(report["registry"]) == set()  # the registry alone imports no family
    assert _family_modules(report["lookup"]) == {folder, *BUILT_ON.get(folder, ())}, report["lookup"]
    assert kernel == folder or kernel.startswith(folder + "_")  # the family's name starts its kernels' names


def test_every_kernel_has_a_home_and_an_unknown_name_lists_them() -> None:
    for family, members in kernels.FAMILIES.items():
        assert all(kernels.SPEC_HOMES[kernel][0].split(".")[2] == family for kernel in members), family
    for kernel in kernels.SPEC_HOMES:
        assert kernels.get(kernel).name == kernel
    with pytest.raises(ValueError, match="unknown kernel 'flash_nothing'; known: .*flash_fwd_gluon"):
        kernels.get("flash_nothing")
    with pytest.raises(ValueError, match="unknown kernel 3"):
        kernels.get(3)  # type: ignore[arg-type]


IMAGE = """
import json, sys
from lazytriton.cache_format.image import Image
image = Image({path!r})
keys = sorted(image.keys())
listed = "zstandard" in sys.modules
entry = image.read(keys[0])
print(json.dumps({{"listed": [str(listed)], "read": [str("zstandard" in sys.modules)], "key": [entry.key]}}))
"""


def test_an_image_imports_its_codec_only_to_read_an_entry(tmp_path: Path) -> None:
    entries = synthetic_entries(4)
    path = tmp_path / "lazy.ltimg"
    write_image(path, entries)
    report = _imported(IMAGE.format(path=str(path)))
    assert report == {"listed": ["False"], "read": ["True"], "key": [min(e.key for e in entries)]}


def test_an_image_of_plain_entries_is_read_without_zstandard(tmp_path: Path) -> None:
    entries = synthetic_entries(4)
    path = tmp_path / "plain.ltimg"
    assert write_image(path, entries, codec="none").codec == "none"
    report = _imported(IMAGE.format(path=str(path)))
    assert report == {"listed": ["False"], "read": ["False"], "key": [min(e.key for e in entries)]}


SURFACES = """
import json, sys, torch
before = set(sys.modules)
import lazytriton.flash
flash = set(sys.modules)
import lazytriton.sdpa
print(json.dumps({"flash": sorted(flash - before), "sdpa": sorted(set(sys.modules) - flash)}))
"""


def _named(imported: list[str], names: tuple[str, ...]) -> list[str]:
    return [name for name in names if any(module == name or module.startswith(name + ".") for module in imported)]


def test_a_plain_import_leaves_the_warm_paths_the_local_tier_and_the_other_surfaces() -> None:
    report = _imported(SURFACES)
    assert _named(report["flash"], NOT_ON_IMPORT) == []
    assert "lazytriton.interface" in report["flash"]  # the check can see what the import brought
    assert _named(report["sdpa"], ("lazytriton.fp8_calls", "lazytriton.kernels.flash_fwd.fp8",
                                   "lazytriton.kernels.flash_fwd.hot")) == []


COMPILES = """
import builtins, json, sys, torch
compiled = []
compile_ = builtins.compile
def counted(source, filename, *args, **kwargs):
    compiled.append(str(filename))
    return compile_(source, filename, *args, **kwargs)
builtins.compile = counted
import lazytriton.flash
builtins.compile = compile_
print(json.dumps({"generated": [name for name in compiled if not name.endswith(".py")],
                  "imported": ["lazytriton.kernels.flash_fwd.pack_generated" in sys.modules]}))
"""


def test_the_import_compiles_no_generated_text() -> None:
    assert _imported(COMPILES) == {"generated": [], "imported": [True]}


WARM_LATER = """
import json, sys, torch
from lazytriton import runtime
from lazytriton.forward_routes import HOT, WarmPathsLater
namespace = {{}}
namespace["hot"] = stand_in = WarmPathsLater(namespace, "hot")
steps = {{}}
steps["no runtime"] = [stand_in.forward_bhsd(1, 2, 3, True, None) is None, namespace["hot"] is stand_in]
rt = runtime.get()
steps["no plan"] = [stand_in.output_bshd(1, 2, 3, True, None) is None, namespace["hot"] is stand_in]
steps["imported"] = [HOT in sys.modules]
q, k, v = (torch.zeros((1, 1, 1, 8)) for _ in range(3))
if {planned!r}:
    rt.plans[("a plan",)] = None  # a memoised plan: a warm path may serve now, but never a call with gradients
    grad = [stand_in.forward_bhsd(q, k, v.requires_grad_(), True, None) is None, stand_in.output_bshd(
        q.requires_grad_(), k, v, False, None) is None, namespace["hot"] is stand_in, HOT in sys.modules,
        "forward_bhsd" in vars(stand_in)]  # an attribute from then on: read without __getattr__
    steps["gradients"] = grad
    q, v = q.detach(), v.detach()
    steps["served"] = [stand_in.forward_bhsd(q, k, v, True, None) is None]  # CPU tensors: the warm path declines
    steps["after"] = [namespace["hot"] is sys.modules[HOT]]
else:
    import importlib
    importlib.import_module(HOT)  # imported by someone else (a test, a benchmark)
    function = stand_in.forward_bhsd
    hot = sys.modules[HOT]
    steps["after"] = [namespace["hot"] is hot, function is hot.forward_bhsd]
print(json.dumps(steps))
"""


@pytest.mark.parametrize("planned", [True, False])
def test_the_warm_paths_module_comes_when_a_plan_exists_or_it_is_imported(planned: bool) -> None:
    report = _imported(WARM_LATER.format(planned=planned))
    expected = {"no runtime": [True, True], "no plan": [True, True], "imported": [False], "after": [True, True]}
    if planned:  # calls with gradients declined without the module; the first call without them imports it
        expected |= {"gradients": [True, True, True, False, True], "served": [True], "after": [True]}
    assert report == expected


CHAIN = """
import json, sys
from lazytriton import config, runtime
config.configure(images=[{image!r}], cache_dir={cache_dir!r})
rt = runtime.get()
names = [tier.name for tier in rt.chain.tiers]
entry, tier = rt.chain.get({key!r})
hit = [entry.key == {key!r}, tier, [name for name in {not_on_a_hit!r} if name in sys.modules]]
missed = rt.chain.get("0" * 32)
print(json.dumps({{"names": names, "hit": hit, "miss": [missed is None, "lazytriton.store.local" in sys.modules,
                                                       type(rt.local).__name__, rt.chain.tiers[1].tier is rt.local]}}))
"""


def test_an_image_hit_never_makes_the_local_tier(tmp_path: Path) -> None:
    entries = synthetic_entries(2)
    path = tmp_path / "hit.ltimg"
    write_image(path, entries)
    report = _imported(CHAIN.format(image=str(path), cache_dir=str(tmp_path / "cache"), key=entries[0].key,
                                    not_on_a_hit=NOT_ON_A_HIT))
    assert report == {"names": ["image", "local"], "hit": [True, "image", []],
                      "miss": [True, True, "LocalTier", True]}


WARM_ON_GPU = """
import json, sys, torch
import lazytriton
from lazytriton import runtime
torch.manual_seed(0)
q, k, v = (torch.randn((1, 2, 128, 64), device="cuda", dtype=torch.bfloat16) for _ in range(3))
first = lazytriton.attn_fwd(q, k, v, causal=True)[0]
after_first = "lazytriton.kernels.flash_fwd.hot" in sys.modules
plans = len(runtime.get().plans)
second = lazytriton.attn_fwd(q, k, v, causal=True)[0]
from lazytriton.kernels.flash_fwd import hot
torch.cuda.synchronize()
print(json.dumps({{"first": [after_first, plans > 0],
                  "second": [getattr(hot.forward_bhsd, "stand_in", False), bool(torch.equal(first, second))],
                  "interface": [sys.modules["lazytriton.interface"].hot is hot]}}))
"""


@on_gpu
def test_gpu_the_first_call_leaves_hot_py_and_the_second_makes_the_warm_path() -> None:
    report = _imported(WARM_ON_GPU.format())
    assert report == {"first": [False, True], "second": [False, True], "interface": [True]}


DRIVER_FIRST_USE = """
import json, sys, torch
import lazytriton.flash
from lazytriton.driver import gpu, helpers
helpers.in_package(helpers.FASTLAUNCH)
names = [helpers.module_file(helpers.FASTLAUNCH)]
print(json.dumps({"imported": [name for name in ("lazytriton.driver.fastlaunch_build", "lazytriton.fsutil")
                               if name in sys.modules], "names": names}))
"""


def test_the_driver_first_use_leaves_the_launch_helper_build_recipe() -> None:
    from lazytriton.driver import fastlaunch_build

    assert _imported(DRIVER_FIRST_USE) == {"imported": [], "names": [fastlaunch_build.FILE_NAME]}
