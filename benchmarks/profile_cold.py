"""Where the first cache-served call of a fresh process spends its time.

Prints torch's CUDA init, the import of ``lazytriton.flash``, the first call
until it returns and the GPU wait after it. With ``--profile`` the first call
runs under cProfile (which slows the Python parts) and the top functions
follow (``--sort``: tottime or cumtime). Serve it from an image with
``LAZYTRITON_IMAGES`` (and ``LAZYTRITON_JIT=0``, so nothing compiles) that
holds what the call loads:

    python benchmarks/profile_cold.py [--shape 4,16,2048,128 --causal] [--profile]
    python benchmarks/profile_cold.py --working-set [--profile]

``--modules`` lists the modules the import and the first call import
(after torch's). ``--working-set`` runs a model's forward and backward instead of one call
(``cold_start.WORKING_SET``: 8 variants on sm_90). The image that
``bench_prewarm.py --cold-start --keep-image PATH`` serves holds both.

The garbage collector's passes inside the import, the route (with
``--fake-driver``: a pass moves between the route and the call when either
allocates less) and the first call or step follow (``gc: ...``: how many of
each generation and their thread CPU ms, timed by ``gc.callbacks``): a pass's cost depends on what the process holds
(torch's import leaves a gen-2 pass of tens of ms due), not on our code alone.
``--gc-freeze`` calls ``gc.freeze()`` after torch's import and the inputs (a
serving process's own choice, never lazytriton's): the passes then traverse
what the import and the call made, not torch's objects.

``--markers`` calls ``os.getppid()`` between the phases (before the import,
after it, after the route, after the first call), so that callgrind splits
its instruction counts there: ``valgrind --tool=callgrind
--dump-before=os_getppid python benchmarks/profile_cold.py --markers ...``
writes one file per phase (``.2`` the import, ``.3`` the route, ``.4`` the
first call), counts that the machine's load does not move.

``--split`` times lazytriton's own parts of the first call or step apart
(outermost calls, wall and thread CPU): flash_fwd's and flash_bwd's binding
(``forward``, ``backward``: everything of a call below the autograd Function),
the plans in them (``launch.plan``: dispatch's choice, the keys, the entries'
reads and loads), the entries' reads (``Runtime.resolve``: the tiers, the
image's decompression and decode) and loads (``Runtime._load`` less its
reads: the driver's module load); the rest of the step is torch's (its math,
autograd, its own first uses on the device). It imports flash_bwd's binding
before the step (with ``--working-set``), which the step otherwise imports.
``--steps`` (with ``--split``) imports the driver before the call too (its
import timed apart: ``driver import``) and splits the loads into the driver's
binding (``api``: libcuda opened, cuInit, the driver's version; ``helpers``:
the compiled helpers looked for), the device's context (``context``: the
primary context retained, its shared-memory limit), the modules
(``module``: cuModuleLoadData, cuModuleGetFunction, the shared-memory
attribute) and the kernels' launch state (``kernel``: ``LoadedKernel``'s
layout and launcher), and times the launches (``launch``).

``--fake-driver LIB`` needs no GPU: CPU tensors take the CUDA path up to the
driver (dispatch for ``--target``, the image, the driver's load and launch)
on a fake libcuda that runs nothing (tests/fake_libcuda.py builds one:
``python -c "import sys; sys.path.insert(0, 'tests'); import fake_libcuda,
pathlib; print(fake_libcuda.build(pathlib.Path('/tmp')))"``); the image must
hold that target's variants. Times are wall and thread CPU (the second is
steadier on a shared machine). The route's own CPU time is printed apart
(``route``): it is mostly the imports of the driver (and, with
``--working-set``, of the backward's binding), which on a GPU the first call
or step makes; add it to the first call's to compare processes whose import
lists differ.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import time

import cold_start
import torch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--shape", default="4,16,2048,128", help="batch,heads,seqlen,head_dim (bf16)")
parser.add_argument("--causal", action="store_true", help="a causal call (the default shape's is)")
parser.add_argument("--working-set", action="store_true", help="a model's forward and backward instead of one call")
parser.add_argument("--fake-driver", metavar="LIB", default=None, help="CPU tensors, the CUDA path up to this libcuda")
parser.add_argument("--target", default="sm_90", help="--fake-driver: the GPU target dispatch decides for")
parser.add_argument("--profile", action="store_true", help="run the first call under cProfile")
parser.add_argument("--sort", default="tottime", choices=("tottime", "cumtime"))
parser.add_argument("--top", type=int, default=30)
parser.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after torch's import and the inputs (what a serving process may do itself)")
parser.add_argument("--markers", action="store_true", help="os.getppid() between the phases (callgrind's dumps)")
parser.add_argument("--modules", action="store_true", help="list the modules the import and the first call import")
parser.add_argument("--split", action="store_true",
                    help="time lazytriton's parts of the first call or step apart (bindings, plans, reads, loads)")
parser.add_argument("--steps", action="store_true",
                    help="with --split: the driver's import apart, and its loads' steps (api, context, module, ...)")
args = parser.parse_args()
shape = tuple(int(x) for x in args.shape.split(","))
causal = args.causal or args.shape == parser.get_default("shape")
device = "cpu" if args.fake_driver else "cuda"


class Collections:
    """The garbage collector's passes while ``phase`` is set: (generation, thread CPU seconds) each."""

    def __init__(self) -> None:
        self.phase = ""
        self.passes: dict[str, list[tuple[int, float]]] = {}
        self.started = 0.0
        gc.callbacks.append(self.callback)

    def callback(self, event: str, info: dict[str, int]) -> None:
        if event == "start":
            self.started = time.thread_time()
        elif self.phase:
            self.passes.setdefault(self.phase, []).append((info["generation"], time.thread_time() - self.started))

    def summary(self, phase: str) -> str:
        passes = self.passes.get(phase, [])
        by_generation = {g: [s for gen, s in passes if gen == g] for g in sorted({g for g, _ in passes})}
        parts = [f"{len(times)} gen-{g} {1e3 * sum(times):.2f} ms" for g, times in by_generation.items()]
        return f"{phase}: {', '.join(parts) or 'none'}"


collections = Collections()


class Split:
    """Wall and thread CPU seconds inside a few functions during the first call or step (outermost calls only)."""

    def __init__(self) -> None:
        self.spent: dict[str, list[float]] = {}

    def wrap(self, owner: object, name: str, label: str) -> None:
        function = getattr(owner, name)
        depth = [0]

        def timed(*args: object, **kwargs: object) -> object:
            if depth[0]:
                return function(*args, **kwargs)
            depth[0] += 1
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                spent = self.spent.setdefault(label, [0.0, 0.0, 0])
                spent[0] += time.perf_counter() - wall
                spent[1] += time.thread_time() - cpu
                spent[2] += 1

        setattr(owner, name, timed)

    def ms(self, label: str) -> tuple[float, float, int]:
        wall, cpu, calls = self.spent.get(label, (0.0, 0.0, 0))
        return 1e3 * wall, 1e3 * cpu, int(calls)

    def summary(self, step_wall: float, step_cpu: float) -> str:
        parts = []
        for label in ("forward", "backward", "plans", "reads", "loads", *STEPS):
            wall, cpu, calls = self.ms(label)
            if not calls:
                continue
            if label == "loads":  # Runtime._load holds its read: the driver's part alone
                wall, cpu = wall - self.ms("reads")[0], cpu - self.ms("reads")[1]
            if label in NESTED:  # the step holds another one timed apart: its own part alone
                wall, cpu = wall - self.ms(NESTED[label])[0], cpu - self.ms(NESTED[label])[1]
            parts.append(f"{label} {wall:.1f} ms ({cpu:.1f} CPU, {calls} calls)")
        ours_wall = self.ms("forward")[0] + self.ms("backward")[0]
        ours_cpu = self.ms("forward")[1] + self.ms("backward")[1]
        return (f"split: {'; '.join(parts)}; the bindings together {ours_wall:.1f} ms ({ours_cpu:.1f} CPU), the rest "
                f"(torch's math, autograd, first uses) {1e3 * step_wall - ours_wall:.1f} ms "
                f"({1e3 * step_cpu - ours_cpu:.1f} CPU)")


# --steps' labels, in the order printed; a step holding another (``NESTED``) is printed less that one.
STEPS = ("api", "helpers", "context", "module", "kernel", "launch")
NESTED = {"api": "helpers", "module": "kernel"}

mark = os.getppid if args.markers else (lambda: 0)


def synchronize() -> None:
    if device == "cuda":
        torch.cuda.synchronize()


t0 = time.perf_counter()
if args.working_set:
    inputs = cold_start.working_set_inputs(device)
else:
    inputs = [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3)]
synchronize()
if args.gc_freeze:
    gc.freeze()  # torch's objects (and the inputs) out of every later pass: the passes below see ours alone
before_import = set(sys.modules)
collections.phase = "import"
mark()
t1, c1 = time.perf_counter(), time.thread_time()
from lazytriton import runtime  # noqa: E402
from lazytriton.flash import attn_fwd  # noqa: E402

t2, c2 = time.perf_counter(), time.thread_time()
collections.phase = ""
after_import = set(sys.modules)  # before the fake driver's route, which imports the driver and the bindings
mark()
collections.phase = "route"
c_route = time.thread_time()
if args.fake_driver:
    cold_start.route_to_fake_driver(args.fake_driver, args.target, backward=args.working_set)
c_route = time.thread_time() - c_route
collections.phase = ""
mark()
split = Split()
if args.split:
    from lazytriton import launch  # noqa: E402
    from lazytriton.kernels.flash_fwd import binding as fwd_binding  # noqa: E402

    split.wrap(fwd_binding, "forward", "forward")
    split.wrap(launch, "plan", "plans")
    split.wrap(runtime.Runtime, "resolve", "reads")
    split.wrap(runtime.Runtime, "_load", "loads")
    if args.working_set:
        from lazytriton.kernels.flash_bwd import binding as bwd_binding  # noqa: E402

        split.wrap(bwd_binding, "backward", "backward")
    if args.steps:
        c_driver = time.thread_time()
        w_driver = time.perf_counter()
        from lazytriton import driver  # noqa: E402,F401
        from lazytriton.driver import gpu, helpers  # noqa: E402

        print(f"driver import {1e3 * (time.perf_counter() - w_driver):.1f} ms "
              f"({1e3 * (time.thread_time() - c_driver):.1f} CPU)")
        split.wrap(gpu, "cuda", "api")  # CudaApi() and helpers.on_first_use, once
        split.wrap(helpers, "on_first_use", "helpers")
        split.wrap(gpu.CudaApi, "_context", "context")
        split.wrap(gpu.CudaApi, "load", "module")
        split.wrap(gpu.LoadedKernel, "__init__", "kernel")
        split.wrap(gpu.LoadedKernel, "launch", "launch")
profile = cProfile.Profile()
before_call = set(sys.modules)
collections.phase = "first step" if args.working_set else "first call"
t3, c3 = time.perf_counter(), time.thread_time()
if args.profile:
    profile.enable()
if args.working_set:
    cold_start.working_set_step(inputs)
else:
    attn_fwd(*inputs, causal=causal)
t4, c4 = time.perf_counter(), time.thread_time()
mark()
collections.phase = ""
synchronize()
t5 = time.perf_counter()
profile.disable()
rt = runtime.get()
print(f"{'CPU inputs' if args.fake_driver else 'torch CUDA init'} {1e3 * (t1 - t0):.1f} ms; "
      f"import {1e3 * (t2 - t1):.1f} ms ({1e3 * (c2 - c1):.1f} CPU); "
      f"{f'route {1e3 * c_route:.1f} ms CPU; ' if args.fake_driver else ''}"
      f"first {'step' if args.working_set else 'call'} {1e3 * (t4 - t3):.1f} ms ({1e3 * (c4 - c3):.1f} CPU)"
      f"{' (profiled)' if args.profile else ''}; GPU wait {1e3 * (t5 - t4):.1f} ms;"
      f" served {dict(rt.served)}; compiles {rt.compiles}; loaded {len(rt.loaded_kernels())};"
      f" triton imported: {'triton' in sys.modules}; torch._dynamo imported: {'torch._dynamo' in sys.modules}")
print(f"gc: {collections.summary('import')}; {collections.summary('route') + '; ' if args.fake_driver else ''}"
      f"{collections.summary('first step' if args.working_set else 'first call')}")
if args.split:
    print(split.summary(t4 - t3, c4 - c3))
if args.modules:
    print(f"the import imported: {sorted(after_import - before_import)}")
    if args.fake_driver:  # on a GPU the first call imports these itself
        print(f"the fake driver's route imported: {sorted(before_call - after_import)}")
    print(f"the first {'step' if args.working_set else 'call'} imported: {sorted(set(sys.modules) - before_call)}")
if args.profile:
    pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
