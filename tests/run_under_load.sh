#!/usr/bin/env bash
# The README's test command N times in a row beside K CPU-burning processes (the suite must stay green on a
# loaded machine). Prints one line a run and exits non-zero if any run failed.
# Usage: tests/run_under_load.sh [N] [K] [PYTEST_ARGS...]
# PYTEST_ARGS replace the README's `-n auto` (e.g. `-n 2 tests/test_capi.py`); PYTHON names the interpreter.
# Each run's log is kept in a directory of this call's own (its path is printed first).
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}; burners=${2:-4}; shift $(( $# < 2 ? $# : 2 ))
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(-n auto)
python=${PYTHON:-python3}; failed=0
logs=$(mktemp -d /tmp/lazytriton-load.XXXXXX); echo "logs in $logs"
pids=()
for _ in $(seq "$burners"); do python3 -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null' EXIT
for run in $(seq "$runs"); do
  start=$(date +%s)
  if "$python" -m pytest -q "${args[@]}" > "$logs/run-$run.log" 2>&1; then status=passed
  else status=FAILED; failed=$((failed + 1)); fi
  echo "run $run: $status in $(( $(date +%s) - start )) s; $(grep -E '[0-9]+ (passed|failed)' "$logs/run-$run.log" | tail -1)"
done
echo "$failed of $runs runs failed beside $burners CPU burners"
exit "$failed"
