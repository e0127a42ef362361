"""Lock and miss-log paths that are not what the runtime made (issue 13, finding 8).

A symlink or a folder at ``locks/<key>.lock`` made the call fail (ELOOP,
IsADirectoryError): the runtime now compiles without the lock and warns. A
symlinked ``misses.jsonl`` had the line appended to whatever it pointed at: it
is never followed (O_NOFOLLOW), nor is a FIFO waited on; one warning says so.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from compiled_once import small_variant

from lazytriton import compiler, runtime
from lazytriton.cache_format import Entry, Provenance
from lazytriton.variant import Variant

VARIANTS = [small_variant("sm_90"), small_variant("sm_90", causal=True)]
DEADLINE_S = 60.0


def fake_entry(variant: Variant, key: str | None = None) -> Entry:
    return Entry(
        key=key or variant.key(), variant=str(variant), target=variant.target, kind="cubin",
        binary=b"\x7fELF" + bytes(4000), name="k", num_warps=4, num_ctas=1, warp_size=32, shared=0,
        global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0, profile_scratch_align=1,
        arg_types=("i32",), hidden_args=(), provenance=Provenance("triton", "3.9.0", "0" * 16, 1.0, 1),
    )


@pytest.fixture(autouse=True)
def fake_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "compile_variant", fake_entry)


def resolve_in_time(variant: Variant) -> Any:
    """Resolve in a thread, so that a call stuck on a FIFO fails the test instead of hanging it."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(value=runtime.get().resolve(variant)), daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert not thread.is_alive(), f"resolving {variant} hung"
    assert "value" in out, "resolving raised (see the thread's traceback above)"
    return out["value"]


def lock_path(cache_dir: Path, variant: Variant) -> Path:
    path = cache_dir / "locks" / f"{variant.key()}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.parametrize("kind", ["symlink", "dangling_symlink", "directory"])
def test_a_lock_path_that_is_not_a_file_compiles_without_the_lock(
        cache_dir: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    path = lock_path(cache_dir, VARIANTS[0])
    if kind == "symlink":
        path.symlink_to(victim)
    elif kind == "dangling_symlink":
        path.symlink_to(tmp_path / "nowhere")
    else:
        path.mkdir()
    with caplog.at_level(logging.WARNING, logger="lazytriton"):
        resolved = resolve_in_time(VARIANTS[0])
    assert resolved.source == "jit"
    assert "compiling without it" in caplog.text and str(path) in caplog.text
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "nowhere").exists()
    assert runtime.get().resolve(VARIANTS[0]).source == "memory"


def test_a_lock_that_cannot_be_opened_compiles_without_it(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The path was a regular file when looked at, and something else when opened (a race): still no failure."""
    import filelock

    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(40, "Too many levels of symbolic links")

    monkeypatch.setattr(filelock.FileLock, "acquire", refuse)
    with caplog.at_level(logging.WARNING, logger="lazytriton"):
        assert resolve_in_time(VARIANTS[0]).source == "jit"
    assert "cannot take the compile lock" in caplog.text


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
def test_a_miss_log_that_is_not_a_file_is_never_written_through(
        cache_dir: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    cache_dir.mkdir(parents=True, exist_ok=True)
    log_path = cache_dir / runtime.MISS_LOG
    if kind == "symlink":
        log_path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(log_path)
    else:
        log_path.mkdir()
    with caplog.at_level(logging.WARNING, logger="lazytriton"):
        for variant in VARIANTS:
            assert resolve_in_time(variant).source == "jit"
    assert victim.read_text() == "keep me\n"
    warnings = [r for r in caplog.records if "misses are not recorded" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert log_path.is_symlink() if kind == "symlink" else True


def test_the_miss_log_is_still_written_when_it_is_a_file(cache_dir: Path) -> None:
    for variant in VARIANTS:
        resolve_in_time(variant)
    lines = (cache_dir / runtime.MISS_LOG).read_text().splitlines()
    assert [line.split('"key": "')[1][:32] for line in lines] == [v.key()[:32] for v in VARIANTS]
