"""``cache verify`` and ``cache import`` check an entry's launch metadata against its binary, its variant and its key.

On real code objects compiled here (Triton compiles for sm_90 and gfx942 on CPU): a cubin records the threads
per block it was built for (.nv.info REQNTID), an HSACO its workgroup and wavefront sizes (AMDGPU metadata note).
A BLOCK_M=16 cubin filed under a BLOCK_M=128 key, or num_warps=1 with warp_size 64 on a cubin built for 8x32,
fails both. A warp-specialised Gluon entry launches more warps than its variant's num_warps (the partitions its
kernel's description counts: ``kernels.launched_warps``), and passes both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from compiled_once import compiled, shared_dir
from hypothesis import given, settings
from hypothesis import strategies as st

from lazytriton import record
from lazytriton.cache_format import Entry
from lazytriton.cache_format.elf import ElfError, check_launch, launch_facts, nv_info_attributes
from lazytriton.cache_format.image import write_image
from lazytriton.cli import main
from lazytriton.kernels import launched_warps
from lazytriton.kernels.flash_bwd import fused
from lazytriton.kernels.flash_bwd import gluon as bwd_gluon
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.kernels.flash_fwd import gluon as fwd_gluon
from lazytriton.store.local import LocalTier
from lazytriton.store.probe import launch_problems
from lazytriton.target import Target
from lazytriton.tiles import Config
from lazytriton.variant import Variant


def variant(target: str, block_m: int, num_warps: int) -> Variant:
    config = Config(block_m, 32, num_warps, 2)
    return fwd_dispatch.flash_fwd_variant(Target.parse(target), "fp16", 64, False, True, 4096, config=config)


def gluon_fwd(tiles: tuple[int, int, int], producer: bool = False, pingpong: bool = False, q_tiles: int = 1,
              head_dim: int = 64) -> Variant:
    variant = fwd_gluon.variant("sm_90", "fp16", head_dim, "none", True, False, 4096, 4096, tiles=tiles,
                                producer=producer, pingpong=pingpong, q_tiles=q_tiles)
    assert variant is not None
    return variant


def fused_bwd(head_dim: int) -> Variant:
    variants = fused.variants("sm_90", "fp16", head_dim, "none", True, False, 4096, 4096)
    assert variants is not None
    return variants[1]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Entry]:
    """Real entries: sm_90 BLOCK_M=16 x 1 warp, BLOCK_M=64 x 8 warps, and gfx942 BLOCK_M=64 x 4 warps."""
    where = shared_dir(tmp_path_factory)
    return {"m16w1": compiled(variant("sm_90", 16, 1), where), "m64w8": compiled(variant("sm_90", 64, 8), where),
            "hsaco": compiled(variant("gfx942", 64, 4), where)}


@pytest.fixture(scope="module")
def specialised(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Entry]:
    """Real warp-specialised entries: flash_fwd_gluon's ping-pong (4 + 4 + 1 warps) and the fused backward's."""
    where = shared_dir(tmp_path_factory)
    return {"pingpong": compiled(gluon_fwd((128, 64, 4), producer=True, pingpong=True), where),
            "fused": compiled(fused_bwd(64), where)}


def verify(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["cache", "verify", str(path)])
    return status, capsys.readouterr().out


def import_image(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    status = main(["cache", "import", str(path)])
    captured = capsys.readouterr()
    return status, captured.out + captured.err


# --- the pure ELF readers ----------------------------------------------------------------------------------------


def test_launch_facts_of_real_binaries(built: dict[str, Entry]) -> None:
    m16, m64, hsaco = built["m16w1"], built["m64w8"], built["hsaco"]
    assert launch_facts("cubin", m16.binary, m16.name).threads == 32
    assert launch_facts("cubin", m64.binary, m64.name).threads == 256
    facts = launch_facts("hsaco", hsaco.binary, hsaco.name)
    assert (facts.threads, facts.wavefront) == (256, 64)
    assert launch_facts("cubin", m64.binary, "other_kernel").threads is None
    for entry in built.values():
        assert check_launch(entry.kind, entry.target, entry.binary, entry.name, num_warps=entry.num_warps,
                            warp_size=entry.warp_size, shared=entry.shared) == []
        assert launch_problems(entry) == [], "a compiled entry agrees with its binary, variant and key"


def test_check_launch_names_each_mismatch(built: dict[str, Entry]) -> None:
    m64, hsaco = built["m64w8"], built["hsaco"]
    problems = check_launch("cubin", "sm_90", m64.binary, m64.name, num_warps=1, warp_size=64, shared=m64.shared)
    assert problems == ["cubin: built for 256 threads per block, entry launches 64 (num_warps=1 x warp_size=64)"]
    problems = check_launch("hsaco", "gfx942", hsaco.binary, hsaco.name, num_warps=8, warp_size=32, shared=0)
    assert "built for wavefront size 64, entry says warp_size=32" in problems[-1]
    problems = check_launch("cubin", "sm_90", m64.binary, m64.name, num_warps=8, warp_size=32, shared=1 << 20)
    assert problems == ["entry asks for 1048576 bytes of shared memory, sm_90 allows 232448 per block"]
    assert "records no threads per block" in check_launch("cubin", "sm_90", m64.binary, "other", num_warps=8,
                                                          warp_size=32, shared=0)[0]


def test_nv_info_records_that_run_past_their_section_are_an_elf_error() -> None:
    assert nv_info_attributes(bytes([4, 0x10, 12, 0]) + bytes(12)) == [(0x10, bytes(12))]
    with pytest.raises(ElfError, match="runs past"):
        nv_info_attributes(bytes([4, 0x10, 12, 0]) + bytes(11))
    with pytest.raises(ElfError, match="unknown format"):
        nv_info_attributes(bytes([9, 0x10, 0, 0]))


@pytest.fixture(scope="module")
def binaries(built: dict[str, Entry]) -> list[Entry]:
    return [built["m16w1"], built["hsaco"]]


@settings(max_examples=150, deadline=None, database=None)
@given(st.integers(0, 1), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=6),
       st.integers(0, 1 << 20))
def test_check_launch_takes_any_damage_to_a_list_of_problems(binaries: list[Entry], which: int,
                                                               flips: list[tuple[int, int]], cut: int) -> None:
    """ELF bytes come from untrusted entries: damage gives problems (or none), never an exception."""
    entry = binaries[which]
    data = bytearray(entry.binary)
    for at, xor in flips:
        data[at % len(data)] ^= xor
    for binary in (bytes(data), entry.binary[:cut % len(entry.binary)]):
        problems = check_launch(entry.kind, entry.target, binary, entry.name, num_warps=entry.num_warps,
                                warp_size=entry.warp_size, shared=entry.shared)
        assert isinstance(problems, list)


# --- cache verify --------------------------------------------------------------------------------------------------


def test_verify_fails_a_block_m_16_cubin_under_a_block_m_128_key(
        tmp_path: Path, built: dict[str, Entry], capsys: pytest.CaptureFixture[str]) -> None:
    small, big = built["m16w1"], variant("sm_90", 128, 4)
    good = write_image(tmp_path / "good.ltimg", [small]).path
    assert verify(good, capsys)[0] == 0
    # Filed under the other key only: the variant it carries no longer hashes to the key.
    moved = record.replace(small, key=big.key())
    status, out = verify(write_image(tmp_path / "moved.ltimg", [moved]).path, capsys)
    assert status == 1 and f"its variant {small.variant} hashes to {small.key}" in out, out
    # Key, variant and num_warps all rewritten to BLOCK_M=128's: the binary still says 32 threads a block.
    relabelled = record.replace(small, key=big.key(), variant=str(big), num_warps=4)
    status, out = verify(write_image(tmp_path / "relabelled.ltimg", [relabelled]).path, capsys)
    assert status == 1 and "built for 32 threads per block, entry launches 128" in out, out
    assert "hashes to" not in out


def test_verify_fails_one_warp_of_64_on_a_cubin_built_for_8_by_32(
        tmp_path: Path, built: dict[str, Entry], capsys: pytest.CaptureFixture[str]) -> None:
    wide = record.replace(built["m64w8"], num_warps=1, warp_size=64)
    status, out = verify(write_image(tmp_path / "warps.ltimg", [wide]).path, capsys)
    assert status == 1, out
    assert "entry num_warps=1, its variant's num_warps=8" in out
    assert "entry warp_size=64, sm_90 runs warps of 32" in out
    assert "built for 256 threads per block, entry launches 64 (num_warps=1 x warp_size=64)" in out


def test_verify_fails_an_hsaco_whose_warp_size_is_not_its_wavefront(
        tmp_path: Path, built: dict[str, Entry], capsys: pytest.CaptureFixture[str]) -> None:
    narrow = record.replace(built["hsaco"], num_warps=8, warp_size=32)
    status, out = verify(write_image(tmp_path / "hsaco.ltimg", [narrow]).path, capsys)
    assert status == 1 and "built for wavefront size 64, entry says warp_size=32" in out, out


# --- warp-specialised kernels: the warps their partitions launch -------------------------------------------------


@pytest.mark.parametrize(("variant", "warps"), [
    (variant("sm_90", 64, 8), 8),  # a Triton kernel launches its num_warps
    (gluon_fwd((128, 128, 8)), 8),  # no producer: one partition
    (gluon_fwd((128, 128, 8), producer=True), 12),  # 8 consumer warps, the producer warp padded to a warpgroup
    (gluon_fwd((64, 64, 4), producer=True), 8),
    (gluon_fwd((128, 64, 4), producer=True, pingpong=True), 12),  # two consumer warpgroups of 4, the producer
    (gluon_fwd((128, 128, 4), producer=True, pingpong=True, q_tiles=8), 12),  # BLOCK_M=1024: 8 tiles of 128
    (gluon_fwd((192, 128, 4), producer=True), 16),  # the wide tiles: three consumer warpgroups, the producer
    (bwd_gluon.variant("sm_90", "fp16", 64, "none", True, False, 4096, 4096), 4),
    (fused_bwd(64), 12),  # two consumer warpgroups (the default partition and a worker of 4), the producer
    (fused_bwd(256), 12),  # the wide program: the same partitions
])
def test_launched_warps_counts_each_partition(variant: Variant, warps: int) -> None:
    assert launched_warps(variant) == warps


def test_warp_specialised_entries_pass_verify_and_import(
        tmp_path: Path, cache_dir: Path, specialised: dict[str, Entry], capsys: pytest.CaptureFixture[str]) -> None:
    for entry in specialised.values():
        assert entry.num_warps == 12 and dict(Variant.parse(entry.variant).options)["num_warps"] == 4
        assert launch_problems(entry) == [], entry.variant
    image = write_image(tmp_path / "specialised.ltimg", list(specialised.values())).path
    status, out = verify(image, capsys)
    assert status == 0 and "2 entries checked" in out, out
    status, out = import_image(image, capsys)
    assert status == 0 and "imported 2 entries" in out, out


def test_a_warp_specialised_entry_given_its_variants_num_warps_fails(
        tmp_path: Path, specialised: dict[str, Entry], capsys: pytest.CaptureFixture[str]) -> None:
    """An entry that would launch the default partition's 4 warps on a binary of 12 is caught by both checks."""
    short = record.replace(specialised["fused"], num_warps=4)
    problems = launch_problems(short)
    assert "entry num_warps=4, its variant launches 12 warps (num_warps=4 and the kernel's partitions)" in problems
    assert "cubin: built for 384 threads per block, entry launches 128 (num_warps=4 x warp_size=32)" in problems
    status, out = verify(write_image(tmp_path / "short.ltimg", [short]).path, capsys)
    assert status == 1 and "its variant launches 12 warps" in out, out


# --- cache import applies verify's checks ----------------------------------------------------------------------------


def test_import_refuses_what_verify_fails_and_takes_the_rest(
        tmp_path: Path, cache_dir: Path, built: dict[str, Entry], capsys: pytest.CaptureFixture[str]) -> None:
    """``import`` copies verified entries only: an entry with launch metadata its binary contradicts stays out."""
    good = built["m64w8"]
    wide = record.replace(built["m16w1"], num_warps=1, warp_size=64)
    image = write_image(tmp_path / "mixed.ltimg", [good, wide]).path
    status, out = verify(image, capsys)
    assert status == 1 and "1 failed" in out, out
    status, out = import_image(image, capsys)
    assert status == 1, out
    assert f"FAIL {wide.key}: entry warp_size=64, sm_90 runs warps of 32" in out, out
    assert "imported 1 entry" in out and "1 failed" in out, out
    tier = LocalTier(cache_dir / "entries")
    assert tier.get(good.key) == good and tier.get(wide.key) is None
