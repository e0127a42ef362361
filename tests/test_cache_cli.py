"""``lazytriton cache``: ls, stats, verify (checksums and ELF validity), explain, gc, export and import.

Binary checks run on real code objects: an sm_90 cubin and a gfx942 HSACO, compiled once per session.
"""

from __future__ import annotations

import json
import re
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from compiled_once import compiled, shared_dir, small_variant
from conftest import run_python

from lazytriton import config, record, runtime, tuning
from lazytriton.cache_format import Entry, Provenance
from lazytriton.cache_format.elf import check_binary, cuda_sm, symbols
from lazytriton.cache_format.image import Image, write_image
from lazytriton.cli import main
from lazytriton.cli.cache import parse_size
from lazytriton.kernels import dispatch
from lazytriton.kernels.flash_bwd import dispatch as bwd_dispatch
from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
from lazytriton.store.local import LocalTier
from lazytriton.store.probe import ABSENT, DAMAGED, PRESENT, UNKNOWN, Probe, explain
from lazytriton.target import Target


@pytest.fixture(scope="session")
def cubin(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    return compiled(small_variant("sm_90"), shared_dir(tmp_path_factory))


@pytest.fixture(scope="session")
def hsaco(tmp_path_factory: pytest.TempPathFactory) -> Entry:
    return compiled(small_variant("gfx942"), shared_dir(tmp_path_factory))


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    status = main(["cache", *args])
    out, err = capsys.readouterr()
    return status, out, err


def local(cache_dir: Path) -> LocalTier:
    return LocalTier(cache_dir / "entries")


def seed(cache_dir: Path, *entries: Entry) -> None:
    tier = local(cache_dir)
    for entry in entries:
        assert tier.put(entry.key, entry)
    tier.close()


def use_images(monkeypatch: pytest.MonkeyPatch, *paths: Path) -> None:
    monkeypatch.setenv("LAZYTRITON_IMAGES", ":".join(str(p) for p in paths))
    config.reset()


def fake_entry(key: str, size: int = 2000, target: str = "sm_90") -> Entry:
    return Entry(key=key, variant="flash_fwd:sm_90:fp16:::", target=target, kind="cubin",
                 binary=b"\x7fELF" + bytes(size), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
                 global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
                 arg_types=(), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1))


# --- ELF checks on real binaries -------------------------------------------------------------------------------


def test_real_cubin_and_hsaco_are_valid(cubin: Entry, hsaco: Entry) -> None:
    assert (cubin.kind, hsaco.kind) == ("cubin", "hsaco")
    assert check_binary("cubin", "sm_90", cubin.binary, cubin.name) == []
    assert check_binary("hsaco", "gfx942", hsaco.binary, hsaco.name) == []
    assert {cubin.name} <= symbols(cubin.binary)
    assert {hsaco.name, f"{hsaco.name}.kd"} <= symbols(hsaco.binary)
    # Triton 3.9's ptxas writes ELF ABI 8: the SM sits in e_flags bits 8-15 (0x5a = 90).
    ident, flags = cubin.binary[:16], struct.unpack_from("<I", cubin.binary, 48)[0]
    assert cuda_sm(ident, flags) == 90
    assert struct.unpack_from("<H", cubin.binary, 18)[0] == 190
    assert struct.unpack_from("<H", hsaco.binary, 18)[0] == 224
    assert struct.unpack_from("<I", hsaco.binary, 48)[0] & 0xFF == 0x04C


def _patched(binary: bytes, at: int, fmt: str, value: int) -> bytes:
    data = bytearray(binary)
    struct.pack_into(fmt, data, at, value)
    return bytes(data)


def test_wrong_arch_foreign_and_broken_binaries_fail(cubin: Entry, hsaco: Entry) -> None:
    flags = struct.unpack_from("<I", cubin.binary, 48)[0]
    as_sm80 = _patched(cubin.binary, 48, "<I", (flags & ~0xFF00) | (80 << 8))
    assert check_binary("cubin", "sm_80", as_sm80, cubin.name) == []
    assert "encode sm_80, entry target is sm_90" in check_binary("cubin", "sm_90", as_sm80, cubin.name)[0]
    # The ABI 7 layout (SM in the low byte) is read too; an unknown ABI version is a failure.
    abi7 = _patched(_patched(cubin.binary, 8, "<B", 7), 48, "<I", 0x00000500 | 90)
    assert check_binary("cubin", "sm_90", abi7, cubin.name) == []
    assert "ABI version 9" in check_binary("cubin", "sm_90", _patched(cubin.binary, 8, "<B", 9))[0]
    assert "EF_AMDGPU_MACH 0x04c, gfx950 is 0x04f" in check_binary("hsaco", "gfx950", hsaco.binary)[0]
    assert "expected EM_CUDA" in check_binary("cubin", "sm_90", hsaco.binary)[0]
    assert "expected EM_AMDGPU" in check_binary("hsaco", "gfx942", cubin.binary)[0]
    host = Path(sys.executable).resolve().read_bytes()[:1 << 20]  # an x86-64 ELF: valid, but foreign
    assert any("e_machine" in p for p in check_binary("cubin", "sm_90", host))
    assert "lacks ['other', 'other.kd']" in check_binary("hsaco", "gfx942", hsaco.binary, "other")[0]
    assert "does not fit" in check_binary("cubin", "sm_90", cubin.binary[:4096], cubin.name)[0]
    assert "not an ELF" in check_binary("cubin", "sm_90", b"\x7fELX" + cubin.binary[4:])[0]
    assert check_binary("hsaco", "gfx1101", hsaco.binary, hsaco.name) == [], "an unlisted gfx is not failed"


# --- verify ----------------------------------------------------------------------------------------------------


def test_verify_passes_real_entries_in_the_local_tier_and_an_image(
        cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry, capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin, hsaco)
    status, out, _ = cli(capsys, "verify")
    assert status == 0 and "2 entries checked" in out and "all ok" in out
    image = write_image(tmp_path / "both.ltimg", [cubin, hsaco]).path
    status, out, _ = cli(capsys, "verify", str(image))
    assert status == 0 and "2 entries checked" in out
    status, out, _ = cli(capsys, "verify", str(cache_dir))
    assert status == 0 and "2 entries checked" in out


def test_verify_fails_a_mislabelled_foreign_or_corrupt_entry(
        cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry, capsys: pytest.CaptureFixture[str]) -> None:
    wrong_sm = record.replace(cubin, key="1" * 32, target="sm_80")
    wrong_gfx = record.replace(hsaco, key="2" * 32, target="gfx950")
    no_symbol = record.replace(hsaco, key="3" * 32, name="not_the_kernel")
    foreign = record.replace(cubin, key="4" * 32, binary=Path(sys.executable).resolve().read_bytes()[:200_000])
    wrong_kind = record.replace(hsaco, key="5" * 32, kind="cubin")
    seed(cache_dir, cubin, wrong_sm, wrong_gfx, no_symbol, foreign, wrong_kind)
    corrupt = record.replace(cubin, key="6" * 32)
    seed(cache_dir, corrupt)
    path = local(cache_dir).entry_path(corrupt.key)
    assert path is not None
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))

    status, out, _ = cli(capsys, "verify")
    assert status == 1
    fails = [line for line in out.splitlines() if line.startswith("FAIL")]
    assert "7 entries checked" in out and "6 failed" in out
    by_key = {key: "\n".join(line for line in fails if key in line) for key in "123456"}
    assert "encode sm_90, entry target is sm_80" in by_key["1"]
    assert "gfx950 is 0x04f" in by_key["2"]
    assert "lacks ['not_the_kernel', 'not_the_kernel.kd']" in by_key["3"]
    assert "expected EM_CUDA" in by_key["4"]
    assert "does not fit target gfx942" in by_key["5"]
    assert "checksum" in by_key["6"]
    assert cubin.key not in "\n".join(fails)
    assert local(cache_dir).counters().get("corrupt") is None, "verify drops and counts nothing"
    assert local(cache_dir).peek(corrupt.key) is not None


def test_verify_a_damaged_image_in_a_subprocess(tmp_path: Path, cubin: Entry, hsaco: Entry) -> None:
    image = write_image(tmp_path / "img.ltimg", [cubin, hsaco]).path
    command = "import sys; from lazytriton.cli import main; sys.exit(main(['cache', 'verify', sys.argv[-1]]))"
    ok = run_python(command.replace("sys.argv[-1]", repr(str(image))))
    assert ok.returncode == 0, ok.stderr
    assert "2 entries checked" in ok.stdout
    data = bytearray(image.read_bytes())
    data[96 + 4] ^= 0xFF  # two entries train no dictionary: the first blob starts right after the header
    image.write_bytes(bytes(data))
    bad = run_python(command.replace("sys.argv[-1]", repr(str(image))))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL" in bad.stdout


# --- ls and stats ----------------------------------------------------------------------------------------------


def test_ls_lists_both_tiers_and_filters(cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin)
    image = write_image(tmp_path / "images" / "amd.ltimg", [hsaco]).path
    use_images(monkeypatch, image.parent)
    status, out, _ = cli(capsys, "ls")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["TARGET", "KERNEL", "SIZE", "TIER", "KEY"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {"sm_90", "gfx942"} and lines[-1] == "2 entries"
    assert " image " in rows["gfx942"] and hsaco.key in rows["gfx942"] and hsaco.variant in rows["gfx942"]
    assert " local " in rows["sm_90"] and cubin.variant in rows["sm_90"]
    assert all(" flash_fwd " in row for row in rows.values())
    _, out, _ = cli(capsys, "ls", "--tier", "local")
    assert "gfx942" not in out and "1 entry\n" in out
    _, out, _ = cli(capsys, "ls", "--target", "gfx942")
    assert "sm_90 " not in out and "1 entry\n" in out


def test_ls_columns_line_up(cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry,
                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    long = record.replace(cubin, key=f"{7:032x}", variant="flash_bwd_fused_gluon:sm_90:bf16:::",
                          binary=b"\x7fELF" + bytes(3 << 20))  # a long kernel name, a size in MiB
    seed(cache_dir, cubin, long)
    image = write_image(tmp_path / "images" / "amd.ltimg", [hsaco]).path
    use_images(monkeypatch, image.parent)
    status, out, _ = cli(capsys, "ls")
    assert status == 0
    header, *rows = out.splitlines()[:-1]
    assert len(rows) == 3
    by_key = {e.key: e for e in (cubin, hsaco, long)}
    for row in rows:
        [entry] = [e for key, e in by_key.items() if f" {key} " in row]
        tier = "image" if entry is hsaco else "local"
        cells = {"TARGET": entry.target, "KERNEL": entry.variant.split(":")[0], "TIER": tier, "KEY": entry.key,
                 "VARIANT": entry.variant}
        for column, cell in cells.items():
            assert row.index(f"{cell} " if column != "VARIANT" else cell) == header.index(column), (column, out)
        size = row.split()[2] + " " + row.split()[3]
        assert row.index(size) + len(size) == header.index("SIZE") + len("SIZE"), out  # right-aligned


def test_stats_counts_entries_bytes_hits_misses_compiles(
        cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin)
    image = write_image(tmp_path / "amd.ltimg", [hsaco]).path
    use_images(monkeypatch, image)
    rt = runtime.get()
    assert rt.resolve(small_variant("sm_90")).source == "local"
    rt.local.count("compiles", 2)
    (cache_dir / "misses.jsonl").write_text('{"variant": "a"}\n{"variant": "b"}\n')
    status, out, _ = cli(capsys, "stats")
    assert status == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["image"][1] == "1" and rows["local"][1] == "1"
    assert f"{image.stat().st_size / 1024:.1f}" in " ".join(rows["image"])
    assert "hits 1, misses 2 (JIT compiles in the miss log), compiles 2, corrupt 0" in out


# --- explain ---------------------------------------------------------------------------------------------------

CALL = ("--dtype", "bf16", "--head-dim", "128", "--seqlen-q", "4096", "--target", "sm_90")


def explained_variant() -> tuple[str, str]:
    variant = fwd_dispatch.flash_fwd_variant(Target.parse("sm_90"), "bf16", 128, False, True, 4096, seqlen_k=4096)
    return str(variant), variant.key()


def test_explain_with_nothing_cached(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = cli(capsys, "explain", *CALL)
    variant, key = explained_variant()
    assert status == 0
    assert f"variant  {variant}" in out and f"key      {key}" in out
    # The shipped table has H200 rows for this call; a dtype it lacks falls back to the default.
    assert "tuning   row seqlen_q<=4096 seqlen_k<=4096" in out and "NVIDIA H200" in out
    assert "not present" in out and "served by jit" in out
    _, fp32_out, _ = cli(capsys, "explain", "--dtype", "fp32", *CALL[2:])
    assert "default config (no tuning row for sm_90 flash_fwd fp32 head dim 128" in fp32_out
    monkeypatch.setenv("LAZYTRITON_JIT", "0")
    config.reset()
    _, out, _ = cli(capsys, "explain", *CALL)
    assert "served by nothing: KernelNotFound" in out and "LAZYTRITON_JIT=0" in out


def test_explain_names_the_serving_tier_and_why_the_others_do_not(
        cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _, key = explained_variant()
    entry = fake_entry(key)
    seed(cache_dir, entry)
    _, out, _ = cli(capsys, "explain", *CALL)
    assert "served by local" in out and "serves it: a verified entry" in out

    good = write_image(tmp_path / "b-good.ltimg", [entry]).path
    damaged = write_image(tmp_path / "a-damaged.ltimg", [entry], codec="none").path
    data = bytearray(damaged.read_bytes())
    data[96 + 40] ^= 0xFF  # inside the only blob
    damaged.write_bytes(bytes(data))
    use_images(monkeypatch, tmp_path)
    _, out, _ = cli(capsys, "explain", *CALL)
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  image")}
    assert "present but damaged, so it would be skipped" in lines[str(damaged)]
    assert "serves it" in lines[str(good)]
    assert "also holds it, but image" in out and "served by image" in out
    assert local(cache_dir).counters().get("corrupt") is None


def test_explain_shows_the_tuning_row(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    row = tuning.Row("sm_90", "flash_fwd", "bf16", 128, False, 4096, 8192, 128, 64, 8, 3, 0, 431.5, "H200",
                     "2026-11-30")
    monkeypatch.setattr(tuning, "table_for", lambda kernel: tuning.Table([row]))
    _, out, _ = cli(capsys, "explain", *CALL, "--causal", "bottom_right", "--seqlen-k", "8000")
    assert "default config" in out and "runtime offset" in out  # the row is for causal=False
    _, out, _ = cli(capsys, "explain", *CALL, "--seqlen-k", "8000")
    assert "row seqlen_q<=4096 seqlen_k<=8192: BLOCK_M=128 BLOCK_N=64 num_warps=8 num_stages=3" in out
    assert "431.5 TFLOP/s on H200" in out


def test_explain_rejects_a_bad_call(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = cli(capsys, "explain", "--dtype", "fp16", "--head-dim", "300", "--seqlen-q", "16")
    assert status == 2 and "head dim (q.shape[-1]) must be in 1..256, got 300" in err
    status, _, err = cli(capsys, "explain", "--dtype", "fp16", "--head-dim", "64", "--seqlen-q", "16",
                         "--target", "sm_0x")
    assert status == 2 and "sm_0x" in err


def test_explain_decides_from_probes_alone() -> None:
    probes = [Probe("image", "a.ltimg", DAMAGED, "checksum mismatch"), Probe("image", "b.ltimg", ABSENT),
              Probe("local", "/c", PRESENT, "cubin"), Probe("shared", "/s", PRESENT, "cubin"),
              Probe("redis", "r", UNKNOWN, "cannot be read without side effects")]
    verdict = explain(probes, jit=True)
    assert verdict.source == "local"
    reasons = dict(verdict.reasons)
    assert reasons["image a.ltimg"] == "present but damaged, so it would be skipped: checksum mismatch"
    assert reasons["image b.ltimg"] == "not present"
    assert reasons["local /c"].startswith("serves it")
    assert reasons["shared /s"] == "also holds it, but local (/c) comes first"
    assert reasons["redis r"].startswith("not reached (local serves first); not probed")
    assert reasons["jit"] == "not needed: local serves it"
    assert explain(probes[:2], jit=True).source == "jit"
    assert explain([], jit=False).source is None


# --- gc, export, import ----------------------------------------------------------------------------------------


def test_gc_evicts_least_recently_used_entries_and_keeps_counters(
        cache_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tier = local(cache_dir)
    keys = [f"{i:032x}" for i in range(1, 31)]
    for key in keys:
        assert tier.put(key, fake_entry(key, size=20_000))
        time.sleep(0.002)  # distinct access times (diskcache's clock); order, not speed, is what is tested
    tier.count("compiles", 30)
    for key in (keys[0], keys[1]):  # used again: now the most recent
        assert tier.get(key) is not None
        time.sleep(0.002)
    tier.close()
    volume = local(cache_dir).stats().bytes
    size = len(fake_entry(keys[0], size=20_000).encode())
    bound = volume - 12 * size + size // 2  # room for all but twelve entries
    status, out, _ = cli(capsys, "gc", "--max-bytes", str(bound))
    assert status == 0 and "removed 12 least recently used entries" in out, out
    after = local(cache_dir)
    assert sorted(after.keys()) == sorted([keys[0], keys[1], *keys[14:]])
    assert after.stats().bytes <= bound
    assert after.counters() == {"compiles": 30}


def test_the_local_bound_is_a_setting(cache_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert runtime.get().local.size_limit == 4 << 30  # the default
    monkeypatch.setenv("LAZYTRITON_CACHE_MAX_BYTES", "1.5M")
    config.reset()
    assert config.settings().cache_max_bytes == 3 << 19 and runtime.get().local.size_limit == 3 << 19
    seed(cache_dir, *(fake_entry(f"{i:032x}", size=400_000) for i in range(1, 4)))  # 1.2 MB: within the bound
    status, out, _ = cli(capsys, "gc")  # no --max-bytes: the setting's bound
    assert status == 0 and "removed 0 least recently used entries" in out and "(bound 1.5 MiB)" in out
    config.configure(cache_max_bytes="1M")
    status, out, _ = cli(capsys, "gc")
    assert status == 0 and "removed 1 least recently used entry " in out and local(cache_dir).stats().bytes <= 1 << 20
    for value, message in (("lots", "LAZYTRITON_CACHE_MAX_BYTES must be a size such as 500M or 2G, got 'lots'"),
                           ("1000", "LAZYTRITON_CACHE_MAX_BYTES must be at least 1M")):
        monkeypatch.setenv("LAZYTRITON_CACHE_MAX_BYTES", value)
        config.reset()
        with pytest.raises(ValueError, match=re.escape(message)):
            config.settings()
    monkeypatch.delenv("LAZYTRITON_CACHE_MAX_BYTES")
    config.reset()
    with pytest.raises(TypeError, match="cache_max_bytes must be a byte count"):
        config.configure(cache_max_bytes=2.5)  # type: ignore[arg-type]


def test_put_keeps_the_local_tier_within_its_bound(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "entries", size_limit=600_000)
    for i in range(1, 9):
        tier.put(f"{i:032x}", fake_entry(f"{i:032x}", size=100_000))
        time.sleep(0.01)
    assert tier.stats().bytes <= 600_000
    assert f"{8:032x}" in set(tier.keys()) and f"{1:032x}" not in set(tier.keys())


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("1048576", "500M", "2G", "1.5GiB", "64k")] == [
        1 << 20, 500 << 20, 2 << 30, 3 << 29, 64 << 10]


def test_export_then_import(cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry,
                            monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin, hsaco)
    status, out, _ = cli(capsys, "export", "--out", str(tmp_path / "sm90.ltimg"), "--target", "cuda:90")
    assert status == 0 and "wrote 1 entry (sm_90)" in out
    status, out, _ = cli(capsys, "export", "--out", str(tmp_path / "all.ltimg"))
    assert status == 0 and "wrote 2 entries (gfx942, sm_90)" in out
    with Image(tmp_path / "all.ltimg") as image:
        assert image.read(cubin.key) == cubin and image.read(hsaco.key) == hsaco
        assert image.meta["source"] == "lazytriton cache export"
    status, out, _ = cli(capsys, "export", str(tmp_path / "plain.ltimg"), "--codec", "none")
    assert status == 0 and "(none)" in out
    with Image(tmp_path / "plain.ltimg") as image:
        assert image.meta["codec"] == "none" and image.read(cubin.key) == cubin and image.read(hsaco.key) == hsaco
    status, _, err = cli(capsys, "export", "--out", str(tmp_path / "none.ltimg"), "--target", "gfx950")
    assert status == 1 and "nothing to export" in err and not (tmp_path / "none.ltimg").exists()

    other = tmp_path / "other-cache"
    monkeypatch.setenv("LAZYTRITON_CACHE_DIR", str(other))
    config.reset()
    status, out, _ = cli(capsys, "import", str(tmp_path / "all.ltimg"))
    assert status == 0 and "imported 2 entries" in out
    assert local(other).get(cubin.key) == cubin and local(other).get(hsaco.key) == hsaco
    status, out, _ = cli(capsys, "import", str(tmp_path / "all.ltimg"))
    assert status == 0 and "imported 0 entries" in out and "2 already there" in out

    data = bytearray((tmp_path / "all.ltimg").read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / "broken.ltimg").write_bytes(bytes(data))
    status, _, err = cli(capsys, "import", str(tmp_path / "broken.ltimg"))
    assert status == 1 and "image does not open" in err


def test_export_takes_its_path_plainly_as_import_and_verify_do(cache_dir: Path, tmp_path: Path, cubin: Entry,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin)
    status, out, err = cli(capsys, "export", str(tmp_path / "plain.ltimg"))
    assert status == 0 and "wrote 1 entry (sm_90)" in out, err
    status, out, _ = cli(capsys, "export", "--out", str(tmp_path / "out.ltimg"), "--target", "sm_90")
    assert status == 0 and "wrote 1 entry (sm_90)" in out
    for name in ("plain.ltimg", "out.ltimg"):
        with Image(tmp_path / name) as image:
            assert image.read(cubin.key) == cubin
    status, _, err = cli(capsys, "export", str(tmp_path / "a.ltimg"), "--out", str(tmp_path / "b.ltimg"))
    assert status == 2 and "give the image's path once" in err
    status, _, err = cli(capsys, "export")
    assert status == 2 and "PATH" in err
    assert not (tmp_path / "a.ltimg").exists() and not (tmp_path / "b.ltimg").exists()


# --- --json: one JSON object on stdout, the same report as the text ---------------------------------------------


def cli_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    status, out, err = cli(capsys, *args, "--json")
    assert out.count("\n") == 1, f"one line of JSON, got {out!r}"
    report = json.loads(out)
    assert isinstance(report, dict) and out.strip() == json.dumps(report, sort_keys=True)
    return status, report, err


def test_ls_json(cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry, monkeypatch: pytest.MonkeyPatch,
                 capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin)
    image = write_image(tmp_path / "images" / "amd.ltimg", [hsaco]).path
    use_images(monkeypatch, image.parent)
    status, report, err = cli_json(capsys, "ls")
    assert status == 0 and err == ""
    assert report["count"] == 2 and len(report["entries"]) == 2
    by_target = {e["target"]: e for e in report["entries"]}
    assert by_target["gfx942"] == {"target": "gfx942", "kernel": "flash_fwd", "variant": hsaco.variant,
                                   "bytes": by_target["gfx942"]["bytes"], "tier": "image", "where": str(image),
                                   "key": hsaco.key, "problem": None}
    assert by_target["sm_90"]["tier"] == "local" and by_target["sm_90"]["key"] == cubin.key
    assert all(isinstance(e["bytes"], int) and e["bytes"] > 0 for e in report["entries"])
    _, report, _ = cli_json(capsys, "ls", "--target", "gfx942")
    assert [e["key"] for e in report["entries"]] == [hsaco.key] and report["count"] == 1

    path = local(cache_dir).entry_path(cubin.key)  # a damaged entry: listed with its problem, no variant
    assert path is not None
    path.write_bytes(b"garbage")
    _, report, _ = cli_json(capsys, "ls", "--tier", "local")
    [damaged] = report["entries"]
    assert damaged["key"] == cubin.key and damaged["variant"] is None and damaged["target"] is None
    assert damaged["problem"]
    _, text, _ = cli(capsys, "ls", "--tier", "local")
    assert f"DAMAGED: {damaged['problem']}" in text


def test_stats_json(cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry, monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin)
    image = write_image(tmp_path / "amd.ltimg", [hsaco]).path
    broken = tmp_path / "broken.ltimg"
    broken.write_bytes(b"not an image")
    use_images(monkeypatch, image, broken)
    runtime.get().local.count("compiles", 2)
    (cache_dir / "misses.jsonl").write_text('{"variant": "a"}\n')
    status, report, _ = cli_json(capsys, "stats")
    assert status == 0
    image_tier, local_tier = report["tiers"]["image"], report["tiers"]["local"]
    assert (image_tier["entries"], image_tier["bytes"]) == (1, image.stat().st_size)
    assert image_tier["images"] == [str(image), str(broken)]
    assert [p["where"] for p in image_tier["problems"]] == [str(broken)]
    assert local_tier["entries"] == 1 and local_tier["bytes"] > 0 and local_tier["problem"] is None
    assert local_tier["where"] == str(cache_dir / "entries")
    assert report["counters"] == {"hits": 0, "compiles": 2, "corrupt": 0} and report["misses"] == 1
    _, text, _ = cli(capsys, "stats")
    assert f"image {broken}: {image_tier['problems'][0]['problem']}" in text


def test_verify_json_ok_and_failing(cache_dir: Path, tmp_path: Path, cubin: Entry, hsaco: Entry,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    seed(cache_dir, cubin, hsaco)
    status, report, _ = cli_json(capsys, "verify")
    assert status == 0 and report == {"checked": 2, "failed": 0, "failures": [], "ok": True}

    seed(cache_dir, record.replace(cubin, key="1" * 32, target="sm_80"))
    status, report, err = cli_json(capsys, "verify")
    assert status == 1 and err == "" and report["ok"] is False
    assert report["checked"] == 3 and report["failed"] == 1
    assert {f["key"] for f in report["failures"]} == {"1" * 32}
    assert all(set(f) == {"tier", "where", "key", "problem"} for f in report["failures"])
    assert any("entry target is sm_80" in f["problem"] for f in report["failures"])

    status, report, _ = cli_json(capsys, "verify", str(write_image(tmp_path / "ok.ltimg", [hsaco]).path))
    assert status == 0 and report["checked"] == 1 and report["ok"] is True
    status, out, err = cli(capsys, "verify", str(tmp_path / "missing"), "--json")
    assert status == 2 and out == "" and err.count("\n") == 1 and "is not an image" in err


def test_explain_json(cache_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    variant, key = explained_variant()
    status, report, _ = cli_json(capsys, "explain", *CALL)
    assert status == 0 and (report["variant"], report["key"]) == (variant, key)
    assert report["call"]["target"] == "sm_90" and report["call"]["seqlen_k"] == 4096
    assert report["tuning"]["gpu"] and report["tuning"]["seqlen_q"] == 4096
    assert report["config"]["block_m"] == report["tuning"]["BLOCK_M"]
    assert report["served_by"] == "jit"
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert tiers["local"]["state"] == "absent" and tiers["local"]["reason"] == "not present"
    assert tiers["jit"] == {"tier": "jit", "where": None, "state": "on", "serves": True,
                            "reason": tiers["jit"]["reason"]}
    assert [t["tier"] for t in report["tiers"]][0] == "memory"

    seed(cache_dir, fake_entry(key))
    _, report, _ = cli_json(capsys, "explain", *CALL)
    tiers = {t["tier"]: t for t in report["tiers"]}
    assert report["served_by"] == "local" and tiers["local"]["serves"] and tiers["local"]["state"] == "present"
    assert not tiers["jit"]["serves"]
    _, report, _ = cli_json(capsys, "explain", "--dtype", "fp32", *CALL[2:])
    assert report["tuning"] is None and report["config"]["num_warps"] > 0

    monkeypatch.setenv("LAZYTRITON_JIT", "0")
    config.reset()
    _, report, _ = cli_json(capsys, "explain", *CALL[:-2], "--target", "sm_80")
    assert report["served_by"] is None and report["tiers"][-1]["state"] == "off"
    status, out, err = cli(capsys, "explain", "--json", "--dtype", "fp16", "--head-dim", "300", "--seqlen-q", "16")
    assert status == 2 and out == "" and "head dim (q.shape[-1]) must be in 1..256, got 300" in err


# --- explain for the backward family ---------------------------------------------------------------------------

BWD_CALL = ("--kernel", "flash_bwd", *CALL, "--seqlen-k", "8000")


def bwd_variants() -> dict[str, Any]:
    return {kernel: dispatch.kernel_variant(kernel, Target.parse("sm_90"), "bf16", 128, False, True, 4096, 8000)
            for kernel in bwd_dispatch.BWD_KERNELS}


def test_explain_the_backward_shows_both_kernels_and_the_tier_of_each(
        cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    default = bwd_variants()["flash_bwd_dkdv"]
    row = tuning.Row("sm_90", "flash_bwd_dkdv", "bf16", 128, False, 4096, 8192, 64, 128, 8, 2, 0, 210.5, "H200",
                     "2026-11-30")
    monkeypatch.setattr(tuning, "table_for", lambda kernel: tuning.Table([row]))
    dq, tuned = bwd_variants().values()
    assert tuned != default and tuned.get("BLOCK_M") == 64, "the dK/dV row decides its variant"
    seed(cache_dir, fake_entry(dq.key()))
    use_images(monkeypatch, write_image(tmp_path / "bwd.ltimg", [fake_entry(tuned.key())]).path)

    status, out, _ = cli(capsys, "explain", *BWD_CALL)
    assert status == 0
    assert out.startswith("call     flash_bwd bf16 head_dim=128 seqlen_q=4096 seqlen_k=8000")
    assert "a call launches flash_bwd_dq, then flash_bwd_dkdv" in out
    dq_part, dkdv_part = out.split("\nflash_bwd_dq\n")[1].split("\nflash_bwd_dkdv\n")
    assert f"variant  {dq}" in dq_part and f"key      {dq.key()}" in dq_part and "served by local" in dq_part
    assert "default config (no tuning row for sm_90 flash_bwd_dq bf16 head dim 128 causal=False)" in dq_part
    assert f"variant  {tuned}" in dkdv_part and "served by image" in dkdv_part
    assert "row seqlen_q<=4096 seqlen_k<=8192: BLOCK_M=64 BLOCK_N=128 num_warps=8 num_stages=2" in dkdv_part
    assert "210.5 TFLOP/s on H200" in dkdv_part

    status, report, _ = cli_json(capsys, "explain", *BWD_CALL)
    assert status == 0 and report["call"]["kernel"] == "flash_bwd"
    assert report["call"]["kernels"] == list(bwd_dispatch.BWD_KERNELS) and "variant" not in report
    by_kernel = {k["kernel"]: k for k in report["kernels"]}
    assert (by_kernel["flash_bwd_dq"]["variant"], by_kernel["flash_bwd_dq"]["key"]) == (str(dq), dq.key())
    assert by_kernel["flash_bwd_dq"]["served_by"] == "local" and by_kernel["flash_bwd_dq"]["tuning"] is None
    assert by_kernel["flash_bwd_dkdv"]["served_by"] == "image"
    assert by_kernel["flash_bwd_dkdv"]["tuning"]["BLOCK_N"] == by_kernel["flash_bwd_dkdv"]["config"]["block_n"] == 128

    # One kernel of the family: its report, with its fields at the top level as the forward's are.
    status, report, _ = cli_json(capsys, "explain", "--kernel", "flash_bwd_dkdv", *CALL, "--seqlen-k", "8000")
    assert (report["variant"], report["served_by"]) == (str(tuned), "image")
    assert [k["kernel"] for k in report["kernels"]] == ["flash_bwd_dkdv"]
    _, report, _ = cli_json(capsys, "explain", *CALL)
    assert [k["kernel"] for k in report["kernels"]] == ["flash_fwd"] and report["call"]["kernel"] == "flash_fwd"
    with pytest.raises(SystemExit):
        main(["cache", "explain", "--kernel", "flash_bwd_dx", *CALL])
    assert "invalid choice" in capsys.readouterr().err
