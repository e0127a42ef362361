"""Build liblazytriton.so with cffi's embedding mode and install it under a prefix.

``build(prefix)`` compiles ``lazytriton.c`` (the C API; it includes
``lt_check.c``, ``lt_alias.c``, ``lt_bwd.c``, ``lt_kvcache.c`` and ``lt_combine.c``) together with the
wrappers cffi generates for the ``lt__py_*`` functions, links it against the
libpython of the interpreter running the build, and installs::

    PREFIX/lib/liblazytriton.so
    PREFIX/include/lazytriton.h
    PREFIX/lib/pkgconfig/lazytriton.pc
    PREFIX/lib/cmake/lazytriton/lazytritonConfig.cmake
    PREFIX/lib/cmake/lazytriton/lazytritonConfigVersion.cmake

Only cffi, setuptools and a C compiler are needed (no CMake, no CUDA). The
library remembers the interpreter it was built with (its venv and the build's
PYTHONPATH too) and starts that one; it needs that Python, and the packages
lazytriton imports, wherever it runs.

``pip uninstall lazytriton`` does not know these files; ``uninstall(prefix)``
(``lazytriton capi uninstall``) removes exactly them.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from lazytriton.capi import native_build
from lazytriton.record import record

HERE = Path(__file__).resolve().parent
MODULE = "_lazytriton_capi"
LIBRARY = "liblazytriton.so"

# The C half's private interface to the Python half (also defined in lazytriton.c;
# cffi checks at compile time that both agree).
INTERNAL_CDEF = """
typedef struct {
    uint32_t num_ctas;
    uint32_t size[2];
    uint32_t align[2];
    uint8_t hidden[8];
} lt__scratch_need;

typedef struct {
    uint64_t function;
    uint32_t block_threads, shared_bytes, block_m, block_n, n_hidden;
    lt__scratch_need scratch;
} lt__twin_answer;

typedef struct {
    int32_t device_index;
    int32_t capability;
    int32_t dtype;
    int32_t head_dim;
    int32_t causal;
    int32_t aligned;
    int32_t index64;
    int32_t kernel;
    int32_t varlen;
    int32_t head_dim_v;
    int32_t window;
    int32_t softcap;
    int32_t sinks;
    int32_t chunk;
    int64_t seqlen_q;
    int64_t seqlen_k;
    uint64_t function;
    uint32_t block_threads;
    uint32_t shared_bytes;
    uint32_t block_m;
    uint32_t n_hidden;
    char variant[512];
    lt__scratch_need scratch;
    lt__twin_answer twin;
} lt__plan_request;

typedef struct {
    int32_t device_index, dtype, head_dim, causal, aligned, index64, paged, window, softcap, alibi;
    int64_t rows, capacity, page_size;
    int32_t head_dim_v, append, append_aligned, append_index64;
    int32_t leftpad, rotary, rotary_interleaved;
    int32_t sinks, varlen_q, chunk, kv_fp8, qv;
    uint64_t split_function, combine_function;
    uint32_t split_threads, split_shared, split_block_m, split_block_n, split_hidden;
    uint32_t combine_threads, combine_shared, combine_block_m, combine_hidden;
    int64_t slots, min_keys;
    uint64_t append_function;
    uint32_t append_threads, append_shared, append_block_m, append_hidden;
    int32_t varlen_new;
    uint64_t lengths_function;
    uint32_t lengths_threads, lengths_shared, lengths_block, lengths_hidden;
    int32_t combine_dependent;
    int32_t split_dependent;
    int64_t kv_pairs;
    char variant[512];
} lt__kvcache_plan_request;

typedef struct {
    int32_t device_index, dtype, head_dim, aligned, index64;
    uint64_t function;
    uint32_t block_threads, shared_bytes, block_m, block_d, n_hidden;
    char variant[512];
} lt__combine_plan_request;

void lt__set_error(const char *message);

extern "Python" static int lt__py_init(const lt_config *config);
extern "Python" static int lt__py_attn_fwd_cpu(const lt_attn_fwd_params *params);
extern "Python" static int lt__py_attn_bwd_cpu(const lt_attn_bwd_params *params);
extern "Python" static int lt__py_plan(lt__plan_request *request);
extern "Python" static int lt__py_prewarm(const char *const *specs, size_t n_specs, size_t *compiled, size_t *cached);
extern "Python" static int lt__py_cache_stats(lt_stats *stats);
extern "Python" static void lt__py_flush(void);
extern "Python" static int lt__py_kvcache_plan(lt__kvcache_plan_request *request);
extern "Python" static int lt__py_attn_kvcache_cpu(const lt_attn_kvcache_params *params);
extern "Python" static int lt__py_combine_plan(lt__combine_plan_request *request);
extern "Python" static int lt__py_flash_combine_cpu(const lt_flash_combine_params *params);
"""

# Runs once, in the embedded interpreter, when lt_init first starts it.
INIT_CODE = """
from _lazytriton_capi import ffi, lib

try:
    from lazytriton.capi import embedded
    embedded.attach(ffi, lib)
except BaseException as exc:
    import sys as _sys
    _message = (f"the embedded Python ({_sys.version.split()[0]}) could not load lazytriton: "
                f"{type(exc).__name__}: {exc}; sys.path is {_sys.path}")

    def _failed(*args):
        lib.lt__set_error(_message.encode("utf-8", "replace")[:2047])
        return lib.LT_ERROR_PYTHON

    for _name in ("lt__py_init", "lt__py_attn_fwd_cpu", "lt__py_attn_bwd_cpu", "lt__py_plan", "lt__py_prewarm",
                  "lt__py_cache_stats", "lt__py_kvcache_plan", "lt__py_attn_kvcache_cpu", "lt__py_combine_plan",
                  "lt__py_flash_combine_cpu"):
        ffi.def_extern(name=_name, error=lib.LT_ERROR_PYTHON)(_failed)
    ffi.def_extern(name="lt__py_flush")(lambda: None)
"""


@record
class Installed:
    """Where a build put its files."""

    prefix: Path
    library: Path
    header: Path
    pkg_config: Path
    cmake_config: Path


def header_cdef(header: str) -> str:
    """The plain declarations of lazytriton.h that cffi parses (between BEGIN_CDEF and END_CDEF)."""
    start = header.index("/* BEGIN_CDEF")
    start = header.index("*/", start) + 2
    end = header.index("/* END_CDEF */")
    return header[start:end]


def version() -> tuple[int, int, int]:
    """LT_VERSION_MAJOR/MINOR/PATCH from the header."""
    numbers = {}
    for line in (HERE / "lazytriton.h").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "#define" and parts[1].startswith("LT_VERSION_"):
            numbers[parts[1]] = int(parts[2])
    return numbers["LT_VERSION_MAJOR"], numbers["LT_VERSION_MINOR"], numbers["LT_VERSION_PATCH"]


def _c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _libpython() -> tuple[str, str]:
    """(directory, soname) of the libpython this interpreter runs on; the build links it."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    soname = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY") or ""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") and not (Path(libdir) / soname).exists():
        raise RuntimeError(f"{sys.executable} has no shared libpython ({libdir}/{soname}), which an embedding "
                           "library needs: use a Python built with --enable-shared (distribution Pythons are)")
    return libdir, soname


def _build_pythonpath() -> str:
    """The build's PYTHONPATH, made absolute: the library appends it to the run's."""
    entries = [str(Path(p).resolve()) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p.strip()]
    return ":".join(entries)


def make_builder() -> object:
    """The cffi FFI builder of liblazytriton.so."""
    from cffi import FFI

    header = (HERE / "lazytriton.h").read_text()
    libdir, soname = _libpython()
    ffibuilder = FFI()
    # The C API's types; its functions are C (lazytriton.c), which calls the
    # extern "Python" functions below: those start the interpreter if needed.
    ffibuilder.embedding_api(header_cdef(header))
    ffibuilder.cdef(INTERNAL_CDEF)
    defines = (f"#define LT__PYTHON_EXECUTABLE {_c_string(sys.executable)}\n"
               f"#define LT__PYTHONPATH {_c_string(_build_pythonpath())}\n"
               f"#define LT__LIBPYTHON {_c_string(soname)}\n")
    ffibuilder.set_source(
        MODULE,
        defines + (HERE / "lazytriton.c").read_text(),
        include_dirs=[str(HERE)],
        library_dirs=[libdir] if libdir else [],
        libraries=["dl", "m", "pthread"],
        extra_compile_args=["-O2", "-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
        # -Bsymbolic: the library's calls of its own functions stay its own when liblazytriton_native.so, which
        # exports the same names, opens it as its JIT fallback
        extra_link_args=([f"-Wl,-rpath,{libdir}"] if libdir else []) + [f"-Wl,-soname,{LIBRARY}", "-Wl,-Bsymbolic"],
    )
    ffibuilder.embedding_init_code(INIT_CODE)
    return ffibuilder


def _render(template: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        template = template.replace(f"@{name}@", value)
    return template


def _install(source: Path | str, data: bytes | None, target: Path, mode: int = 0o644) -> None:
    """Write atomically: a copy beside the target, then a rename (a running program keeps the old file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            if data is None:
                with open(source, "rb") as src:
                    shutil.copyfileobj(src, out)
            else:
                out.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def installed_files(prefix: Path) -> tuple[Path, ...]:
    """The files ``build(prefix)`` installs: both libraries, their headers and .pc files, the CMake config files."""
    prefix = Path(prefix).expanduser().resolve()
    cmake_dir = prefix / "lib" / "cmake" / "lazytriton"
    return (prefix / "lib" / LIBRARY, prefix / "include" / "lazytriton.h",
            prefix / "lib" / "pkgconfig" / "lazytriton.pc",
            cmake_dir / "lazytritonConfig.cmake", cmake_dir / "lazytritonConfigVersion.cmake",
            prefix / "lib" / native_build.LIBRARY, prefix / "include" / "lazytriton_native.h",
            prefix / "lib" / "pkgconfig" / "lazytriton-native.pc")


def build(prefix: Path, verbose: bool = False) -> Installed:
    """Compile liblazytriton.so and liblazytriton_native.so and install them, their headers, .pc and CMake files."""
    prefix = Path(prefix).expanduser().resolve()
    major, minor, patch = version()
    values = {"PREFIX": str(prefix), "VERSION": f"{major}.{minor}.{patch}", "MAJOR": str(major)}
    library, header, pkg_config, cmake_config, cmake_version, native, native_header, native_pc = installed_files(prefix)
    with tempfile.TemporaryDirectory(prefix="lazytriton-capi-") as tmp:
        ffibuilder = make_builder()
        built = Path(ffibuilder.compile(tmpdir=tmp, target=LIBRARY, verbose=verbose))  # type: ignore[attr-defined]
        _install(built, None, library, 0o755)
        _install(native_build.build(Path(tmp) / "native"), None, native, 0o755)
    _install(HERE / "lazytriton.h", None, header)
    _install(HERE / "lazytriton_native.h", None, native_header)
    _install("", _render((HERE / "lazytriton.pc.in").read_text(), values).encode(), pkg_config)
    _install("", _render((HERE / "lazytriton-native.pc.in").read_text(), values).encode(), native_pc)
    for target in (cmake_config, cmake_version):
        _install("", _render((HERE / f"{target.name}.in").read_text(), values).encode(), target)
    return Installed(prefix, library, header, pkg_config, cmake_config)


def uninstall(prefix: Path, dry_run: bool = False) -> list[Path]:
    """Remove what ``build(prefix)`` installed; the paths removed (or, with ``dry_run``, that would be).

    Exactly the installed files, the temporary files an interrupted install
    left beside them (``.NAME.*``), and ``lib/cmake/lazytriton/`` once empty.
    Nothing else under the prefix is touched: in a virtual environment the
    prefix is the environment itself.
    """
    removed: list[Path] = []
    for target in installed_files(prefix):
        leftovers = sorted(target.parent.glob(f".{target.name}.*")) if target.parent.is_dir() else []
        for path in (target, *leftovers):
            if path.is_file() or path.is_symlink():
                if not dry_run:
                    path.unlink()
                removed.append(path)
    cmake_dir = installed_files(prefix)[3].parent
    if not dry_run and cmake_dir.is_dir() and not any(cmake_dir.iterdir()):
        cmake_dir.rmdir()
        removed.append(cmake_dir)
    return removed
