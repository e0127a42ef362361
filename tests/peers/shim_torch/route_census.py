"""Which of PyTorch's attention test cases reach lazytriton, and which of those it serves: from a run's logs.

PyTorch's tests are unittest methods whose parameters live in their names and whose bodies choose backends at run
time, so their cases are classified by what they did, not by rules over parameters (``peer_census``, the
FlashAttention suites'): ``torch_route``'s log says, for each case that ran, how many SDPA calls lazytriton served
(a fused backend allowed) and the first line of each it refused. Joined with the run's outcomes:

- ``skipped``: the test skipped itself (a CUDA-only case on a CPU run, a backend the platform lacks, ...);
- ``fails with torch alone``: the case failed in a baseline run (``--torch-baseline``: every call torch's), so
  the file and the installed torch disagree whatever serves the calls: not counted;
- ``timed out``: it ran past the run's time limit (the interpreter on a CPU run): not counted;
- ``torch only``: no call reached lazytriton (the modules' fast paths, torch's backend choice, errors torch raises
  before any SDPA call): not about lazytriton;
- ``through lazytriton``: at least one call it served. Of those, a case that failed after a refusal is a ``gap``
  (what lazytriton's drop-in cannot express, grouped by the refusal); a case that failed because an error or a
  warning it expected did not come (``unraised``: ``RuntimeError not raised``, ``UserWarning not triggered``) and
  lazytriton refused nothing is ``serves what torch refuses``: the test pins a limit of one of torch's backends
  (float32 in its flash kernel, a mask with flash, a nondeterministic backward's warning) that lazytriton's
  drop-in does not have, listed, not counted as expressible; the rest are ``expressible``, passed or failed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# A number standing alone (a size, a shape's entry, an error), not one inside a name (float16, sm_90, cuda:0)
_NUMBER = re.compile(r"(?<![\w.:])[-+]?\d+(\.\d+)?([eE][-+]?\d+)?(?![\w])")
EXAMPLES = 3


def routed(outcomes: Mapping[str, str], routes: Iterable[Mapping[str, Any]],
           baseline: Mapping[str, str] | None = None, timed_out: Iterable[str] = (),
           unraised: Iterable[str] = ()) -> dict[str, Any]:
    """The census of a run: ``outcomes`` its summary's {node id: outcome}, ``routes`` the route log's lines,
    ``baseline`` a baseline run's outcomes, ``timed_out`` the cases that ran past the time limit, ``unraised``
    those that failed for want of an error or warning they expected."""
    calls: dict[str, tuple[int, list[str]]] = {}
    for line in routes:
        served, refused = calls.get(line["nodeid"], (0, []))
        calls[line["nodeid"]] = (served + int(line["lazytriton"]), refused + [str(m) for m in line["refused"]])
    late, missing = set(timed_out), set(unraised)
    counts = dict.fromkeys(("run", "skipped", "fails_with_torch_alone", "timed_out", "torch_only",
                            "through_lazytriton", "gap", "serves_what_torch_refuses", "expressible",
                            "expressible_passed", "expressible_failed"), 0)
    beyond: list[str] = []
    gaps: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for nodeid, outcome in outcomes.items():
        if outcome == "skipped":
            counts["skipped"] += 1
            continue
        counts["run"] += 1
        if outcome != "passed" and baseline is not None and baseline.get(nodeid) in ("failed", "errored"):
            counts["fails_with_torch_alone"] += 1
            continue
        if nodeid in late:
            counts["timed_out"] += 1
            continue
        served, refused = calls.get(nodeid, (0, []))
        if served == 0:
            counts["torch_only"] += 1
            continue
        counts["through_lazytriton"] += 1
        if refused and outcome != "passed":
            counts["gap"] += 1
            key = _NUMBER.sub("#", refused[0])
            group = gaps.setdefault(key, {"refusal": key, "count": 0, "cases": []})
            group["count"] += 1
            if len(group["cases"]) < EXAMPLES:
                group["cases"].append(nodeid)
            continue
        if outcome != "passed" and nodeid in missing:
            counts["serves_what_torch_refuses"] += 1
            beyond.append(nodeid)
            continue
        counts["expressible"] += 1
        counts["expressible_passed" if outcome == "passed" else "expressible_failed"] += 1
        if outcome != "passed":
            failed.append(nodeid)
    through = counts["through_lazytriton"]
    return {"counts": counts, "expressible_fraction": counts["expressible"] / through if through else None,
            "passed_fraction": counts["expressible_passed"] / counts["expressible"] if counts["expressible"] else None,
            "gaps": sorted(gaps.values(), key=lambda g: (-g["count"], g["refusal"])), "expressible_failed": failed,
            "serves_what_torch_refuses": beyond}


def routed_markdown(census: Mapping[str, Any]) -> str:
    """The census as text: the counts, the fractions, the gaps by refusal, the expressible cases that failed."""
    c = census["counts"]
    lines = ["# PyTorch's attention tests through lazytriton", "",
             f"- run {c['run']} (skipped {c['skipped']}): fails with torch alone {c['fails_with_torch_alone']}, "
             f"timed out {c['timed_out']}, torch only {c['torch_only']}, through lazytriton "
             f"{c['through_lazytriton']}",
             f"- expressible {c['expressible']} of {c['through_lazytriton']}"
             + (f" ({100 * census['expressible_fraction']:.1f}%)" if census["expressible_fraction"] is not None else "")
             + f": passed {c['expressible_passed']}, failed {c['expressible_failed']}",
             f"- gaps {c['gap']}",
             f"- served what torch refuses {c['serves_what_torch_refuses']} (the test expected torch's error or "
             "warning)", "", "## Gaps by refusal", ""]
    lines += [f"- **{g['count']}** `{g['refusal']}`; e.g. {g['cases'][0]}" for g in census["gaps"]] or ["(none)"]
    lines += ["", "## Expressible cases that failed (their messages: the run's summary)", ""]
    lines += [f"- {nodeid}" for nodeid in census["expressible_failed"]] or ["(none)"]
    lines += ["", "## Served what torch refuses (the error or warning the test expected did not come)", ""]
    lines += [f"- {nodeid}" for nodeid in census["serves_what_torch_refuses"]] or ["(none)"]
    return "\n".join(lines) + "\n"
