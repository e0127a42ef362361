"""What the cold-start benchmarks run: the one-kernel call, a model's working set, and Triton's JIT baseline.

Shared by ``bench_prewarm.py --cold-start`` (a fresh process per measurement,
on a CUDA host) and ``profile_cold.py`` (where one fresh process spends its
time, on a CUDA host or, with ``--fake-driver``, on CPU up to the driver).
Importing this module imports nothing heavy: each child process times its own
imports.

- ``CALL``: one forward, bf16 (4, 16, 2048, 128) causal (on sm_90:
  flash_fwd_gluon, one variant).
- ``WORKING_SET``: a training step's attention of a Whisper-style
  encoder-decoder, bf16, head dim 64: the encoder's self-attention (1500
  frames), the decoder's causal self-attention (448 tokens) and its
  cross-attention (448 x 1500), forward and backward: 8 variants on sm_90
  (three forwards, the backward's two kernels for each, sharing one).
- ``triton_jit_call``: the forward as Triton's own JIT launches it
  (``fn[grid](...)``), built from what the binding uses (dispatch's variant,
  ``binding.triton_args`` from the kernel's parameter description, the
  variant's constexprs and options): the same kernel and config lazytriton
  serves, with no argument list written here to fall behind the kernel's.
- ``route_to_fake_driver``: CPU tensors down the CUDA path (dispatch for a
  GPU target, the store chain, the driver's load and launch) onto the fake
  libcuda of the tests (tests/fake_libcuda.py), which runs nothing.
"""

from __future__ import annotations

from typing import Any

CALL = ((4, 16, 2048, 128), True)  # (batch, heads, seqlen, head dim) and causal of the one-kernel call
# (q's shape, k's and v's shape, causal), bhsd
WORKING_SET = (
    ((4, 8, 1500, 64), (4, 8, 1500, 64), False),
    ((4, 8, 448, 64), (4, 8, 448, 64), True),
    ((4, 8, 448, 64), (4, 8, 1500, 64), False),
)
WORKING_SET_VARIANTS = 8  # on sm_90 (the image built for it holds exactly these)


def call_inputs(device: str) -> tuple[Any, Any, Any]:
    """q, k, v of ``CALL`` on ``device`` (bf16, randn)."""
    import torch

    shape, _ = CALL
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(3))
    return q, k, v


def working_set_inputs(device: str) -> list[tuple[Any, ...]]:
    """(q, k, v, causal, grad of out) for each call of ``WORKING_SET``, q, k, v requiring grad."""
    import torch

    def randn(shape: tuple[int, ...], grad: bool) -> Any:
        return torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=grad)

    return [(randn(q, True), randn(kv, True), randn(kv, True), causal, randn(q, False))
            for q, kv, causal in WORKING_SET]


def working_set_step(inputs: list[tuple[Any, ...]], sdpa: bool = False) -> list[Any]:
    """Every forward of the working set, then one backward through all of them: the gradients of q, k, v.

    ``sdpa``: each forward through torch's own ``scaled_dot_product_attention`` (its fused backends) instead
    of lazytriton's ``attn_fwd``: the same step as a model takes it without lazytriton, torch's first uses
    (its kernels' modules, autograd's engine) included.

    The backward starts from a scalar loss, as a training step's does (the
    gradient of each out is its ``grad``): ``torch.autograd.backward`` given
    gradient tensors imports sympy on its first call (torch 2.13), a cost of
    torch's that a step through ``loss.backward()`` never pays.
    """
    if sdpa:
        import torch.nn.functional as F

        outs = [F.scaled_dot_product_attention(q, k, v, is_causal=causal) for q, k, v, causal, _ in inputs]
    else:
        from lazytriton.flash import attn_fwd

        outs = [attn_fwd(q, k, v, causal=causal)[0] for q, k, v, causal, _ in inputs]
    loss = sum((out * grad).sum() for out, (*_, grad) in zip(outs, inputs, strict=True))
    loss.backward()  # type: ignore[union-attr]
    return [t.grad for q, k, v, _, _ in inputs for t in (q, k, v)]


def triton_jit_call(q: Any, k: Any, v: Any, causal: bool, target: Any) -> tuple[Any, ...]:
    """``(jit function, grid, args, constexprs, options, out, lse)``: the forward as Triton's JIT launches it.

    Launch it with ``fn[grid](*args, **constexprs, **options)``; it writes
    ``out`` and ``lse``. ``target`` is the GPU target dispatch decides for (a
    ``lazytriton.target.Target``). Imports triton (the kernel's module).
    """
    import importlib

    from lazytriton.kernels import get
    from lazytriton.kernels.flash_fwd import binding
    from lazytriton.variant import kernel_constexprs

    call = binding.check(q, k, v, causal)
    out, lse = binding.empty_outputs(q, call.shape, call.head_dim_v)
    _, aligned, index64 = binding.pack(q, k, v, out, lse, call)
    is_causal = call.causal != "none"
    key = binding.memo_key(0, q.dtype, call.shape, is_causal, aligned, index64, offset=call.offset,
                           scale=call.scale)
    variant = binding.variant(target, q.dtype, call.shape, is_causal, aligned, index64, gluon=binding.gluon_key(key))
    spec = get(variant.kernel)
    fn = getattr(importlib.import_module(spec.module), spec.function)
    args = binding.triton_args(q, k, v, out, lse, call)
    grid = binding.grid(call.shape, int(variant.get("BLOCK_M")))
    return fn, grid, args, kernel_constexprs(variant, spec.constexprs), dict(variant.options), out, lse


def route_to_fake_driver(library: str, target: str = "sm_90", backward: bool = True) -> None:
    """Serve CPU tensors as a GPU call on ``target``: dispatch, the tiers and the driver run; no kernel does.

    The forward and backward bindings' CPU branch (Triton's interpreter) is
    replaced by their GPU launch; the device reads as ``target`` with no
    capture, stream 0 and CPU scratch; the CUDA driver is ``library`` (the
    fake libcuda), on which every load and launch succeeds and runs nothing.
    Call it after the imports to be timed: it imports the driver and the
    forward's binding, and with ``backward`` the backward's (a forward-only
    process on a GPU never imports it, and neither does this one without it).
    """
    import functools

    import torch

    from lazytriton import driver, launch, machine
    from lazytriton.driver import gpu
    from lazytriton.kernels.flash_fwd import binding as fwd
    from lazytriton.target import Target

    found = Target.parse(target)
    machine.target_of_device = lambda device: found
    launch.is_capturing = lambda: False
    launch.raw_stream = lambda device_index: 0
    launch.scratch_alloc = lambda nbytes, device_index: torch.empty(nbytes, dtype=torch.uint8)
    fwd.run_interpreter = fwd.launch_gpu
    if backward:
        from lazytriton.kernels.flash_bwd import binding as bwd

        bwd.run_interpreter = bwd.launch_gpu
    gpu.cuda = functools.cache(lambda: gpu.CudaApi(library))
    load = driver.load
    driver.load = lambda entry, device_index, dependent=False: load(entry, 0 if device_index is None else device_index,
                                                                    dependent)
