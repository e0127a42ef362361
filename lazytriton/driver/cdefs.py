"""The C declarations lazytriton uses from libcuda and libamdhip64, and their cffi types.

Parsing declarations at run time costs cffi about 35 ms (pycparser), a large
part of a fresh process's first call. ``ffi_build.py`` pre-parses them into
``_cuda_ffi.py`` and ``_hip_ffi.py`` (cffi's out-of-line ABI mode: plain
Python, no C compiler), which import in under 1 ms. Each records a hash of
the declarations it was made from; if they no longer match, or the module
does not load with the installed cffi, the declarations are parsed at run time.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from cffi import FFI  # the package costs ~2.6 ms to import; the pre-parsed modules need only _cffi_backend

log = logging.getLogger("lazytriton.driver")

# cuLaunchKernelEx's configuration as cuda.h lays it out (one attribute's value: a union of 64 bytes); the launch
# helper's C text (fastlaunch_build.PLAN_SOURCE) declares the same structs under its own names.
LAUNCH_CONFIG_CDEF = """typedef struct {
    int id;
    int pad;
    union { char bytes[64]; int programmatic; uint64_t align; } value;
} CUlaunchAttribute;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    uintptr_t hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
"""

CUDA_CDEF = """
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
CUresult cuInit(unsigned int flags);
CUresult cuDriverGetVersion(int *driverVersion);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuCtxGetCurrent(CUcontext *pctx);
CUresult cuCtxPushCurrent_v2(CUcontext ctx);
CUresult cuCtxPopCurrent_v2(CUcontext *pctx);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuFuncSetAttribute(CUfunction hfunc, int attrib, int value);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                        unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                        unsigned int sharedMemBytes, uintptr_t hStream, void **kernelParams, void **extra);
""" + LAUNCH_CONFIG_CDEF + """\
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
CUresult cuTensorMapEncodeTiled(void *tensorMap, int tensorDataType, uint32_t tensorRank, void *globalAddress,
                                const uint64_t *globalDim, const uint64_t *globalStrides, const uint32_t *boxDim,
                                const uint32_t *elementStrides, int interleave, int swizzle, int l2Promotion,
                                int oobFill);
"""

HIP_CDEF = """
typedef int hipError_t;
typedef struct ihipModule_t *hipModule_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
hipError_t hipGetDevice(int *deviceId);
hipError_t hipSetDevice(int deviceId);
hipError_t hipModuleLoadData(hipModule_t *module, const void *image);
hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module, const char *kname);
hipError_t hipFuncSetAttribute(const void *func, int attr, int value);
const char *hipGetErrorString(hipError_t hipError);
hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gridDimX, unsigned int gridDimY, unsigned int gridDimZ,
                                 unsigned int blockDimX, unsigned int blockDimY, unsigned int blockDimZ,
                                 unsigned int sharedMemBytes, uintptr_t stream, void **kernelParams, void **extra);
"""


def cdef_hash(cdef: str) -> str:
    """The hash a pre-parsed module records of the declarations it holds."""
    return xxhash.xxh3_64_hexdigest(cdef.encode())


def make_ffi(name: str, cdef: str) -> FFI:
    """The FFI for ``cdef``: pre-parsed if the generated module matches, else parsed now."""
    try:
        module = importlib.import_module(f"lazytriton.driver._{name}_ffi")
        if getattr(module, "CDEF_HASH", None) == cdef_hash(cdef):
            return module.ffi  # type: ignore[no-any-return]
        log.debug("lazytriton.driver._%s_ffi is stale; parsing declarations at run time", name)
    except Exception as exc:  # an older or newer cffi may refuse the generated module
        log.debug("pre-parsed %s declarations unusable (%s); parsing at run time", name, exc)
    from cffi import FFI

    ffi = FFI()
    ffi.cdef(cdef)
    return ffi
