#!/usr/bin/env bash
# The README's test command N times in a row beside K CPU-burning processes
# (issue 13: the suite must stay green on a loaded machine). Prints one line a
# run and exits non-zero if any run failed. Usage: tests/run_under_load.sh [N] [K]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}; burners=${2:-4}; failed=0
pids=()
for _ in $(seq "$burners"); do python3 -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
for run in $(seq "$runs"); do
  start=$(date +%s)
  if python3 -m pytest -n auto -q > "/tmp/lazytriton-load-run-$run.log" 2>&1; then status=passed
  else status=FAILED; failed=$((failed + 1)); fi
  echo "run $run: $status in $(( $(date +%s) - start )) s; $(grep -E '[0-9]+ (passed|failed)' "/tmp/lazytriton-load-run-$run.log" | tail -1)"
done
echo "$failed of $runs runs failed beside $burners CPU burners"
exit "$failed"
