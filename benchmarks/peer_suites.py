"""Run a peer's own attention test suite (FlashAttention-3's and -2's, PyTorch's) against lazytriton, unchanged.

The peer's test file imports its library by name (``flash_attn_interface``, ``flash_attn``); the shims in
``tests/peers/shim/`` provide those names over lazytriton's public functions and come first on the path, the
peer's helpers (padding.py, test_util.py, flash_attn/bert_padding.py, ...) come from its checkout, and nothing is
copied into this repository. pytest runs the file with ``tests/peers/shim/peer_plugin.py``: a deterministic
sample of each test function's cases, a timeout per case, and a summary (per function: passed, failed, skipped,
errored; failures grouped by their first line, which names the features lazytriton lacks) written as JSON and
text to --out. ``census`` collects the file without running it and classifies each case by its parameters
(``tests/peers/shim/peer_census.py``: the peer's own skips, what lazytriton's API expresses, what it lacks).

PyTorch's ``test/test_transformers.py`` (``--suite torch``) calls torch's SDPA itself: the run loads
``tests/peers/shim_torch/torch_route.py``, which serves each call a fused backend may take with lazytriton's
drop-in and leaves the math backend's (the tests' references) to torch, and logs them; the run then classifies
each case by what it did (``route_census.py``: torch only, through lazytriton and expressible, or a gap) into
``peer_torch_census.json``/``.md`` beside the summary. Its checkout needs only that file
(``extract --paths test/test_transformers.py`` from a PyTorch git directory).

    python3 benchmarks/peer_suites.py extract --git-dir MIRROR.git --peer-dir .peers/flash-attention
    python3 benchmarks/peer_suites.py run --peer-dir .peers/flash-attention --suite fa3 --sample 0.01
    python3 benchmarks/peer_suites.py run --peer-dir .peers/flash-attention --suite fa2 --sample 0.002 --shard 1/3
    python3 benchmarks/peer_suites.py run --peer-dir .peers/flash-attention --device cpu --max-seqlen 128 \\
        --sample 0 --timeout 900 -- -k "test_flash_attn_output or test_flash_attn_combine"
    python3 benchmarks/peer_suites.py census --peer-dir .peers/flash-attention --suite fa2
    python3 benchmarks/peer_suites.py run --peer-dir .peers/pytorch --suite torch --max-seqlen 128 --timeout 90

Exit status: pytest's (0 when every selected case passed, 1 when any failed, 2 and up for a usage error).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIM = REPO / "tests" / "peers" / "shim"
# suite -> (its test file, the folders of the peer's checkout its helpers are imported from, the test functions
# it runs: all when empty). FlashAttention-3's kvcache tests are test_flash_attn.py's test_flash_attn_kvcache
# (hopper/test_kvcache.py is a benchmark script that parses its own command line on import, and
# hopper/test_attn_kvcache.py passes gqa_parallel= and descale_q=, which FlashAttention-3's interface no longer has).
# PyTorch's attention tests (test/test_transformers.py) call torch's own SDPA: ``tests/peers/shim_torch``'s
# plugin routes the calls a fused backend may serve to lazytriton's drop-in and logs them (TORCH_ROUTED).
SUITES = {
    "fa3": ("hopper/test_flash_attn.py", ("hopper",), ()),
    "fa3-kvcache": ("hopper/test_flash_attn.py", ("hopper",), ("test_flash_attn_kvcache",)),
    "fa2": ("tests/test_flash_attn.py", ("tests",), ()),
    "torch": ("test/test_transformers.py", ("test",), ()),
}
SHIM_TORCH = REPO / "tests" / "peers" / "shim_torch"
TORCH_ROUTED = {"torch"}  # the suites run with the router (-p torch_route)
# suite -> the suite of peer_census.RULES that classifies its cases (torch's: the run's route log instead)
CENSUS_RULES = {"fa3": "fa3", "fa3-kvcache": "fa3", "fa2": "fa2"}
# What `extract` takes from the peer's repository: the test files, their helpers, FlashAttention-2's package
# (bert_padding, layers/rotary and its Triton kernel, which the tests import beside the shims).
EXTRACTED = ("hopper", "tests", "flash_attn")
COMMIT_FILE = ".peer-commit"


def test_paths(suite: str, peer: Path) -> list[str]:
    """What pytest collects for ``suite``: its test file, or the node ids of its test functions in that file."""
    test_file, _, functions = SUITES[suite]
    return [f"{peer / test_file}::{name}" for name in functions] or [str(peer / test_file)]


def pytest_command(args: argparse.Namespace, peer: Path, summary: Path) -> list[str]:
    """The pytest command line of a run: the peer's file, the shim's config and plugin, the plugin's options."""
    test_file, _, _ = SUITES[args.suite]
    commit = (peer / COMMIT_FILE).read_text().strip() if (peer / COMMIT_FILE).is_file() else "unknown"
    command = [sys.executable, "-m", "pytest", *test_paths(args.suite, peer), "-c", str(SHIM / "pytest.ini"),
               "--rootdir", str((peer / test_file).parent), "-p", "peer_plugin", "-q", "-rN",
               "--peer-sample", str(args.sample), "--peer-every", str(args.every), "--peer-seed", str(args.seed),
               "--peer-min-per-function", str(args.min_per_function), "--peer-max-seqlen", str(args.max_seqlen),
               "--peer-timeout", str(args.timeout), "--peer-summary", str(summary),
               "--peer-deadline", str(time.time() + args.budget if args.budget > 0 else 0.0),
               "--peer-device", "native" if args.suite in TORCH_ROUTED else args.device,
               "--peer-shard", args.shard, "--peer-meta", f"suite={args.suite}", "--peer-meta", f"file={test_file}",
               "--peer-meta", f"peer_commit={commit}", "--peer-meta", f"shard={args.shard}"]
    if args.suite in TORCH_ROUTED:
        command += ["-p", "torch_route", "--torch-route-log", str(route_log(summary)),
                    "--torch-route-to", "torch" if args.torch_baseline else "lazytriton",
                    "--peer-meta", f"route_to={'torch' if args.torch_baseline else 'lazytriton'}"]
    return command + list(args.pytest_args)


def route_log(summary: Path) -> Path:
    """The routed-calls log beside a run's summary (``peer_torch.json`` -> ``peer_torch_routes.jsonl``)."""
    return summary.with_name(summary.stem + "_routes.jsonl")


def environment(args: argparse.Namespace, peer: Path) -> dict[str, str]:
    """The run's environment: the shim first on PYTHONPATH, then the peer's helper folders."""
    _, folders, _ = SUITES[args.suite]
    path = [*([str(SHIM_TORCH)] if args.suite in TORCH_ROUTED else []), str(SHIM),
            *(str(peer / folder) for folder in folders)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["LAZYTRITON_PEER_DIR"] = str(peer)
    return env


def run(args: argparse.Namespace) -> int:
    peer = Path(args.peer_dir).resolve()
    test_file, _, _ = SUITES[args.suite]
    if not (peer / test_file).is_file():
        raise SystemExit(f"--peer-dir {args.peer_dir}: no {test_file} there (extract the peer first: "
                         f"{Path(__file__).name} extract --git-dir ... --peer-dir {args.peer_dir})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shard, shards = parse_shard(args.shard)
    summary = out / (f"peer_{args.suite}.json" if shards == 1 else f"peer_{args.suite}_shard{shard}of{shards}.json")
    command = pytest_command(args, peer, summary)
    print("+", " ".join(command), flush=True)
    # The shim's folder as the working directory: `python -m` puts it first on sys.path, where the peer's own
    # flash_attn_interface.py (in its hopper/ folder) would otherwise be found before the shim.
    log = route_log(summary)
    log.unlink(missing_ok=True)
    done = subprocess.run(command, cwd=SHIM, env=environment(args, peer), check=False)
    print(f"summary: {summary} and {summary.with_suffix('.md')}")
    if args.suite in TORCH_ROUTED and summary.is_file():
        sys.path.insert(0, str(SHIM_TORCH))
        import route_census

        routes = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
        baseline = json.loads(Path(args.baseline).read_text())["cases"] if args.baseline else None
        result = json.loads(summary.read_text())
        census = route_census.routed(result["cases"], routes, baseline, result.get("timed_out_cases", ()),
                                     result.get("unraised_cases", ()))
        summary.with_name(summary.stem + "_census.json").write_text(json.dumps(census, indent=1) + "\n")
        text = route_census.routed_markdown(census)
        summary.with_name(summary.stem + "_census.md").write_text(text)
        print(text, end="")
    return done.returncode


def collect(args: argparse.Namespace, peer: Path, cases: Path) -> None:
    """Collect the suite's cases into ``cases`` (JSON lines), importing the test file as a CPU run would."""
    test_file, _, _ = SUITES[args.suite]
    command = [sys.executable, "-m", "pytest", *test_paths(args.suite, peer), "-c", str(SHIM / "pytest.ini"),
               "--rootdir", str((peer / test_file).parent), "-p", "peer_plugin", "-q", "--collect-only",
               "--peer-device", "cpu", "--peer-collect", str(cases)]
    done = subprocess.run(command, cwd=SHIM, env=environment(args, peer), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0 or not cases.is_file():
        raise SystemExit(f"collecting {test_file} failed (exit {done.returncode}):\n{done.stdout[-4000:]}"
                         f"{done.stderr[-4000:]}")


def census(args: argparse.Namespace) -> int:
    """Classify every collected case of the suite (or of --cases, a file ``--peer-collect`` wrote)."""
    sys.path.insert(0, str(SHIM))
    import peer_census

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = Path(args.cases) if args.cases else out / f"cases_{args.suite}.jsonl"
    if args.suite not in CENSUS_RULES:
        raise SystemExit(f"--suite {args.suite}: no census of its collected cases; `run` classifies them by the "
                         "calls each makes (its _census.md)")
    if not args.cases:
        peer = Path(args.peer_dir or "").resolve()
        if not args.peer_dir or not (peer / SUITES[args.suite][0]).is_file():
            raise SystemExit(f"--peer-dir {args.peer_dir}: no {SUITES[args.suite][0]} there (or pass --cases)")
        collect(args, peer, cases)
    with cases.open() as f:
        result = peer_census.census(CENSUS_RULES[args.suite], (json.loads(line) for line in f if line.strip()))
    result["suite"] = args.suite
    (out / f"census_{args.suite}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = peer_census.markdown(result)
    (out / f"census_{args.suite}.md").write_text(text)
    print(text, end="")
    return 0


def extract(args: argparse.Namespace) -> int:
    """Write the peer's files at --rev of a git directory (a bare mirror) into --peer-dir, with its commit."""
    peer = Path(args.peer_dir)
    peer.mkdir(parents=True, exist_ok=True)
    git = ["git", "--git-dir", args.git_dir]
    commit = subprocess.run([*git, "rev-parse", args.rev], capture_output=True, text=True, check=True).stdout.strip()
    paths = args.paths.split(",") if args.paths else list(EXTRACTED)
    archive = subprocess.run([*git, "archive", commit, *paths], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(peer)], input=archive, check=True)
    (peer / COMMIT_FILE).write_text(commit + "\n")
    print(f"{peer}: {', '.join(paths)} at {commit}")
    return 0


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard K/N`` as (K, N), by the plugin's own rule (``peer_select.parse_shard``, in the shim's folder)."""
    if str(SHIM) not in sys.path:
        sys.path.insert(0, str(SHIM))
    import peer_select

    return peer_select.parse_shard(text)


def _shard(text: str) -> str:
    try:
        parse_shard(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--shard: {exc}") from None
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a peer's test file against lazytriton")
    r.add_argument("--peer-dir", required=True, help="the peer's checkout (e.g. .peers/flash-attention)")
    r.add_argument("--suite", choices=sorted(SUITES), default="fa3")
    r.add_argument("--sample", type=float, default=0.01, help="fraction of each test function's cases (0..1)")
    r.add_argument("--every", type=int, default=0, help="keep every Nth case of each function instead")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--min-per-function", type=int, default=1)
    r.add_argument("--max-seqlen", type=int, default=0, help="drop cases with a seqlen* parameter over this (0: none)")
    r.add_argument("--shard", type=_shard, default="0/1",
                   help="K/N: shard K of N of the sampled cases (N runs with K = 0..N-1 run each case once)")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds per phase of a case (0: none)")
    r.add_argument("--budget", type=float, default=0.0,
                   help="seconds for the whole run (0: none): the cases not started by then are skipped as not "
                        "run, and the summary is still written (a GPU call's time limit)")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the peer's device='cuda' tensors on CPU, kernels through Triton's interpreter "
                        "(not --suite torch, whose tests choose their devices)")
    r.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="folder of the summary (default $OUT)")
    r.add_argument("--torch-baseline", action="store_true",
                   help="--suite torch: every SDPA call to torch's own function (what the file does without "
                        "lazytriton against the installed torch)")
    r.add_argument("--baseline", help="--suite torch: a --torch-baseline run's summary; its failures are not "
                                      "counted against lazytriton in the census")
    r.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (-k, -x, -n 4, ...)")
    r.set_defaults(func=run)
    c = sub.add_parser("census", help="classify a peer's collected cases: expressible with lazytriton's API or not")
    c.add_argument("--peer-dir", help="the peer's checkout (its test file is collected, not run)")
    c.add_argument("--suite", choices=sorted(SUITES), default="fa3")
    c.add_argument("--cases", help="the cases as run's --peer-collect wrote them, instead of collecting")
    c.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"), help="folder of census_<suite>.json/.md")
    c.set_defaults(func=census)
    e = sub.add_parser("extract", help="write a peer's test files from a git directory into --peer-dir")
    e.add_argument("--git-dir", required=True, help="the peer's git directory (a bare mirror works)")
    e.add_argument("--peer-dir", required=True)
    e.add_argument("--rev", default="HEAD")
    e.add_argument("--paths", default="", help="comma-separated paths to take (default: FlashAttention's "
                   + ",".join(EXTRACTED) + "; PyTorch's: test/test_transformers.py)")
    e.set_defaults(func=extract)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
