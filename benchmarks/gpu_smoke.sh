#!/usr/bin/env bash
# Smallest GPU check: install, then `lazytriton demo` twice (cold, then warm from the cache).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -2
export LAZYTRITON_CACHE_DIR=/tmp/lt-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
lazytriton info
lazytriton demo 2>&1 | tee $OUT/demo1.log
lazytriton demo 2>&1 | tee $OUT/demo2.log
