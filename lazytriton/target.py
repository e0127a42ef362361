"""GPU targets: the names in keys (``sm_90``, ``gfx942``) and what they mean.

A target names the binary a compiler must produce, not a device: ``sm_90``
means a cubin for compute capability 9.0, ``gfx942`` an HSACO code object for
that AMD ISA. Names parse and print back to themselves.
"""

from __future__ import annotations

from lazytriton.record import record


def _is_sm(name: str) -> bool:
    """``sm_`` and 2 or 3 digits, the first not 0 ("sm_090" would name sm_90's binary under another key)."""
    digits = name[3:]
    return name.startswith("sm_") and len(digits) in (2, 3) and digits[0] in "123456789" and digits.isdecimal()


def _is_gfx(name: str) -> bool:
    """``gfx`` and 3 or 4 lowercase hex digits."""
    return name.startswith("gfx") and len(name) in (6, 7) and not name[3:].strip("0123456789abcdef")


@record
class Target:
    """A compile target: backend (``cuda`` or ``hip``), arch and warp size."""

    backend: str
    arch: str
    warp_size: int

    @classmethod
    def parse(cls, text: str) -> Target:
        """Parse ``sm_90``, ``cuda:90``, ``gfx942`` or ``hip:gfx942``."""
        if not isinstance(text, str):
            raise TypeError(f"target must be a str such as 'sm_90' or 'gfx942', got {type(text).__name__}")
        name = text.strip().lower()
        if name.startswith("cuda:"):
            name = "sm_" + name[5:]
        elif name.startswith("hip:") and _is_gfx(name[4:]):  # "hip:sm_90" stays junk
            name = name[4:]
        if _is_sm(name):
            return cls("cuda", name[3:], 32)
        if _is_gfx(name):
            # CDNA (gfx9xx) runs 64-wide wavefronts; RDNA (gfx10xx+) runs 32.
            return cls("hip", name, 64 if name.startswith("gfx9") else 32)
        raise ValueError(f"target must look like 'sm_90', 'cuda:80', 'gfx942' or 'hip:gfx950', got {text!r}")

    def __str__(self) -> str:
        return f"sm_{self.arch}" if self.backend == "cuda" else self.arch

    @property
    def binary_kind(self) -> str:
        """The kind of binary an entry for this target holds."""
        return "cubin" if self.backend == "cuda" else "hsaco"

    @property
    def capability(self) -> int:
        """CUDA compute capability as an int (90 for sm_90); 0 on HIP."""
        return int(self.arch) if self.backend == "cuda" else 0


def target_from_cuda_capability(major: int, minor: int) -> Target:
    """The target of a CUDA device of compute capability ``major.minor``."""
    return Target("cuda", f"{major}{minor}", 32)


def target_from_gcn_arch(gcn_arch_name: str) -> Target:
    """The target of a ROCm device from its ``gcnArchName`` (``gfx942:sramecc+:xnack-``)."""
    return Target.parse(gcn_arch_name.split(":", 1)[0])
