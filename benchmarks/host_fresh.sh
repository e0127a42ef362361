#!/usr/bin/env bash
# The fast launch path with no extra step: a fresh cache dir, then benchmarks/bench_host.py --no-build twice (GPU).
# The first process finds no compiled helper (cffi ABI mode); its first GPU use starts their build into the cache
# dir in the background. The script waits for that build (python -m lazytriton.driver.helpers_build wait), then
# the second process loads the helpers from the cache dir. Printed per process: the launch path it used and
# attn_fwd's host time against torch.add's (the target: at most 1.2x); logs in $OUT (default /tmp/out).
#
# Usage, from the repository root on the GPU host:
#   bash benchmarks/host_fresh.sh [--remove-package-helpers] [bench_host.py arguments...]
# A helper built into the package folder (python -m lazytriton.driver.fastlaunch_build / hotpath_build) takes
# precedence over the cache dir's, so the script stops when one is there; --remove-package-helpers deletes those
# build outputs (lazytriton/driver/_fastlaunch*.so, kernels/flash_fwd/_hotpath*.so) first.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then  # the GPU host: the wheels it lacks travel in .whl, installed as benchmarks/gpu_round.sh does
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
fi
remove=0
if [ "${1:-}" = --remove-package-helpers ]; then remove=1; shift; fi
packaged=$(ls lazytriton/driver/_fastlaunch*.so kernels/flash_fwd/_hotpath*.so 2>/dev/null)
if [ -n "$packaged" ]; then
  if [ $remove = 0 ]; then
    echo "package-folder helpers present (they take precedence; not a fresh install): $packaged" >&2
    echo "run again with --remove-package-helpers to delete them" >&2
    exit 2
  fi
  echo "removing the package-folder helpers: $packaged"
  rm -f $packaged
fi
export LAZYTRITON_CACHE_DIR; LAZYTRITON_CACHE_DIR="$(mktemp -d /tmp/lt-fresh.XXXXXX)/cache"
export PYTHONUNBUFFERED=1
echo "fresh cache dir: $LAZYTRITON_CACHE_DIR"
for run in 1 2; do
  echo "== process $run"
  python3 benchmarks/bench_host.py --no-build --no-jit --csv "$OUT/host_fresh.csv" "$@" > "$OUT/host_fresh_$run.log" 2>&1
  status=$?
  grep -E "^launch helper:|^C\+\+ tail:|helper now:|^this process:" "$OUT/host_fresh_$run.log"
  if [ $status != 0 ]; then tail -25 "$OUT/host_fresh_$run.log"; exit 1; fi
  if [ $run = 1 ]; then
    echo "== waiting for the background builds"
    python3 -m lazytriton.driver.helpers_build wait --timeout 900
    for log in "$LAZYTRITON_CACHE_DIR"/helpers/*/build.log; do echo "-- $log"; tail -3 "$log"; done
  fi
done
python3 -m lazytriton.cli info | grep -E -A2 "^launch"
