"""Several nodes sharing one Redis: every kernel is compiled once for the whole cluster.

    python examples/cluster/run_cluster.py [--nodes 4] [--phase jit|shard|both] [--kernel flash_fwd]
                                           [--redis redis://host:port/db] [--keep]

Starts a redis-server on a free loopback port (unless ``--redis`` names one),
then runs the nodes (processes, each with its own local cache dir) on the
plan of ``lazytriton prewarm PLAN --list``: every kernel family's sm_90
variants for fp16, head dim 64, causal or not (``--kernel`` narrows it to
some families or kernels, e.g. ``--kernel flash_fwd`` for a quick try):

- ``jit``: every node resolves every variant at once, in its own order. The
  compile leases make the cluster compile each key once: the node holding a
  key's lease compiles and publishes it, the others take it from Redis.
- ``shard``: node I runs ``lazytriton prewarm PLAN --shard I/N`` and
  publishes its shard's entries into Redis; then fresh nodes with
  ``LAZYTRITON_JIT=0`` resolve everything from Redis, compiling nothing.

Entries are signed with a key made for the run (``LAZYTRITON_SIGNING_KEY``).
Everything lives in one work dir (``$TMPDIR/lazytriton-cluster-*``: the
nodes' caches, the shard images, Redis's folder), removed at the end, also
after an error or Ctrl-C; ``--keep`` leaves it for a look.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PLAN = ["--target", "sm_90", "--dtype", "fp16", "--head-dim", "64", "--causal", "none,top_left"]


def plan_args(kernels: str | None = None) -> list[str]:
    """The prewarm flags of the example's plan: ``PLAN``, narrowed to ``kernels`` (prewarm's --kernel) if given."""
    return [*PLAN, "--kernel", kernels] if kernels else list(PLAN)


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server is not installed (Debian: apt-get install redis-server), or pass --redis URL")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(500):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.02)
    process.kill()
    raise SystemExit("redis-server did not start")


def plan(workdir: Path, flags: list[str]) -> Path:
    """The variants of ``lazytriton prewarm FLAGS --list``, one per line, in a file."""
    listing = subprocess.run([sys.executable, "-m", "lazytriton.cli", "prewarm", *flags, "--list"], check=True,
                             capture_output=True, text=True).stdout
    variants = [line.split()[-1] for line in listing.splitlines() if line.count(":") >= 5]
    path = workdir / "variants.txt"
    path.write_text("\n".join(variants) + "\n")
    return path


def run_nodes(commands: list[list[str]], envs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Start all node processes at once; the last JSON line each prints (every node has ended on return)."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs, strict=True)]
    try:
        outputs = [proc.communicate() for proc in procs]
    finally:  # interrupted: no node goes on writing into the work dir that is about to be removed
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"a node failed:\n{err[-3000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def node_env(cache_dir: Path, shared: str, key: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAZYTRITON_")}
    env.update(LAZYTRITON_CACHE_DIR=str(cache_dir), LAZYTRITON_SHARED=shared, LAZYTRITON_SIGNING_KEY=key,
               LAZYTRITON_SHARED_TIMEOUT_MS="1000", **extra)  # a 2-core laptop running N nodes and Redis at once
    return env


def print_table(title: str, results: list[dict[str, Any]], keys: int) -> None:
    print(f"\n{title}")
    print(f"{'node':<6}{'compiles':>9}  {'served from':<32}{'seconds':>8}")
    for i, result in enumerate(results, 1):
        sources = ", ".join(f"{s} {n}" for s, n in result["sources"].items())
        print(f"{i:<6}{result['compiles']:>9}  {sources:<32}{result['seconds']:>8}")
    total = sum(r["compiles"] for r in results)
    verdict = "as expected" if total == keys else f"expected {keys}"
    print(f"total compiles: {total} on {len(results)} nodes ({verdict})")


def phase_jit(workdir: Path, url: str, variants: Path, nodes: int, key: str) -> None:
    shared = f"{url}?prefix=example-jit"
    envs = [node_env(workdir / "jit" / f"node{i}", shared, key) for i in range(1, nodes + 1)]
    results = run_nodes([[sys.executable, str(HERE / "node.py"), "resolve", str(variants)]] * nodes, envs)
    keys = len(variants.read_text().split())
    print_table(f"JIT: all nodes resolve every variant at once (once per key: {keys} compiles)", results, keys)


def phase_shard(workdir: Path, url: str, variants: Path, nodes: int, key: str, flags: list[str]) -> None:
    shared = f"{url}?prefix=example-shard"
    builds = []
    for i in range(1, nodes + 1):
        image = workdir / "shard" / f"part{i}.ltimg"
        image.parent.mkdir(parents=True, exist_ok=True)
        builds.append(["sh", "-c", f'"{sys.executable}" -m lazytriton.cli prewarm {" ".join(flags)} -j 1 '
                       f'--shard {i}/{nodes} --out "{image}" >/dev/null && '
                       f'"{sys.executable}" "{HERE / "node.py"}" publish "{image}"'])
    envs = [node_env(workdir / "shard" / f"builder{i}", shared, key) for i in range(1, nodes + 1)]
    published = run_nodes(builds, envs)
    print(f"\nprewarm --shard I/{nodes} on each node, then published to Redis: "
          f"{[r['published'] for r in published]} entries")
    envs = [node_env(workdir / "shard" / f"node{i}", shared, key, LAZYTRITON_JIT="0") for i in range(1, nodes + 1)]
    results = run_nodes([[sys.executable, str(HERE / "node.py"), "resolve", str(variants)]] * nodes, envs)
    print_table("fresh nodes, LAZYTRITON_JIT=0: everything from the shards in Redis", results, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--phase", choices=("jit", "shard", "both"), default="both")
    parser.add_argument("--kernel", help="prewarm's --kernel: the kernel families or kernels of the plan "
                                         "(default: every family; flash_fwd for a quick try)")
    parser.add_argument("--redis", help="use this Redis (redis://host:port/db) instead of starting one")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (caches, images) instead of removing it")
    args = parser.parse_args(argv)
    flags = plan_args(args.kernel)
    workdir = Path(tempfile.mkdtemp(prefix="lazytriton-cluster-"))
    server = None
    try:
        if args.redis:
            url = args.redis
        else:
            server, url = start_redis(workdir)
        key = secrets.token_hex(16)
        variants = plan(workdir, flags)
        print(f"Redis {url}; {args.nodes} nodes; {len(variants.read_text().split())} variants; work dir {workdir}",
              flush=True)
        if args.phase in ("jit", "both"):
            phase_jit(workdir, url, variants, args.nodes, key)
        if args.phase in ("shard", "both"):
            phase_shard(workdir, url, variants, args.nodes, key, flags)
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait()
        if args.keep:
            print(f"work dir kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
