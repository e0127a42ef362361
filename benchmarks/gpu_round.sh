#!/usr/bin/env bash
# One round of GPU work (see README, "GPU"): install, GPU tests, demo twice,
# cold-start profile, C API (capi), benchmark. Logs go to $OUT; the table comes last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "editable install failed"
export LAZYTRITON_CACHE_DIR=${LAZYTRITON_CACHE_DIR:-/tmp/lt-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
case " $* " in *" coldstart "*)  # new process -> first result from an image, beside Triton's JIT and warm cache
  # As deployed: a regular (not editable) install with its .pyc files, run away from the checkout.
  repo=$PWD; python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/lt-installed . >/dev/null
  (cd /tmp && PYTHONPATH=/tmp/lt-installed:/tmp/site python3 "$repo/benchmarks/bench_prewarm.py" --cold-start \
    ${COLDSTART_IMAGE:+--image "$repo/$COLDSTART_IMAGE"} --reps ${COLDSTART_REPS:-5} --csv "$OUT/prewarm.csv") 2>&1 \
    | tee "$OUT/coldstart.log" | tail -12
  (cd /tmp && PYTHONPATH=/tmp/lt-installed:/tmp/site python3 -X importtime -c "import torch; import lazytriton.flash" \
    2> "$OUT/importtime.log") ;;
esac
case " $* " in *" tune "*)  # fills kernels/flash_fwd/tuning.csv here; copy it back from $OUT
  timeout ${TUNE_TIMEOUT:-900} lazytriton tune -j "$(nproc)" 2>&1 | tee "$OUT/tune.log" | tail -45; cp kernels/flash_fwd/tuning.csv "$OUT/tuning.csv" ;;
esac
case " $* " in *" hot "*)
  python3 -P benchmarks/profile_hot.py 2>&1 | tee "$OUT/hot.log" ;;
esac
case " $* " in *" tests "*)
  python3 -P -m pytest tests -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
esac
case " $* " in *" demo "*)
  lazytriton demo > "$OUT/demo1.log" 2>&1; lazytriton demo > "$OUT/demo2.log" 2>&1
  tail -4 "$OUT/demo1.log"; tail -7 "$OUT/demo2.log"
  if [ -d .gpu-cache ]; then  # entries compiled on a CPU machine (another Triton): served with 0 compiles?
    cp -r .gpu-cache /tmp/carried-cache; LAZYTRITON_CACHE_DIR=/tmp/carried-cache lazytriton demo 2>&1 | tee "$OUT/demo_carried.log"
  fi
  python3 benchmarks/profile_cold.py > /dev/null 2>&1  # fills the cache for its shape
  python3 benchmarks/profile_cold.py > "$OUT/profile_cold.log" 2>&1; head -30 "$OUT/profile_cold.log" ;;
esac
case " $* " in *" capi "*)  # the C API: GPU tests (device memory, plans), then host time per call
  python3 -P -m pytest tests/test_capi.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/capi_tests.log" | tail -5
  python3 benchmarks/bench_capi.py --csv "$OUT/capi.csv" 2>&1 | tee "$OUT/bench_capi.log" | tail -8 ;;
esac
case " $* " in *" bench "*)
  python3 benchmarks/bench_flash_fwd.py --csv "$OUT/flash_fwd.csv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
esac
