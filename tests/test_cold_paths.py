"""What a cold process's first call does without: checked on what runs and what is read, never on time.

- flash_fwd's and flash_bwd's ``pack`` are modules generated from the parameter
  descriptions (each binding's ``pack_module_text``), imported as bytecode
  rather than compiled in each process: each file is exactly the text the
  descriptions give now, and the function packs what they say.
- ``helpers.on_first_use`` neither reads nor hashes the source of a helper
  the package holds (one ``stat`` each); a helper it does not hold still
  gets its key (its source hashed) and its background build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lazytriton.driver import helpers
from lazytriton.kernels.flash_bwd import FLASH_BWD_DKDV, FLASH_BWD_DQ
from lazytriton.kernels.flash_bwd import binding as bwd_binding
from lazytriton.kernels.flash_bwd import pack_generated as bwd_pack_generated
from lazytriton.kernels.flash_fwd import FLASH_FWD, binding, pack_generated

TORCH = "2.11.0+cu130"  # a process that imported torch: both helpers wanted


def test_the_generated_pack_module_is_the_text_the_description_gives() -> None:
    path = Path(pack_generated.__file__)
    assert path.name == binding.PACK_MODULE
    assert path.read_text() == binding.pack_module_text(), (
        "kernels/flash_fwd/pack_generated.py is stale: run python -c 'from lazytriton.kernels.flash_fwd import "
        "binding; binding.write_pack_module()'")
    assert binding.pack is pack_generated.pack


def test_the_generated_pack_packs_each_parameter_from_its_source() -> None:
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn((2, 40, 4, 64), generator=generator).transpose(1, 2) for _ in range(3))
    call = binding.check(q, k, v, False, window=(5, 3))
    out, lse = binding.empty_outputs(q, call.shape, call.head_dim_v)
    ints, aligned, index64 = binding.pack(q, k, v, out, lse, call, 11, 12, 13, 14)
    names = [name for name, kind in FLASH_FWD.params if not kind.startswith("fp")]
    assert len(ints) == len(names) == len(binding.PARAM_SOURCES) - len(binding.FLOAT_PARAMS)
    by_name = dict(zip(names, ints, strict=True))
    assert [by_name[name] for name in ("Q", "K", "V", "Out", "Lse")] == [t.data_ptr() for t in (q, k, v, out, lse)]
    assert [by_name[name] for name in ("Cu_seqlens_q", "Cu_seqlens_k", "Seqused_q", "Seqused_k")] == [11, 12, 13, 14]
    assert [by_name[f"stride_q{d}"] for d in "bhs"] == [q.stride(0), q.stride(1), q.stride(2)]
    assert [by_name[name] for name in ("window_left", "window_right")] == [5, 3]
    assert by_name["seqlen_q"] == 40 and by_name["head_dim"] == 64 and by_name["group_size"] == 1
    assert by_name["causal_offset"] == call.offset
    assert aligned == (not any(by_name[name] % 16 for name in FLASH_FWD.aligned_params)) and index64 is False


def test_the_backward_s_generated_pack_module_is_the_text_the_descriptions_give() -> None:
    path = Path(bwd_pack_generated.__file__)
    assert path.name == bwd_binding.PACK_MODULE
    assert path.read_text() == bwd_binding.pack_module_text(), (
        "kernels/flash_bwd/pack_generated.py is stale: run python -c 'from lazytriton.kernels.flash_bwd import "
        "binding; binding.write_pack_module()'")
    assert bwd_binding.pack is bwd_pack_generated.pack


def test_the_backward_s_generated_pack_packs_each_parameter_from_its_source() -> None:
    generator = torch.Generator().manual_seed(7)
    q, k, v, o, do = (torch.randn((2, 40, 4, 64), generator=generator).transpose(1, 2) for _ in range(5))
    call = binding.check(q, k, v, False, window=(5, 3))
    lse, delta = (torch.empty((2, 4, 40)) for _ in range(2))
    grads = bwd_binding.empty_grads(q, k, v)
    dq_ints, dkdv_ints, aligned, seq16, index64 = bwd_binding.pack(q, k, v, o, do, lse, delta, *grads, call, 11, 12,
                                                                   13, 14)
    for spec, ints in ((FLASH_BWD_DQ, dq_ints), (FLASH_BWD_DKDV, dkdv_ints)):
        names = [name for name, kind in spec.params if not kind.startswith("fp")]
        assert len(ints) == len(names)
        by_name = dict(zip(names, ints, strict=True))
        assert [by_name[name] for name in ("Q", "K", "V", "DO", "Lse", "Delta")] == [
            t.data_ptr() for t in (q, k, v, do, lse, delta)]
        assert [by_name[name] for name in ("Cu_seqlens_q", "Cu_seqlens_k", "Seqused_q", "Seqused_k")] == [
            11, 12, 13, 14]
        assert [by_name[f"stride_do{d}"] for d in "bhs"] == [do.stride(0), do.stride(1), do.stride(2)]
        assert [by_name[name] for name in ("window_left", "window_right")] == [5, 3]
        assert by_name["seqlen_k"] == 40 and by_name["head_dim"] == 64 and by_name["causal_offset"] == call.offset
    assert dict(zip([name for name, kind in FLASH_BWD_DQ.params if not kind.startswith("fp")], dq_ints,
                    strict=True))["DQ"] == grads.dq.data_ptr()
    assert seq16 is False and index64 is False  # packed (cu_q given): never SEQ16
    pointers = [q, k, v, o, do, lse, delta, *grads]
    assert aligned == (not any(t.data_ptr() % 16 for t in pointers)
                       and not any(s % 16 for t in (q, k, v, o, do, *grads) for s in t.stride()[:3]))


class Recorder:
    """Stands in for ``helpers.source_hash`` (reads and hashes a helper's source): the helpers it was asked for."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def __call__(self, helper: str) -> str:
        self.asked.append(helper)
        return "0" * 16


@pytest.fixture
def first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh process's helper state, a torch version, a counted spawn and a counted source hash."""
    monkeypatch.delenv(helpers.VARIABLE, raising=False)
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(helpers, "running_torch", lambda: TORCH)
    spawned: list[list[str]] = []
    monkeypatch.setattr(helpers, "_spawn", lambda argv, cwd, log_fd, lock_fd: spawned.append(list(argv)))
    hashed = Recorder()
    monkeypatch.setattr(helpers, "source_hash", hashed)
    from lazytriton import config

    config.reset()
    helpers.reset()
    yield spawned, hashed
    helpers.reset()
    monkeypatch.undo()
    config.reset()


def test_first_use_reads_no_source_of_a_helper_the_package_holds(first_use: Any, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    spawned, hashed = first_use
    monkeypatch.setattr(helpers, "in_package", lambda helper, torch_version=None: tmp_path / helper)
    assert helpers.wanted(TORCH) == tuple(helpers.registry())  # both helpers looked at
    assert helpers.on_first_use() == [] and spawned == [] and hashed.asked == []


def test_first_use_still_keys_and_builds_a_helper_the_package_lacks(first_use: Any, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    spawned, hashed = first_use
    packaged = helpers.FASTLAUNCH
    monkeypatch.setattr(helpers, "in_package",
                        lambda helper, torch_version=None: tmp_path / helper if helper == packaged else None)
    lacking = [name for name in helpers.registry() if name != packaged]
    started = helpers.on_first_use()
    assert started == [helpers.key(name, TORCH) for name in lacking]
    assert [argv[4] for argv in spawned] == lacking
    assert packaged not in hashed.asked and set(lacking) <= set(hashed.asked)
