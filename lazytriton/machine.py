"""The device read: the compile target of a torch device. The one function here that asks the machine."""

from __future__ import annotations

from typing import Any

from lazytriton.target import Target, target_from_cuda_capability, target_from_gcn_arch


def target_of_device(device: Any) -> Target:
    """The compile target of a torch CUDA/ROCm device (reads the machine)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return target_from_gcn_arch(props.gcnArchName)
    return target_from_cuda_capability(props.major, props.minor)
