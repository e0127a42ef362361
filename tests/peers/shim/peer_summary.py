"""A peer suite's results: each case's outcome, counted per test function, failures grouped by their first line.

``Results`` takes pytest's reports (``add``) or outcomes directly (``record``), and ``summary`` gives a plain dict
(written as JSON, with every case's outcome) that ``markdown`` prints as tables. Messages are grouped once their
numbers are replaced by ``#``, so failures that differ only in a shape or an error size fall into one group.
"""

from __future__ import annotations

import re
from typing import Any

OUTCOMES = ("passed", "failed", "skipped", "errored")
_NUMBER = re.compile(r"[-+]?\d+(\.\d+)?([eE][-+]?\d+)?")
MAX_MESSAGE = 240
EXAMPLE_CASES = 3
# A case that ran past --peer-timeout: peer_plugin raises PeerTimeout where the case is, and Triton's interpreter
# wraps an exception raised inside a kernel in its own InterpreterError (once per nesting level), so every message
# naming PeerTimeout is recorded as this one and counted in the summary's "timed_out".
TIMEOUT = "peer_plugin.PeerTimeout: the case ran past --peer-timeout"
# unittest's and pytest's words when an error or a warning the test expected did not come
UNRAISED = re.compile(r"\b(\w*(Error|Exception|Warning)) not (raised|triggered)\b|\bDID NOT (RAISE|WARN)\b")


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, stripped and cut at MAX_MESSAGE characters."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:MAX_MESSAGE]
    return ""


def normalise(message: str) -> str:
    """``message``'s first line with each number replaced by ``#`` (the key failures are grouped by)."""
    return _NUMBER.sub("#", first_line(message))


def function_of(nodeid: str) -> str:
    """The test function of a node id: ``file.py::Class::test_x[params]`` -> ``Class::test_x``."""
    return "::".join(nodeid.split("::")[1:]).split("[")[0] or nodeid


def message_of(report: Any) -> str:
    """The first line of a pytest report's error or skip reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return first_line(str(longrepr[2]).removeprefix("Skipped: ") or "skipped")
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return first_line(crash.message)
    return first_line(str(longrepr or ""))


class Results:
    def __init__(self) -> None:
        self.cases: dict[str, tuple[str, str]] = {}  # nodeid -> (outcome, message)
        self.functions: dict[str, str] = {}  # nodeid -> its test function, where the plugin named it

    def record(self, nodeid: str, outcome: str, message: str = "") -> None:
        """Set a case's outcome; a later failure or error replaces an earlier pass (a teardown's error)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        if nodeid in self.cases and self.cases[nodeid][0] in ("failed", "errored") and outcome == "passed":
            return
        if outcome in ("failed", "errored") and "PeerTimeout" in first_line(message):
            message = TIMEOUT
        self.cases[nodeid] = (outcome, message)

    def add(self, report: Any) -> None:
        """Take one of pytest's test reports (a phase of a case) or collection reports.

        A report whose ``user_properties`` hold ``("peer_function", name)`` (``peer_plugin`` adds it at
        collection; it travels with xdist's reports) counts under that function instead of ``function_of``'s.
        """
        for key, value in getattr(report, "user_properties", ()) or ():
            if key == "peer_function" and isinstance(value, str):
                self.functions[report.nodeid] = value
        when = getattr(report, "when", None)
        if when is None:  # a collection report
            if report.failed:
                self.record(report.nodeid or "<collection>", "errored", message_of(report))
            return
        if report.skipped:
            self.record(report.nodeid, "skipped", message_of(report))
        elif report.failed:
            self.record(report.nodeid, "failed" if when == "call" else "errored", message_of(report))
        elif when == "call":
            self.record(report.nodeid, "passed")

    def summary(self, **meta: Any) -> dict[str, Any]:
        """Totals, counts per function, and the failures and skips grouped by message."""
        totals = dict.fromkeys(OUTCOMES, 0)
        functions: dict[str, dict[str, int]] = {}
        groups: dict[str, dict[str, dict[str, Any]]] = {"failures": {}, "skips": {}}
        for nodeid, (outcome, message) in self.cases.items():
            function = self.functions.get(nodeid) or function_of(nodeid)
            totals[outcome] += 1
            functions.setdefault(function, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
            if outcome == "passed":
                continue
            kind = "skips" if outcome == "skipped" else "failures"
            key = normalise(message)
            group = groups[kind].setdefault(key, {"message": key, "example": first_line(message), "count": 0,
                                                  "functions": {}, "cases": []})
            group["count"] += 1
            group["functions"][function] = group["functions"].get(function, 0) + 1
            if len(group["cases"]) < EXAMPLE_CASES:
                group["cases"].append(nodeid)
        ordered = {kind: sorted(g.values(), key=lambda g: (-g["count"], g["message"])) for kind, g in groups.items()}
        cases = {nodeid: outcome for nodeid, (outcome, _) in self.cases.items()}
        timed_out = [nodeid for nodeid, (outcome, message) in self.cases.items()
                     if outcome != "passed" and message == TIMEOUT]
        unraised = [nodeid for nodeid, (outcome, message) in self.cases.items()
                    if outcome != "passed" and UNRAISED.search(first_line(message))]
        return {**meta, "totals": totals, "timed_out": len(timed_out), "functions": functions, **ordered,
                "cases": cases, "timed_out_cases": timed_out, "unraised_cases": unraised}


def markdown(summary: dict[str, Any]) -> str:
    """The summary as text: the counts per function, then each failure group and skip group."""
    lines = [f"# {summary.get('suite', 'peer suite')}", ""]
    for key in ("file", "peer_commit", "device", "selection"):
        if key in summary:
            lines.append(f"- {key}: {summary[key]}")
    lines += ["", "| function | " + " | ".join(OUTCOMES) + " |", "|---" * (len(OUTCOMES) + 1) + "|"]
    for function, counts in summary["functions"].items():
        lines.append(f"| {function} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    totals = summary["totals"]
    lines.append("| **total** | " + " | ".join(str(totals[o]) for o in OUTCOMES) + " |")
    if "timed_out" in summary:
        lines += ["", f"Timed out (among the failed and errored): {summary['timed_out']}"]
    for kind, title in (("failures", "Failures and errors by message"), ("skips", "Skips by reason")):
        lines += ["", f"## {title}", ""]
        if not summary[kind]:
            lines.append("(none)")
        for group in summary[kind]:
            where = ", ".join(f"{f} {n}" for f, n in group["functions"].items())
            lines.append(f"- **{group['count']}** `{group['example']}` ({where}); e.g. {group['cases'][0]}")
    return "\n".join(lines) + "\n"
