"""Which tier would serve a key, and why each other would not: probed without side effects.

``probe_*`` read what each tier holds for a key (no entry is dropped, counted,
written back or touched for LRU); ``explain`` is the pure decision over those
probes, in chain order, the way ``Chain.get`` and the runtime would take it.
``lazytriton cache explain`` prints its result; tests call ``explain`` with
made-up probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lazytriton.cache_format import Entry, EntryError
from lazytriton.cache_format.elf import check_launch
from lazytriton.cache_format.image_reader import Image, ImageError
from lazytriton.record import record

PRESENT, ABSENT, DAMAGED, UNUSABLE, UNKNOWN = "present", "absent", "damaged", "unusable", "unknown"


@record
class Probe:
    """What one tier (one image, for the image tier) holds for a key."""

    tier: str
    where: str
    state: str
    detail: str = ""


@record
class Verdict:
    """The source that would serve the key (a tier, ``jit``, or None: the call raises) and a reason per candidate."""

    source: str | None
    reasons: tuple[tuple[str, str], ...]


def classify(tier: str, where: str, key: str, data: bytes | None) -> Probe:
    """A probe from the bytes a tier holds for ``key`` (None: nothing)."""
    if data is None:
        return Probe(tier, where, ABSENT)
    try:
        entry = Entry.decode(data, expected_key=key)
    except EntryError as exc:
        return Probe(tier, where, DAMAGED, str(exc))
    return Probe(tier, where, PRESENT, f"{entry.kind} for {entry.target}, {len(entry.binary)} bytes")


def probe_images(paths: Sequence[Path], key: str, tier: str = "image") -> list[Probe]:
    """One probe per image on the search path, in order (each opened afresh, read-only)."""
    probes = []
    for path in paths:
        try:
            image = Image(path)
        except ImageError as exc:
            probes.append(Probe(tier, str(path), DAMAGED, f"the image does not open: {exc}"))
            continue
        except OSError as exc:
            probes.append(Probe(tier, str(path), UNUSABLE, f"the image cannot be read: {exc}"))
            continue
        with image:
            if key not in image:
                probes.append(Probe(tier, str(path), ABSENT))
                continue
            try:
                entry = image.read(key)
            except ImageError as exc:
                probes.append(Probe(tier, str(path), DAMAGED, str(exc)))
                continue
        assert entry is not None
        probes.append(Probe(tier, str(path), PRESENT, f"{entry.kind} for {entry.target}, {len(entry.binary)} bytes"))
    return probes


def probe_tier(tier: Any, key: str) -> Probe:
    """A probe of a tier that can ``peek`` (the local tier); UNKNOWN for one that cannot be read without effects."""
    where = str(getattr(tier, "directory", getattr(tier, "root", tier.name)))
    if getattr(tier, "usable", True) is False:
        return Probe(tier.name, where, UNUSABLE, "its directory cannot be opened")
    peek = getattr(tier, "peek", None)
    if peek is None:
        return Probe(tier.name, where, UNKNOWN, "this tier cannot be read without side effects")
    return classify(tier.name, where, key, peek(key))


def launch_problems(entry: Entry) -> list[str]:
    """Why ``entry``'s launch metadata does not fit its variant, its key or its binary; empty when all agree.

    The variant string must hash (with the source fingerprint the entry
    records) to the key it is stored under, its target must be the entry's,
    the entry's ``num_warps`` the warps the variant launches
    (``kernels.launched_warps``: its num_warps, or its partitions' for a
    warp-specialised kernel), the warp size the target's; then the binary
    must have been built for that many threads per block
    (``elf.check_launch``). A binary of another tile size with the same block
    size and symbol is not told apart: an ELF does not record its constexprs.
    """
    from lazytriton.kernels import launched_warps
    from lazytriton.target import Target
    from lazytriton.variant import LAUNCH_ABI, Variant

    problems = []
    try:
        variant = Variant.parse(entry.variant)
    except (TypeError, ValueError) as exc:
        return [f"entry variant does not parse: {exc}"]
    if entry.provenance.launch_abi == LAUNCH_ABI:
        import xxhash

        key = xxhash.xxh3_128_hexdigest(variant.canonical(entry.provenance.source_fingerprint))
        if key != entry.key:
            problems.append(f"entry stored under key {entry.key}, its variant {variant} hashes to {key}")
    if variant.target != entry.target:
        problems.append(f"entry target {entry.target}, its variant's target {variant.target}")
    options = dict(variant.options)
    if "num_warps" in options:
        try:
            warps = launched_warps(variant)
        except ValueError:  # a kernel this build does not know launches its variant's num_warps
            warps = int(options["num_warps"])
        if warps != entry.num_warps and warps == options["num_warps"]:
            problems.append(f"entry num_warps={entry.num_warps}, its variant's num_warps={warps}")
        elif warps != entry.num_warps:
            problems.append(f"entry num_warps={entry.num_warps}, its variant launches {warps} warps "
                            f"(num_warps={options['num_warps']} and the kernel's partitions)")
    try:
        warp_size = Target.parse(entry.target).warp_size
        if entry.warp_size != warp_size:
            problems.append(f"entry warp_size={entry.warp_size}, {entry.target} runs warps of {warp_size}")
    except ValueError as exc:
        problems.append(str(exc))
    return problems + check_launch(entry.kind, entry.target, entry.binary, entry.name, num_warps=entry.num_warps,
                                   warp_size=entry.warp_size, shared=entry.shared)


def _why_not(probe: Probe, served_by: Probe | None) -> str:
    if served_by is not None and probe.state == PRESENT:
        return f"also holds it, but {served_by.tier} ({served_by.where}) comes first"
    reason = {
        ABSENT: "not present",
        DAMAGED: f"present but damaged, so it would be skipped: {probe.detail}",
        UNUSABLE: f"unusable: {probe.detail}",
        UNKNOWN: f"not probed: {probe.detail}",
    }[probe.state]
    return f"not reached ({served_by.tier} serves first); {reason}" if served_by is not None else reason


def explain(probes: Sequence[Probe], jit: bool) -> Verdict:
    """The first PRESENT probe serves; every other probe and the compiler get the reason they would not."""
    served_by = next((p for p in probes if p.state == PRESENT), None)
    reasons, ahead = [], None
    for probe in probes:
        name = f"{probe.tier} {probe.where}"
        if probe is served_by:
            reasons.append((name, f"serves it: a verified entry ({probe.detail})"))
            ahead = probe
        else:
            reasons.append((name, _why_not(probe, ahead)))
    if served_by is not None:
        reasons.append(("jit", f"not needed: {served_by.tier} serves it"))
        return Verdict(served_by.tier, tuple(reasons))
    if jit:
        reasons.append(("jit", "would compile it (no tier holds a verified entry) and store it in the writable tiers"))
        return Verdict("jit", tuple(reasons))
    reasons.append(("jit", "off (LAZYTRITON_JIT=0): no tier holds a verified entry, so the call raises KernelNotFound"))
    return Verdict(None, tuple(reasons))
