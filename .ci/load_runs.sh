#!/usr/bin/env bash
# The timing-sensitive test files under load, as CI's loaded 2-core machine may run them: ROUNDS rounds
# (default 5), each with BURNERS busy-looping processes (default 4) beside pytest at -n 2. Prints each
# round's summary line and the names of any failed tests. Usage: .ci/load_runs.sh [ROUNDS] [BURNERS]
set -uo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}; burners=${2:-4}
files="tests/test_prewarm.py tests/test_prewarm_scaling.py tests/test_prewarm_limits.py tests/test_prewarm_fork.py
       tests/test_faults.py tests/test_timing.py tests/test_bench_flash_fwd.py tests/test_bench_flash_bwd.py
       tests/test_helpers_lazy.py tests/test_trust_storage.py tests/test_shared_dir.py tests/test_redis_tier.py
       tests/test_cold_start.py"
[ -n "${LOAD_FILES:-}" ] && files=$LOAD_FILES  # a subset: LOAD_FILES="tests/a.py tests/b.py"
for round in $(seq "$rounds"); do
  pids=""
  for _ in $(seq "$burners"); do python3 -c "while True: pass" & pids="$pids $!"; done
  # shellcheck disable=SC2086
  timeout 900 python3 -m pytest -q -p no:cacheprovider -n 2 $files 2>&1 | grep -E "^FAILED|^ERROR|^[0-9]+ (passed|failed)" \
    | sed "s/^/round $round: /"
  # shellcheck disable=SC2086
  kill $pids 2>/dev/null; wait $pids 2>/dev/null
done
