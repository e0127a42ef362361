"""On the GPU host: check that attention calls are served from the shipped image, with 0 compiles.

    LAZYTRITON_IMAGES=dist/attention.ltimg python examples/deployment/use_image.py

With a CUDA GPU it runs ``attn_fwd`` on a few shapes and prints where each
kernel came from. Without one (a CPU-only machine, CI) it resolves the
variants those calls would select on ``--target`` (default sm_90) and checks
they come from the image, without launching anything. Either way it fails if
anything was compiled, and reports whether triton was imported (it should
not be: a deployment needs the GPU driver, not a compiler).

Exit status: 0 all served from the image; 1 something was compiled, or a
kernel the image lacks could not be (LAZYTRITON_JIT=0, or no triton): one
line names it; 2 a usage or configuration error (a bad LAZYTRITON_* value).
"""

from __future__ import annotations

import argparse
import sys

# (batch, heads, seqlen, head dim, causal): a typical decoder prefill, and a short and a long call.
SHAPES = ((4, 16, 2048, 128, True), (1, 32, 16, 128, True), (2, 8, 8192, 64, False))


def on_gpu() -> None:
    import torch

    from lazytriton.flash import attn_fwd

    for b, h, s, d, causal in SHAPES:
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        attn_fwd(q, k, v, causal=causal)
    torch.cuda.synchronize()


def without_gpu(target: str) -> None:
    from lazytriton import runtime
    from lazytriton.kernels.flash_fwd import dispatch as fwd_dispatch
    from lazytriton.target import Target

    for _, _, s, d, causal in SHAPES:
        variant = fwd_dispatch.flash_fwd_variant(Target.parse(target), "bf16", d, causal, True, s, seqlen_k=s)
        runtime.get().resolve(variant)


def run_calls(target: str) -> tuple[bool, str | None]:
    """(ran on a GPU, an error line or None): a kernel the image lacks and nothing could compile is one line."""
    from lazytriton.runtime import KernelNotFound

    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    try:
        if gpu:
            on_gpu()
        else:
            without_gpu(target)
    except KernelNotFound as exc:
        return gpu, f"use_image.py: the image lacks a kernel these calls need: {exc}"
    except ImportError as exc:  # a miss on a deployment without triton: the message says how to get it
        return gpu, f"use_image.py: the image lacks a kernel these calls need, and it cannot be compiled here: {exc}"
    return gpu, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="sm_90", help="target to resolve for when there is no GPU")
    args = parser.parse_args()
    from lazytriton import config, runtime

    try:
        images = config.settings().images
    except ValueError as exc:  # a bad LAZYTRITON_* value: the message names it
        print(f"use_image.py: configuration error: {exc}", file=sys.stderr)
        return 2
    if not images:
        print("use_image.py: set LAZYTRITON_IMAGES to the image(s) to serve from", file=sys.stderr)
        return 2
    gpu, error = run_calls(args.target)
    if error is not None:
        print(error, file=sys.stderr)
        print("hint: rebuild the image to cover it (build_image.sh; MISSES= adds production's misses.jsonl)",
              file=sys.stderr)
        return 1
    rt = runtime.get()
    triton = any(name == "triton" or name.startswith("triton.") for name in sys.modules)
    print(f"{'ran on the GPU' if gpu else 'resolved for ' + args.target}: kernels served by "
          f"{dict(rt.served)}, {rt.compiles} compiles, triton imported: {triton}")
    return 0 if rt.compiles == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
