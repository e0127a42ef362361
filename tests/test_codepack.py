"""The code pack (codepack.py, codepack_build.py): a regular install's modules imported from one file.

On CPU, with a fake regular install in tmp_path: ``site/lazytriton/`` holds copies of the package's own
``__init__.py``, ``codepack.py`` and ``codepack_build.py`` (``import lazytriton`` installs the finder as the real
package does) and modules of its own, in the mapped folders and a nested subpackage. Each import runs in a fresh
interpreter whose path starts at the fake site: this process's lazytriton is untouched.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import marshal
import os
import resource
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import CodeType, SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lazytriton
from lazytriton import codepack, codepack_build

# ~200 examples a test keeps the file under a minute on a loaded 2-core machine (as test_decoders_property.py).
PROPERTY = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
REAL = Path(lazytriton.__file__).resolve().parent
H = codepack.HEADER.size
Built = tuple[Path, dict[str, Any], int]  # the fixture ``built``
OTHER_PYTHON = (int.from_bytes(importlib.util.MAGIC_NUMBER[:2], "little") - 10).to_bytes(2, "little")
MODULES = {
    "plain.py": "VALUE = 42\n\n\ndef where():\n    return 'from plain.py'\n",
    "boom.py": "def fail():\n    raise RuntimeError('raised in a packed module')\n",
    "kernels/__init__.py": "KIND = 'kernels'\n", "kernels/nested/__init__.py": "",
    "kernels/nested/deep.py": ("from lazytriton.plain import VALUE\n\nDEEP = VALUE * 2\n"
                               "if __name__ == '__main__':\n    print('deep as main', DEEP)\n"),
    "cache_format/__init__.py": "", "prewarm/__init__.py": "", "capi/__init__.py": "",
    "data/skipped.py": "", "not-a-module.py": "",  # no package (no __init__.py), no module name: not in the pack
}
FILES = {"lazytriton.codepack": "codepack.py", "lazytriton.codepack_build": "codepack_build.py",
         "lazytriton.plain": "plain.py", "lazytriton.boom": "boom.py", "lazytriton.kernels": "kernels/__init__.py",
         "lazytriton.kernels.nested": "kernels/nested/__init__.py", "lazytriton.kernels.nested.deep":
         "kernels/nested/deep.py", "lazytriton.cache_format": "cache_format/__init__.py",
         "lazytriton.prewarm": "prewarm/__init__.py", "lazytriton.capi": "capi/__init__.py"}
PROBED = ("lazytriton.plain", "lazytriton.boom", "lazytriton.kernels.nested.deep", "lazytriton.capi",
          "lazytriton.prewarm", "lazytriton.codepack_build")
PROBE = """
import importlib, json, os, sys, lazytriton
from lazytriton import codepack, codepack_build
here = os.path.dirname(lazytriton.__file__)
out = {"init": lazytriton.__file__, "finder": codepack.finder() is not None, "modules": {}}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    out["modules"][name] = {"packed": isinstance(module.__spec__.loader, codepack.PackFinder), "file": module.__file__,
                            "cached": module.__cached__, "value": getattr(module, "VALUE", None)}
out.update(stale=sorted(getattr(codepack.finder(), "stale", ())), wanted=codepack.wanted(here),
           state=codepack_build.state(here))
print(json.dumps(out))
"""


def make_tree(site: Path) -> Path:
    """A fake regular install of lazytriton in ``site``; its package folder."""
    package = site / "lazytriton"
    for relative, text in MODULES.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text)
    for name in ("__init__.py", "codepack.py", "codepack_build.py"):
        shutil.copyfile(REAL / name, package / name)
    return package


def packed(tmp_path: Path) -> tuple[Path, Path]:
    """A fake install with its pack (built here, as codepack_build.build): (site, package folder)."""
    package = make_tree(tmp_path / "site")
    assert codepack_build.build(codepack.PACKAGE, str(package)) == (codepack.pack_path(str(package)), len(FILES))
    return tmp_path / "site", package


def python(site: Path, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter whose lazytriton is the one in ``site``, writing bytecode, the pack on."""
    unset = ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONOPTIMIZE", "PYTHONPYCACHEPREFIX", codepack.VARIABLE)
    full = {key: value for key, value in os.environ.items() if key not in unset} | {"PYTHONPATH": str(site), **env}
    return subprocess.run([sys.executable, *args], cwd=cwd or site.parent, env=full, capture_output=True, text=True,
                          timeout=120, check=False)


def probe(site: Path, *names: str, flags: tuple[str, ...] = (), **env: str) -> dict[str, Any]:
    done = python(site, *flags, "-c", PROBE, *names, **env)
    assert done.returncode == 0, done.stderr
    got: dict[str, Any] = json.loads(done.stdout)
    assert got["init"] == str(site / "lazytriton" / "__init__.py")
    return got


def entries_of(data: bytes) -> dict[str, Any]:
    return codepack.decode(data[:H], data[H:])[1]


def valid_header(folder: bytes, index: bytes) -> bytes:
    return codepack.HEADER.pack(codepack.MAGIC, codepack.FORMAT, importlib.util.MAGIC_NUMBER, sys.flags.optimize,
                                len(folder), len(index), codepack.checksum(index))


def test_modules_import_from_the_pack_under_their_files_names(tmp_path: Path) -> None:
    site, package = packed(tmp_path)
    got = probe(site, *PROBED, "lazytriton.kernels")
    assert got["finder"] and got["stale"] == [] and not got["wanted"] and got["state"][0] == "in use"
    for name, module in got["modules"].items():
        assert module["packed"] and module["file"] == str(package / FILES[name]), name
        assert module["cached"] == importlib.util.cache_from_source(module["file"])
        assert module["value"] == (42 if name in ("lazytriton.plain", "lazytriton.kernels.nested.deep") else None)


def test_a_packed_module_shows_its_source_in_tracebacks_inspect_and_runs_with_dash_m(tmp_path: Path) -> None:
    site, package = packed(tmp_path)
    code = ("import inspect, traceback\nfrom lazytriton import boom, plain\n"
            "assert type(boom.__spec__.loader).__name__ == 'PackFinder'\n"
            "try:\n    boom.fail()\nexcept RuntimeError:\n    print(traceback.format_exc())\n"
            "print(inspect.getsource(plain.where))\n")
    done = python(site, "-c", code)
    assert done.returncode == 0, done.stderr
    assert f'File "{package / "boom.py"}", line 2, in fail\n    raise RuntimeError(\'raised in a packed module\')' \
        in done.stdout
    assert "def where():\n    return 'from plain.py'" in done.stdout
    ran = python(site, "-m", "lazytriton.kernels.nested.deep")
    assert (ran.returncode, ran.stdout) == (0, "deep as main 84\n"), ran.stderr


def test_a_module_whose_source_changed_after_the_build_is_imported_from_its_file(tmp_path: Path) -> None:
    site, package = packed(tmp_path)
    Path(source := str(package / "kernels" / "nested" / "deep.py")).write_text("VALUE = 4242\n")  # another size
    os.utime(touched := package / "capi" / "__init__.py", ns=(0, touched.stat().st_mtime_ns + 10**9))  # same bytes
    got = probe(site, deep := "lazytriton.kernels.nested.deep", "lazytriton.capi", "lazytriton.boom")
    assert got["modules"][deep] == {"packed": False, "file": source, "value": 4242,
                                    "cached": importlib.util.cache_from_source(source)}
    assert not got["modules"]["lazytriton.capi"]["packed"] and got["modules"]["lazytriton.boom"]["packed"]
    assert got["stale"] == sorted([deep, "lazytriton.capi"])  # deep: found on its packed parent's __path__
    assert got["wanted"] and got["state"][0] == "in use" and "2 stale" in got["state"][1]


def _flip(data: bytes, position: int) -> bytes:
    return data[:position] + bytes([data[position] ^ 0x5A]) + data[position + 1:]


def _code_damaged(data: bytes, last: bool) -> tuple[bytes, set[str] | None]:
    """A byte of lazytriton.plain's code flipped, or the last module's code cut short: that module from its file."""
    entries = entries_of(data)
    if last:
        return data[:-3], {max(entries, key=lambda name: entries[name][4])}
    *_, offset, length, _ = entries["lazytriton.plain"]
    return _flip(data, offset + length // 2), {"lazytriton.plain"}


# Damage to a good pack: (the damaged bytes, the modules then imported from their files; None: the whole pack).
DAMAGES: dict[str, Callable[[bytes], tuple[bytes, set[str] | None]]] = {
    "truncated header": lambda data: (data[:H - 1], None),
    "truncated index": lambda data: (data[:H + 40], None),
    "wrong magic": lambda data: (b"LTPX" + data[4:], None),
    "another format": lambda data: (data[:4] + struct.pack("<I", codepack.FORMAT + 1) + data[8:], None),
    "another python": lambda data: (data[:8] + OTHER_PYTHON + data[10:], None),
    "a flipped index byte": lambda data: (_flip(data, H + codepack.HEADER.unpack(data[:H])[4] + 5), None),
    "a flipped byte of one module's code": lambda data: _code_damaged(data, last=False),
    "the last module's code cut short": lambda data: _code_damaged(data, last=True),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_pack_never_breaks_an_import(tmp_path: Path, damage: str) -> None:
    site, package = packed(tmp_path)
    damaged, from_files = DAMAGES[damage](Path(codepack.pack_path(str(package))).read_bytes())
    Path(codepack.pack_path(str(package))).write_bytes(damaged)
    got = probe(site, *PROBED)
    assert got["finder"] == (from_files is not None)
    for name, module in got["modules"].items():
        assert module["value"] == (42 if name in ("lazytriton.plain", "lazytriton.kernels.nested.deep") else None)
        assert module["packed"] == (from_files is not None and name not in from_files), name
        assert module["file"] == str(package / FILES[name])
    assert from_files is not None or (got["state"][0] == "unusable" and got["wanted"])


def test_a_pack_for_another_folder_or_optimisation_level_or_turned_off_or_a_folder_is_not_used(
        tmp_path: Path) -> None:
    site, package = packed(tmp_path)
    moved = tmp_path / "moved" / "site"
    shutil.copytree(site, moved)  # the sources' sizes and mtimes kept: only the folder differs
    elsewhere = probe(moved, *PROBED)
    assert all(m["file"].startswith(str(moved)) and not m["packed"] for m in elsewhere["modules"].values())
    off = probe(site, "lazytriton.plain", LAZYTRITON_CODEPACK="0")
    assert off["state"][0] == "off" and not off["wanted"]
    optimised = probe(site, "lazytriton.plain", flags=("-O",))
    Path(codepack.pack_path(str(package))).unlink()
    Path(codepack.pack_path(str(package))).mkdir()
    for got in (elsewhere, off, optimised, probe(site, "lazytriton.plain")):
        assert not got["finder"] and [got["modules"]["lazytriton.plain"][k] for k in ("value", "packed")] == [42, False]


@contextlib.contextmanager
def memory_cap(headroom: int = 1 << 30) -> Iterator[None]:
    """Address space limited to this process's size plus ``headroom``: marshal's preallocations fail fast."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize() + headroom
    cap = min(c for c in (cap, soft, hard) if c != resource.RLIM_INFINITY)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def decoded_or_none(header: bytes, rest: bytes) -> dict[Any, Any] | None:
    try:
        folder, entries = codepack.decode(header, rest)
    except codepack.PackError:
        return None
    assert type(folder) is str and type(entries) is dict
    return entries


headers = st.builds(codepack.HEADER.pack, st.just(codepack.MAGIC) | st.binary(min_size=4, max_size=4),
                    st.just(codepack.FORMAT) | st.integers(0, 2**32 - 1), st.just(importlib.util.MAGIC_NUMBER)
                    | st.binary(min_size=4, max_size=4), st.just(sys.flags.optimize) | st.integers(0, 255),
                    *[st.integers(0, 300) | st.integers(0, 2**32 - 1)] * 2,  # folder and index bytes
                    st.integers(0, 2**64 - 1))  # the index's checksum


@PROPERTY
@given(headers | st.binary(max_size=H + 4), st.binary(max_size=300))
def test_decode_of_any_bytes_returns_or_raises_pack_error(header: bytes, rest: bytes) -> None:
    decoded_or_none(header, rest)


@PROPERTY
@given(st.binary(max_size=40), st.binary(max_size=300), st.binary(max_size=20))
@example(b"", b"0", b"")  # marshal's TypeError (a NULL object)
@example(b"\xff", marshal.dumps({}), b"")  # a folder that is not UTF-8
def test_decode_of_any_index_bytes_under_a_matching_checksum_returns_or_raises_pack_error(
        folder: bytes, index: bytes, tail: bytes) -> None:
    with memory_cap():
        decoded_or_none(valid_header(folder, index), folder + index + tail)


def test_decode_of_a_huge_marshal_length_raises_pack_error() -> None:
    # A 5-byte index under a matching checksum that has marshal preallocate a 2**31-1 tuple: past a memory limit, the
    # MemoryError is decode's PackError, and import lazytriton goes on without the pack.
    index = b"(" + struct.pack("<i", 2**31 - 1)
    with memory_cap(), pytest.raises(codepack.PackError):
        codepack.decode(valid_header(b"", index), index)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """A fake install with its pack: (package folder, the index, the pack's open fd)."""
    site, package = packed(tmp_path_factory.mktemp("built"))
    shutil.copy2(package / "plain.py", site / "outside.py")  # what "../outside.py" would reach, its mtime kept
    fd = os.open(codepack.pack_path(str(package)), os.O_RDONLY)
    yield package, entries_of(os.pread(fd, 1 << 20, 0)), fd
    os.close(fd)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                    st.binary(max_size=12))
hashables = st.recursive(scalars, lambda inner: st.tuples(inner, inner) | st.frozensets(inner, max_size=3),
                         max_leaves=5)
values = st.recursive(scalars | hashables, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(*[inner] * 7),
    st.dictionaries(hashables, inner, max_size=3)), max_leaves=16)
# What a hostile entry's fields may hold: paths out of the folder, with NUL or a surrogate; numbers out of range.
HOSTILE = ("../outside.py", "x/../../outside.py", "a\x00.py", "\udc80.py", "plain", None, (), -1, 1.5, 2**40, 2**64)
rows = st.tuples(st.text(max_size=12).map(lambda text: f"{text}.py"), *[values] * 6)  # an entry's shape, any fields


@PROPERTY
@given(st.data())
def test_the_finder_over_any_marshalled_index_returns_a_spec_or_none(built: Built, data: st.DataObject) -> None:
    package, entries, fd = built
    keys = st.sampled_from(sorted(entries)) | st.text(max_size=24) | hashables
    table = data.draw(st.dictionaries(keys, values | rows, max_size=4) | values)
    index, folder = marshal.dumps(table), str(package).encode()
    decoded = decoded_or_none(valid_header(folder, index), folder + index)
    assert (decoded is None) == (type(table) is not dict)
    finder = codepack.PackFinder(str(package), fd, decoded or {})
    with memory_cap():
        for name in [*(k for k in decoded or {} if type(k) is str), *data.draw(st.lists(st.text(max_size=24)))]:
            spec = finder.find_spec(name)
            assert spec is None or (isinstance(spec, ModuleSpec) and (spec.name, spec.loader) == (name, finder)
                                    and os.path.normpath(str(spec.origin)).startswith(f"{package}{os.sep}"))
            finder.is_package(name)


def test_an_entry_with_a_hostile_field_gives_no_spec_or_one_inside_the_folder(built: Built) -> None:
    package, entries, fd = built
    for position, value in itertools.product(range(7), HOSTILE):
        entry = (*entries["lazytriton.plain"][:position], value, *entries["lazytriton.plain"][position + 1:])
        finder = codepack.PackFinder(str(package), fd, {"lazytriton.plain": entry, "lazytriton.x": entry[:position]})
        with memory_cap():  # a read of a length past MAX_CODE fails here
            specs = [finder.find_spec("lazytriton.plain"), finder.find_spec("lazytriton.x")]
        assert all(spec is None or os.path.normpath(str(spec.origin)).startswith(f"{package}{os.sep}")
                   for spec in specs), (position, value)


def test_two_builds_of_a_tree_are_the_same_bytes_and_the_index_points_at_each_modules_code(tmp_path: Path) -> None:
    package = make_tree(tmp_path / "site")
    first, count = codepack_build.build(codepack.PACKAGE, str(package), out=str(tmp_path / "a.ltpack"))
    second, _ = codepack_build.build(codepack.PACKAGE, str(package), out=str(tmp_path / "b.ltpack"))
    data = Path(first).read_bytes()
    assert data == Path(second).read_bytes() and count == len(FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ltpack", "b.ltpack", "site"]  # no temporary left
    folder, entries = codepack.decode(data[:H], data[H:])
    assert folder == str(package) and set(entries) == set(FILES)
    end = H + sum(codepack.HEADER.unpack(data[:H])[4:6])  # the code follows the folder and the index, in order
    for name, entry in sorted(entries.items(), key=lambda item: item[1][4]):
        relative, is_package, mtime_ns, size, offset, length, crc = entry
        source = package / FILES[name]
        assert relative == FILES[name] and is_package == (source.name == "__init__.py")
        assert (mtime_ns, size) == (source.stat().st_mtime_ns, source.stat().st_size)
        assert offset == end and codepack.checksum(data[offset:offset + length]) == crc
        code = marshal.loads(data[offset:offset + length])
        assert isinstance(code, CodeType) and code.co_filename == str(source)
        end = offset + length
    assert end == len(data)


def test_a_module_whose_source_changes_while_it_is_read_is_left_out_of_the_pack(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = make_tree(site := tmp_path / "site")
    target, real_stat, changed = str(package / "plain.py"), os.stat, []

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        result = real_stat(path, *args, **kwargs)
        if os.fspath(path) == target and not changed:  # the build's first look: the file changes after it
            changed.append(True)
            Path(target).write_text("VALUE = 43  # written while the build reads the module\n")
        return result

    monkeypatch.setattr(os, "stat", stat)
    _, count = codepack_build.build(codepack.PACKAGE, str(package))
    assert changed and count == len(FILES) - 1
    assert set(entries_of(Path(codepack.pack_path(str(package))).read_bytes())) == set(FILES) - {"lazytriton.plain"}
    got = probe(site, "lazytriton.plain", "lazytriton.boom")
    assert got["modules"]["lazytriton.plain"]["value"] == 43 and not got["modules"]["lazytriton.plain"]["packed"]
    assert got["modules"]["lazytriton.boom"]["packed"] and got["stale"] == []


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that writes bytecode, the pack on, no pack in use and no first use yet."""
    monkeypatch.delenv(codepack.VARIABLE, raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.setattr(codepack, "finder", lambda: None)
    monkeypatch.setattr(codepack, "_first_use_done", [])


def test_wanted_says_whether_an_install_should_get_a_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          fresh: None) -> None:
    folder = str(package := make_tree(tmp_path / "site"))
    assert codepack.wanted(folder)  # no pack
    monkeypatch.setenv(codepack.VARIABLE, "0")
    assert not codepack.wanted(folder)
    monkeypatch.setenv(codepack.VARIABLE, "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert not codepack.wanted(folder)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    in_use = codepack.PackFinder(folder, -1, {})
    monkeypatch.setattr(codepack, "finder", lambda: in_use)
    assert not codepack.wanted(folder)  # in use, nothing stale
    in_use.stale.add("lazytriton.plain")
    assert codepack.wanted(folder)
    monkeypatch.setattr(codepack, "finder", lambda: codepack.PackFinder(str(tmp_path / "elsewhere"), -1, {}))
    assert codepack.wanted(folder)
    marker = Path(codepack.pack_path(folder) + codepack.FAILED_SUFFIX)
    marker.parent.mkdir()
    marker.write_text("SyntaxError: ...\n")
    assert not codepack.wanted(folder)
    marker.unlink()
    (package / "capi" / "__init__.py").unlink()  # a mapped folder outside the package: not a regular install
    assert not codepack.wanted(folder)


def test_wanted_asks_whether_the_pycache_or_else_the_package_folder_is_writable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh: None) -> None:
    folder = str(make_tree(tmp_path / "site"))
    asked: list[str] = []
    monkeypatch.setattr(os, "access", lambda path, mode: asked.append(os.fspath(path)) or False)
    assert not codepack.wanted(folder)
    Path(codepack.pack_path(folder)).parent.mkdir()
    assert not codepack.wanted(folder)
    assert asked == [folder, os.path.dirname(codepack.pack_path(folder))]


def test_a_build_where_the_folder_is_not_writable_is_nothing_to_build_not_a_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A system install run by a user: prewarm --helpers says so and goes on (the pack is optional).
    folder = str(make_tree(tmp_path / "site"))
    monkeypatch.setattr(codepack, "package_dir", lambda: folder)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    built, message = codepack_build.build_installed()
    assert built is None and "not writable" in message and not Path(codepack.pack_path(folder)).exists()


def test_the_first_use_starts_one_detached_build_a_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           fresh: None) -> None:
    folder = str(make_tree(site := tmp_path / "site"))
    monkeypatch.setattr(codepack, "package_dir", lambda: folder)
    calls: list[tuple[list[str], dict[str, Any]]] = []
    builder = SimpleNamespace(wait=(waited := threading.Event()).set)  # Popen's, recorded: the builder never starts
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kwargs: calls.append((argv, kwargs)) or builder)
    monkeypatch.setattr(codepack, "python_executable", lambda: None)  # not a plain Python: no build
    assert not codepack.on_first_use() and codepack._first_use_done == [True]
    monkeypatch.setattr(codepack, "_first_use_done", [])
    monkeypatch.setattr(codepack, "python_executable", lambda: "/usr/bin/python3")
    assert codepack.on_first_use() and not codepack.on_first_use()
    assert waited.wait(60)  # the build's thread started the builder and waited for it
    [(argv, kwargs)] = calls
    assert argv == ["/usr/bin/python3", "-c", codepack.BUILDER, "--background", folder]
    assert (kwargs["cwd"], kwargs["start_new_session"], kwargs["env"][codepack.VARIABLE]) == (str(site), True, "0")
    monkeypatch.setattr(codepack, "_first_use_done", [])
    monkeypatch.setenv(codepack.VARIABLE, "0")  # not wanted: nothing started
    assert not codepack.on_first_use() and codepack._first_use_done == [True] and len(calls) == 1


def test_the_build_runs_with_this_interpreter_only_where_it_is_a_plain_python(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, mode in (("python3.11", 0o755), ("python", 0o755), ("python3-config", 0o755), ("uwsgi", 0o755),
                       ("python3", 0o644)):  # uwsgi: an embedding program's sys.executable
        (tmp_path / name).touch(mode=mode)
        monkeypatch.setattr(sys, "executable", str(tmp_path / name))
        assert codepack.python_executable() == (str(tmp_path / name) if name in ("python3.11", "python") else None)


FIRST_USE = ("import json, threading\nfrom lazytriton import codepack\n"  # two first uses; the build awaited
             "started = [codepack.on_first_use(), codepack.on_first_use()]\n"
             "[t.join(60) for t in threading.enumerate() if t.name == 'lazytriton-codepack-build']\n"
             "print(json.dumps(started))\n")


def test_a_real_first_use_builds_the_pack_that_the_next_process_imports_from(tmp_path: Path) -> None:
    package = make_tree(site := tmp_path / "site")
    done = python(site, "-c", FIRST_USE)
    assert (done.returncode, json.loads(done.stdout)) == (0, [True, False]), done.stderr
    assert set(entries_of(Path(codepack.pack_path(str(package))).read_bytes())) == set(FILES)
    assert probe(site, "lazytriton.plain")["modules"]["lazytriton.plain"]["packed"]


def test_the_background_build_builds_its_own_install_and_leaves_a_marker_when_it_fails(tmp_path: Path) -> None:
    package = make_tree(site := tmp_path / "site")
    target = Path(codepack.pack_path(str(package)))
    background = ("-c", codepack.BUILDER, "--background")
    elsewhere = python(site, *background, str(tmp_path / "other" / "lazytriton"), cwd=site, LAZYTRITON_CODEPACK="0")
    assert (elsewhere.returncode, elsewhere.stdout) == (2, "") and not target.exists()
    (package / "broken.py").write_text("def broken(:\n")
    failed = python(site, *background, str(package), cwd=site, LAZYTRITON_CODEPACK="0")
    assert (failed.returncode, failed.stdout, failed.stderr) == (1, "", "") and not target.exists()
    assert Path(f"{target}{codepack.FAILED_SUFFIX}").read_text().startswith("SyntaxError")
    assert probe(site, "lazytriton.plain")["state"][0] == "failed"
    (package / "broken.py").write_text("BROKEN = False\n")  # a foreground build tries again, and clears the marker
    foreground = python(site, "-c", "import sys; from lazytriton import codepack_build; "
                        "sys.exit(codepack_build.main([]))", cwd=site, LAZYTRITON_CODEPACK="0")
    assert (foreground.returncode, foreground.stdout) == (0, f"wrote {target}: {len(FILES) + 1} modules\n")
    assert not Path(f"{target}{codepack.FAILED_SUFFIX}").exists() and target.exists()
    target.unlink()
    held = codepack_build.take_lock(str(target))  # another builder of this install, running
    assert held is not None and held >= 0
    try:
        busy = python(site, *background, str(package), cwd=site, LAZYTRITON_CODEPACK="0")
        assert (busy.returncode, busy.stdout, busy.stderr) == (0, "", "") and not target.exists()  # it left
    finally:
        os.close(held)
    built = python(site, *background, str(package), cwd=site, LAZYTRITON_CODEPACK="0")
    assert (built.returncode, built.stdout, built.stderr) == (0, "", "") and target.exists()


def test_a_process_run_with_dash_o_gets_a_pack_it_can_use_from_its_first_use(tmp_path: Path) -> None:
    # The background build runs with the process's -O (and -X pycache_prefix): a pack its next process uses.
    make_tree(site := tmp_path / "site")
    done = python(site, "-O", "-c", FIRST_USE)
    assert (done.returncode, json.loads(done.stdout)) == (0, [True, False]), done.stderr
    again = probe(site, "lazytriton.plain", flags=("-O",))
    assert again["finder"] and not again["wanted"]


def test_info_in_this_checkout_reports_no_code_pack(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != codepack.VARIABLE}  # the pack on: still none
    done = subprocess.run([sys.executable, "-m", "lazytriton", "info", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["code_pack"]["state"] == "none"
