#!/usr/bin/env bash
# One round of GPU work (benchmarks/README.md): install, then the steps named as arguments: GPU tests (tests), demo
# twice (demo), cold start (coldstart), a fresh install's launch path (hostfresh), cache verify of every family's
# image (verifyimages), the multi-GPU tests (devices), the GPU tests no GPU has run yet (newtests), those of paths a change touched (regressions), C API (capi),
# benchmarks (bench, bwd, grids, decode, decodecpp, fusedcombine, fp8, fp8gluon, fp8pairs, serving, features, native, appended, debugsections, ...),
# transformers, and the probes' steps below (the probes live in experiments/, experiments/README.md).
# Logs go to $OUT; the table comes last.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# Not the checkout's root: its kernels/ folder would shadow Hugging Face's kernels package (transformers imports it).
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "editable install failed"; exit 1; }
export LAZYTRITON_CACHE_DIR=${LAZYTRITON_CACHE_DIR:-/tmp/lt-cache}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
# A regular install in /tmp/lt-installed (as deployed: its .pyc files, away from the checkout) with its code pack
# (lazytriton/codepack.py), as `lazytriton prewarm --helpers` builds one into a deployment image.
install_regular() {
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/lt-installed . >/dev/null
  (cd /tmp && PYTHONPATH=/tmp/lt-installed python3 -c "import sys; from lazytriton import codepack_build
sys.exit(codepack_build.main([]))") || echo "no code pack in /tmp/lt-installed"
}
case " $* " in *" coldstart "*)  # fresh process -> first result from an image: one kernel (target 10 ms after torch's
  # CUDA init) and a model's forward + backward working set (8 variants, 25 ms), beside Triton's JIT; medians of
  # COLDSTART_REPS processes (JIT rows: COLDSTART_JIT_REPS). The bench builds its image from the scenarios' own
  # misses unless COLDSTART_IMAGE (a path in the tree) names one holding them.
  # As deployed: a regular (not editable) install with its .pyc files, run away from the checkout.
  repo=$PWD; install_regular
  cold_image=/tmp/lt-cold.ltimg; rm -f $cold_image
  # The bench's children without the compiled helpers (each has a fresh cache dir: none builds any); the profiles
  # after it with every compiled helper built into the installed package, as a deployment image has them.
  (cd /tmp && export PYTHONPATH=/tmp/lt-installed:/tmp/site
   LAZYTRITON_HELPERS=0 python3 "$repo/benchmarks/bench_prewarm.py" --cold-start ${COLDSTART_IMAGE:+--image $repo/$COLDSTART_IMAGE} \
     --keep-image $cold_image --reps ${COLDSTART_REPS:-5} --jit-reps ${COLDSTART_JIT_REPS:-3} --csv "$OUT/prewarm.csv" \
     2>&1 | tee "$OUT/coldstart.log" | tail -19
   python3 -X importtime -c "import torch; import lazytriton.flash" 2> "$OUT/importtime.log"
   # every compiled helper (a missing one is built in the background from the first GPU use, in the first call)
   python3 -m lazytriton.driver.fastlaunch_build >/dev/null 2>&1 && python3 -m lazytriton.kernels.flash_fwd.hotpath_build \
     >/dev/null 2>&1 && python3 -m lazytriton.kernels.flash_decode.hotpath_build >/dev/null 2>&1 \
     || echo "helpers not built into /tmp/lt-installed"
   export LAZYTRITON_IMAGES=$cold_image LAZYTRITON_JIT=0
   for run in 1 2 3; do for set in "" --working-set; do for pack in 1 0; do echo "code pack $pack:" >> "$OUT/profile_cold.log"
     LAZYTRITON_CODEPACK=$pack LAZYTRITON_CACHE_DIR=/tmp/lt-cold-cache-$run$set$pack python3 \
     "$repo/benchmarks/profile_cold.py" $set 2>&1 | tee -a "$OUT/profile_cold.log" | grep -m1 "init" | sed "s/^/pack $pack: /"
   done; done; done
   # --split: lazytriton's parts of the first call or step (bindings, plans, reads, module loads) against torch's rest
   for run in 1 2 3; do for set in "" --working-set; do LAZYTRITON_CACHE_DIR=/tmp/lt-cold-cache-s$run$set \
     python3 "$repo/benchmarks/profile_cold.py" $set --split 2>&1 | tee -a "$OUT/profile_cold.log" | tail -1; done; done
   for set in "" --working-set; do LAZYTRITON_CACHE_DIR=/tmp/lt-cold-cache-p$set python3 "$repo/benchmarks/profile_cold.py" \
     $set --profile --sort cumtime --top 60 --modules >> "$OUT/profile_cold.log" 2>&1; done) ;;
esac
case " $* " in *" coldsteps "*)  # one kernel's first call from an image, its driver load step by step (profile_cold.py
  # --split --steps), as deployed (a regular install with its code pack, run away from the checkout): 3 fresh
  # processes without the compiled helpers, then 3 with both built into the installed package, with and without the
  # code pack (LAZYTRITON_CODEPACK=0)
  repo=$PWD; install_regular
  (cd /tmp && export PYTHONPATH=/tmp/lt-installed:/tmp/site
   python3 -m lazytriton prewarm --target sm_90 --kernel flash_fwd --dtype bf16 --head-dim 128 --causal top_left \
     --seqlen-q 2048 --out /tmp/lt-steps.ltimg -j 8 2>&1 | tail -1
   export LAZYTRITON_IMAGES=/tmp/lt-steps.ltimg LAZYTRITON_JIT=0
   for run in 1 2 3; do LAZYTRITON_HELPERS=0 LAZYTRITON_CACHE_DIR=/tmp/lt-steps-off-$run python3 \
     "$repo/benchmarks/profile_cold.py" --split --steps 2>&1 | sed 's/^/helpers off: /' | tee -a "$OUT/coldsteps.log"; done
   python3 -m lazytriton.driver.fastlaunch_build >/dev/null 2>&1 && python3 -m lazytriton.kernels.flash_fwd.hotpath_build \
     >/dev/null 2>&1 && python3 -m lazytriton.kernels.flash_decode.hotpath_build >/dev/null 2>&1 \
     || echo "helpers not built into /tmp/lt-installed"
   for run in 1 2 3; do for pack in 1 0; do LAZYTRITON_CODEPACK=$pack LAZYTRITON_CACHE_DIR=/tmp/lt-steps-on-$run$pack \
     python3 "$repo/benchmarks/profile_cold.py" --split --steps 2>&1 | sed "s/^/helpers in the package, code pack $pack: /" \
     | tee -a "$OUT/coldsteps.log"; done; done) | grep -E "split|first call|driver"
esac
case " $* " in *" decodetiles "*)  # the decoding table's rows against candidate rows (DECODE_TILE_ROWS: CSV rows of a
  # user table, kernels/flash_decode/tuning.csv's columns), bench_decode.py on the same cases with each, in turns
  rows_dir=/tmp/lt-tiles-candidate/tuning; mkdir -p $rows_dir
  { head -1 kernels/flash_decode/tuning.csv; printf '%s\n' ${DECODE_TILE_ROWS:-}; } > $rows_dir/flash_decode.csv
  for turn in $(seq ${DECODETILES_TURNS:-1}); do for table in shipped candidate; do
    LAZYTRITON_CACHE_DIR=/tmp/lt-tiles-$table timeout ${DECODETILES_TIMEOUT:-200} python3 benchmarks/bench_decode.py \
      --csv "$OUT/decode_tiles_$table.csv" ${DECODETILES_ARGS:-} 2>&1 | tee "$OUT/decode_tiles_${table}_$turn.log" \
      | tail -${DECODETILES_TAIL:-24} | sed "s/^/$table $turn: /"
  done; done ;;
esac
case " $* " in *" fp8pairs "*)  # a float8 cache's split tiles by (sequence, key/value head) pairs: the GPU tests of
  # the float8 cache (Python, the C API's plans, the native core), then the probe's served tile beside the forced
  # candidates at batches 1-32 (contiguous, then pages of 256 keys), then bench_decode's float8 rows beside bf16
  timeout ${FP8PAIRS_TESTS_TIMEOUT:-300} python3 -P -m pytest -m gpu -q -p no:cacheprovider tests/test_fp8_kvcache.py \
    tests/test_capi_fp8.py tests/test_native_decode.py 2>&1 | tee "$OUT/fp8pairs_tests.log" | tail -4
  for layout in contiguous paged; do
    candidates=64x4x3,128x4x3; flag=; [ $layout = paged ] && candidates=64x4x5,128x4x5 flag=--paged
    timeout ${FP8PAIRS_PROBE_TIMEOUT:-150} python3 experiments/probe_decode_fp8_tiles.py $flag --batches 1,2,4,8,16,32 \
      --lengths 4096,16384,32768 --candidates $candidates 2>&1 | tee "$OUT/fp8pairs_probe_$layout.log" | tail -20 \
      | sed "s/^/$layout: /"
  done
  timeout ${FP8PAIRS_BENCH_TIMEOUT:-200} python3 benchmarks/bench_decode.py --kv-dtype e4m3 --batches 1,8,32 \
    --lengths 4k,16k,32k --csv "$OUT/decode_fp8.csv" 2>&1 | tee "$OUT/bench_decode_fp8.log" | tail -22 ;;
esac
case " $* " in *" hostfresh "*)  # a fresh install as the README leaves it: bench_host --no-build twice, the helpers
  # built in the background by the first process's first GPU use (before any step here builds them into the package)
  OUT="$OUT" bash benchmarks/host_fresh.sh --remove-package-helpers 2>&1 | tee "$OUT/host_fresh.log" | tail -14 ;;
esac
case " $* " in *" verifyimages "*)  # every family for every target, built by this host's Triton, passes cache verify
  timeout ${VERIFY_TIMEOUT:-300} python3 -P -m pytest tests/test_verify_images.py -q -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/verify_images.log" | tail -4 ;;
esac
case " $* " in *" devices "*)  # every GPU of the host: the multi-GPU tests (their one-device part on one GPU)
  timeout ${DEVICES_TIMEOUT:-300} python3 -P -m pytest tests/test_multi_gpu.py tests/test_devices.py -m gpu -q \
    -p no:cacheprovider -rs 2>&1 | tee "$OUT/devices.log" | tail -8 ;;
esac
case " $* " in *" tune "*)  # fills kernels/flash_fwd/tuning.csv here; copy it back from $OUT
  timeout ${TUNE_TIMEOUT:-900} lazytriton tune -j "$(nproc)" 2>&1 | tee "$OUT/tune.log" | tail -45; cp kernels/flash_fwd/tuning.csv "$OUT/tuning.csv" ;;
esac
case " $* " in *" hot "*)
  python3 -P benchmarks/profile_hot.py 2>&1 | tee "$OUT/hot.log" ;;
esac
case " $* " in *" tests "*)
  python3 -m lazytriton.driver.fastlaunch_build >/dev/null && python3 -m lazytriton.kernels.flash_fwd.hotpath_build \
    && python3 -m lazytriton.kernels.flash_decode.hotpath_build || true
  # pytest-xdist travels in .whl (wheels.sh .whl pytest-xdist execnet zstandard; images need zstandard, which
  # the host lacks): 4 processes share the GPU and the cache.
  # -v: each test's outcome lands in the log as it finishes, so a run cut by its time limit still names its failures
  # GPU_TESTS: a part of the suite (files or node ids) where one call's limit cannot hold it all; GPU_TESTS_PART=a
  # (the forward and backward kernels' files, ~250 s on an H100 with 6 processes) or b (the rest, ~470 s)
  part_a="tests/test_flash_fwd.py tests/test_gluon_bwd.py tests/test_fused_bwd.py tests/test_fp8_gluon.py
    tests/test_flash_bwd.py tests/test_gluon_fwd_hd256.py tests/test_gluon_fwd.py tests/test_bwd_split.py
    tests/test_fp8_fwd.py tests/test_sdpa_mask_grad.py tests/test_gluon_fwd_split.py tests/test_gluon_fwd_wide.py
    tests/test_hot.py tests/test_fp8_hot.py tests/test_graph_pool.py"
  case ${GPU_TESTS_PART:-} in
    a) GPU_TESTS=$part_a GPU_TESTS_LOG=_a ;;
    b) GPU_TESTS="tests $(printf -- ' --ignore=%s' $part_a)" GPU_TESTS_LOG=_b ;;
  esac
  [ -d .whl-hf ] && python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site-hf .whl-hf/*.whl \
    >/dev/null 2>&1 && hf_site=:/tmp/site-hf
  PYTHONPATH=$PYTHONPATH${hf_site:-} timeout ${TESTS_TIMEOUT:-560} python3 -P -m pytest ${GPU_TESTS:-tests} -m gpu -v \
    -p no:cacheprovider -n ${GPU_TEST_WORKERS:-4} --durations=15 2>&1 | tee "$OUT/gpu_tests${GPU_TESTS_LOG:-}.log" \
    | grep -E "FAILED|ERROR|passed|failed|error" | tail -32 ;;
esac
case " $* " in *" newtests "*)  # the GPU tests of the paths no GPU has run yet (NEW_TESTS: another list)
  # transformers' tests run where .whl-hf travelled (carry [".whl", ".whl-hf"]); they skip, saying why, elsewhere
  [ -d .whl-hf ] && python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site-hf .whl-hf/*.whl \
    >/dev/null 2>&1 && hf_site=:/tmp/site-hf
  PYTHONPATH=$PYTHONPATH${hf_site:-} timeout ${TESTS_TIMEOUT:-560} python3 -P -m pytest ${NEW_TESTS:-tests/test_transformers_in_place.py tests/test_transformers.py \
    tests/test_transformers_models.py tests/test_kvcache_fused_combine.py tests/test_cold_paths.py tests/test_tuning.py \
    tests/test_flash_bwd.py tests/test_eager.py tests/test_fastlaunch.py tests/test_lazy_imports.py \
    tests/test_cold_start.py tests/test_varlen.py tests/test_varlen_seqused.py tests/test_fp8_kvcache.py \
    tests/test_graph_pool.py tests/test_hot.py tests/test_hotpath_cpp.py tests/test_fp8_hot.py tests/test_fp8_reach.py} -m gpu -v -p no:cacheprovider -n ${GPU_TEST_WORKERS:-4} 2>&1 \
    | tee "$OUT/new_gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed|error" | tail -32 ;;
esac
case " $* " in *" fp8 "*)  # FP8: the forward beside our bf16 forward (and torch's fp8 SDPA where it takes fp8), the
  # float8 KV cache's decoding beside the bf16 cache's, in the same run
  python3 benchmarks/bench_flash_fwd.py --fp8 --head-dims 64,128,256 --csv "$OUT/flash_fwd_fp8.csv" ${FP8_ARGS:-} 2>&1 \
    | tee "$OUT/bench_fp8_fwd.log" | tail -20
  python3 benchmarks/bench_decode.py --kv-dtype e4m3 --batches 1,8,32 --lengths 4k,16k,32k \
    --csv "$OUT/decode_fp8.csv" 2>&1 | tee "$OUT/bench_decode_fp8.log" | tail -20 ;;
esac
case " $* " in *" fp8gluon "*)  # the Gluon FP8 forward's both key orders: GPU tests, then the FP8 forward's bench;
  # from .whl/fp8.ltimg where it travelled (experiments/fp8_gluon_variants.py says how to build it here)
  ( [ -f .whl/fp8.ltimg ] && export LAZYTRITON_IMAGES=$PWD/.whl/fp8.ltimg
    timeout ${FP8_TESTS_TIMEOUT:-240} python3 -P -m pytest -m gpu -n 4 -q -p no:cacheprovider tests/test_fp8_gluon.py 2>&1 \
      | tee "$OUT/fp8_gluon_tests.log" | tail -4
    python3 benchmarks/bench_flash_fwd.py --fp8 --head-dims ${FP8_HEAD_DIMS:-64,128,256} --no-host \
      --csv "$OUT/flash_fwd_fp8.csv" 2>&1 | tee "$OUT/bench_fp8_gluon.log" | grep -E "^hd|rror" ) ;;
esac
case " $* " in *" serving "*)  # MLA's latent-cache decoding, the slot write, the mixed prefill + decode call
  python3 benchmarks/bench_decode.py --mla --batches 1,8,32,64 --lengths 4k,16k,32k --csv "$OUT/decode_mla.csv" 2>&1 \
    | tee "$OUT/bench_mla.log" | tail -20
  python3 benchmarks/bench_kv_slots.py --csv "$OUT/kv_slots.csv" 2>&1 | tee "$OUT/bench_kv_slots.log" | tail -12
  python3 benchmarks/bench_mixed.py --page-size 16,256 2>&1 | tee "$OUT/bench_mixed.log" | tail -12 ;;
esac
case " $* " in *" features "*)  # the serving features beside the same call without them (goal: within 1.10): sinks
  # and cache_leftpad, rotary in a decoding step; the mixed prefill + decode call beside its parts run apart
  timeout ${FEATURES_TIMEOUT:-240} python3 benchmarks/bench_decode.py --sinks --leftpad --batches 1,8,64 \
    --lengths 4k,32k --csv "$OUT/decode_features.csv" 2>&1 | tee "$OUT/bench_decode_features.log" | tail -4
  timeout ${FEATURES_TIMEOUT:-240} python3 benchmarks/bench_decode.py --rotary interleaved --batches 1,8,64 \
    --lengths 4k,32k --csv "$OUT/decode_rotary.csv" 2>&1 | tee "$OUT/bench_decode_rotary.log" | tail -12
  timeout ${FEATURES_TIMEOUT:-240} python3 benchmarks/bench_mixed.py --page-size 16,256 2>&1 \
    | tee "$OUT/bench_mixed.log" | tail -12 ;;
esac
case " $* " in *" demo "*)
  lazytriton demo > "$OUT/demo1.log" 2>&1; lazytriton demo > "$OUT/demo2.log" 2>&1
  tail -4 "$OUT/demo1.log"; tail -7 "$OUT/demo2.log"
  if [ -d .gpu-cache ]; then  # entries compiled on a CPU machine (another Triton): served with 0 compiles?
    cp -r .gpu-cache /tmp/carried-cache; LAZYTRITON_CACHE_DIR=/tmp/carried-cache lazytriton demo 2>&1 | tee "$OUT/demo_carried.log"
  fi
  python3 benchmarks/profile_cold.py > /dev/null 2>&1  # fills the cache for its shape
  python3 benchmarks/profile_cold.py > "$OUT/profile_cold_local.log" 2>&1; head -3 "$OUT/profile_cold_local.log" ;;
esac
case " $* " in *" capi "*)  # the C API: GPU tests (device memory, plans), then host time per call
  python3 -P -m pytest tests/test_capi.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/capi_tests.log" | tail -5
  python3 benchmarks/bench_capi.py --csv "$OUT/capi.csv" 2>&1 | tee "$OUT/bench_capi.log" | tail -8
  # the decoding call: lt_attn_kvcache beside its three bare launches and flash_attn_with_kvcache (capi_decode.py)
  python3 benchmarks/bench_capi.py --kernel kvcache --csv "$OUT/capi.csv" 2>&1 | tee "$OUT/bench_capi_decode.log" \
    | tail -14 ;;
esac
case " $* " in *" native "*)  # the native core's 2 ms target: a fresh C process (benchmarks/native_first_launch.c, the real
  # libcuda) from lt_init to its first lt_attn_fwd returned and completed, one real entry of this GPU's target
  # (prewarmed here) among 200, its CUDA context timed apart; beside a fresh interpreter's first flash_attn_func from
  # the same image. Builds liblazytriton_native.so (gcc, zstd.h); carry [".whl"] (cffi, zstandard)
  timeout ${NATIVE_TIMEOUT:-500} python3 benchmarks/bench_native.py --gpu --runs ${NATIVE_RUNS:-15} \
    --csv "$OUT/native.csv" 2>&1 | tee "$OUT/bench_native.log" | tail -12 ;;
esac
case " $* " in *" verify "*)  # an image built by this host's Triton passes cache verify (launch metadata vs ELF)
  lazytriton prewarm --target sm_90 --dtype bf16,fp32 --head-dim 64,128 --causal none --seqlen-q 4096 --seqlen-k 4096 \
    --out /tmp/lt-verify.ltimg > "$OUT/verify_prewarm.log" 2>&1; tail -2 "$OUT/verify_prewarm.log"
  lazytriton cache verify /tmp/lt-verify.ltimg 2>&1 | tee "$OUT/verify.log" | tail -4 ;;
esac
case " $* " in *" interface "*)  # host cost eager vs op, a compiled model step, CUDA graph replay
  python3 benchmarks/bench_interface.py --csv "$OUT/interface.csv" 2>&1 | tee "$OUT/bench_interface.log" | tail -22 ;;
esac
case " $* " in *" bench "*|*" bwd "*)  # launches through the compiled helper, as a deployment that built it (README)
  python3 -m lazytriton.driver.fastlaunch_build >/dev/null 2>&1 || echo "launch helper not built: ABI-mode launches" ;;
esac
case " $* " in *" bench "*)
  python3 benchmarks/bench_flash_fwd.py --csv "$OUT/flash_fwd.csv" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
esac
case " $* " in *" transformers "*)  # needs carry [".whl-hf"]: transformers' wheels (benchmarks/README: wheels.sh .whl-hf transformers)
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site-hf .whl-hf/*.whl >/dev/null 2>&1 || echo "no .whl-hf"
  # A serving process as it runs after the first: the compiled launch helpers in the cache dir (a fresh cache
  # dir's first process builds them in the background and launches through cffi's ABI mode until it ends)
  lazytriton prewarm --helpers >/dev/null 2>&1 || echo "launch helpers not built: the bench's launch path line says which path ran"
  # HF_CONFIGS: ';'-separated argument sets, one run each (default: a dynamic cache, a static cache with compiled
  # decoding steps, a long prompt at batch 1)
  IFS=';' read -ra hf_configs <<< "${HF_CONFIGS:- ;--cache static;--min-len 8192 --max-len 32768 --batch 1 --new-tokens 32 --reps 2}"
  for hf_args in "${hf_configs[@]}"; do
    PYTHONPATH=$PYTHONPATH:/tmp/site-hf timeout ${HF_TIMEOUT:-300} python3 benchmarks/bench_transformers.py \
      --csv "$OUT/transformers.csv" $hf_args ${HF_ARGS:-} 2>&1 | tee -a "$OUT/bench_transformers.log" | tail -6
  done ;;
esac
case " $* " in *" bwd "*)  # backward (bwd, fwd+bwd): lazytriton, Triton's JIT, SDPA flash and cuDNN; BWD_ARGS=--quick ...
  # Rows are appended to this tree's benchmarks/results/flash_bwd.csv, which is then copied whole to $OUT.
  OUT="$OUT" python3 benchmarks/bench_flash_bwd.py ${BWD_ARGS:-} 2>&1 | tee "$OUT/bench_bwd.log" | tail -62
  cp benchmarks/results/flash_bwd.csv "$OUT/flash_bwd.csv" ;;
esac
case " $* " in *" wide "*)  # flash_fwd_gluon's wide tiles (three consumer warpgroups): GPU tests, then the probe beside
  # the served tilings (ping-pong), flash_fwd and cuDNN over WIDE_HEAD_DIMS (WIDE_ARGS=--quick: 1k and 4k only)
  python3 -P -m pytest tests/test_gluon_fwd_wide.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/wide_tests.log" | tail -4
  skip="gluon[128, 128, 8],gluon[128, 128, 8]+producer,gluon[128, 64, 8],gluon[128, 64, 8]+producer"
  mkdir -p "$OUT/wide"
  OUT="$OUT/wide" python3 experiments/probe_gluon.py --head-dims ${WIDE_HEAD_DIMS:-64} --wide ${WIDE_ARGS:-} \
    --skip "$skip" 2>&1 | tail -26 ;;
esac
case " $* " in *" fwdtests "*)  # the forward Gluon kernel's GPU tests (all its tilings), 4 processes on the GPU
  timeout ${TESTS_TIMEOUT:-300} python3 -P -m pytest tests/test_gluon_fwd.py tests/test_gluon_fwd_wide.py \
    tests/test_gluon_fwd_split.py tests/test_gluon_fwd_hd256.py -m gpu -q -p no:cacheprovider -n 4 2>&1 \
    | tee "$OUT/fwd_tests.log" | tail -6 ;;
esac
case " $* " in *" bwdsplit "*)  # the fused backward at split head dims: its GPU tests, the served kernel beside a kernel
  # file of before a change (BWDSPLIT_BEFORE, in experiments/, untracked: the device tool carries it), the fused plan
  # from 1k keys against the two kernels
  timeout ${BWDTESTS_TIMEOUT:-200} python3 -P -m pytest tests/test_fused_bwd.py -m gpu -q \
    -p no:cacheprovider -n 4 2>&1 | tee "$OUT/bwd_tests.log" | tail -4
  [ -n "${BWDSPLIT_BEFORE:-}" ] && timeout ${BWDSPLIT_TIMEOUT:-240} python3 experiments/probe_fused_variants.py \
    --head-dims ${BWDSPLIT_HEAD_DIMS:-96,80} --seqlens 1024,4096,16384 --variant "before=$BWDSPLIT_BEFORE" 2>&1 \
    | tee "$OUT/bwd_split.log" | tail -16
  timeout 120 python3 experiments/probe_bwd_overhead.py --fused-from 1024 --head-dims ${BWDSPLIT_HEAD_DIMS:-96,80} \
    --seqlens 1024 --quiet 2>&1 | tee "$OUT/bwd_from1k.log" | tail -8 ;;
esac
case " $* " in *" bwdtrace "*)  # where the fused backward's programs spend their time, by phase (probe_fused_steps.py
  # --trace, TRACE_HEAD_DIMS at 1k and 4k): the served kernel's tracing copy, made here, and TRACE_EXTRA's
  # ("NAME=FILE ...": tracing copies made beforehand, in experiments/, untracked: the device tool carries them)
  python3 experiments/make_trace_kernel.py >/dev/null
  traces="--trace served=experiments/fused_trace_kernel.py"
  for extra in ${TRACE_EXTRA:-}; do traces="$traces --trace $extra"; done
  timeout ${TRACE_TIMEOUT:-200} python3 experiments/probe_fused_steps.py --head-dims ${TRACE_HEAD_DIMS:-192,256} \
    --no-fit $traces 2>&1 | tee "$OUT/bwd_trace.log" | grep -A40 "^case" | tail -40 ;;
esac
case " $* " in *" grids "*)  # issue 12's two grids, lazytriton against cuDNN over 8 head dims (device time, in turns)
  python3 -m lazytriton.driver.fastlaunch_build >/dev/null 2>&1; python3 -m lazytriton.kernels.flash_fwd.hotpath_build >/dev/null 2>&1
  for bench in ${GRIDS_BENCHES:-fwd bwd}; do
    timeout ${GRIDS_TIMEOUT:-280} python3 benchmarks/bench_flash_$bench.py --csv "$OUT/flash_$bench.csv" \
      --head-dims 64,80,96,128,160,192,224,256 --providers lazytriton,sdpa_cudnn > "$OUT/grid_$bench.log" 2>&1
  done
  grep -s "vs cuDNN" "$OUT/grid_fwd.log"; grep -sE "^TFLOP/s|^geomean|^min|^under" "$OUT/grid_bwd.log" ;;
esac
case " $* " in *" prewarm "*)  # prewarm's speedup: one plan at -j 1 and at -j $(nproc) in one run (issue 12: >= 0.8 a core)
  python3 benchmarks/bench_prewarm_scaling.py --csv "$OUT/prewarm.csv" ${PREWARM_ARGS:-} 2>&1 | tee "$OUT/prewarm_scaling.log" | tail -8 ;;
esac
case " $* " in *" fp8targets "*)  # this host's Triton (3.6) with float8 variants of two CUDA targets in one process:
  # the compile test that failed (sm_90's float8 first, then sm_80's), then a two-target float8 plan at -j 1 and -j N
  python3 -P -m pytest tests/test_fp8_kvcache.py tests/test_float8_lowering.py -k "float8_variants_compile or lowering" \
    -p no:cacheprovider -q 2>&1 | tee "$OUT/fp8targets_tests.log" | tail -3
  python3 benchmarks/bench_prewarm_scaling.py --float8-targets sm_90,sm_80 --csv "$OUT/prewarm.csv" 2>&1 \
    | tee "$OUT/prewarm_float8.log" | tail -8 ;;
esac
case " $* " in *" poolgaps "*)  # nothing kept from a graph's pool: reduce-overhead in fresh processes (the FP8 forward
  # without descales, the fused combine's decoding call) with cudagraph trees' pool check, then the FP8 and fused
  # combine GPU tests that the null descale pointer and the op's own counters touch
  timeout ${POOL_TESTS_TIMEOUT:-560} python3 -P -m pytest tests/test_graph_pool.py tests/test_fp8_reach.py \
    tests/test_fp8_hot.py tests/test_kvcache_fused_combine.py tests/test_capi_fp8.py -m gpu -v -p no:cacheprovider \
    -n ${GPU_TEST_WORKERS:-4} 2>&1 | tee "$OUT/poolgaps_tests.log" | grep -E "FAILED|ERROR|passed|failed|error" | tail -20 ;;
esac
case " $* " in *" regressions "*)  # the GPU tests of paths a change touched (NEWTESTS overrides the list)
  python3 -m lazytriton.driver.fastlaunch_build >/dev/null && python3 -m lazytriton.kernels.flash_fwd.hotpath_build >/dev/null || true
  timeout ${NEWTESTS_TIMEOUT:-330} python3 -P -m pytest ${NEWTESTS:-tests/test_varlen.py tests/test_alibi_dropout_mask.py \
    tests/test_kvcache.py tests/test_hot.py tests/test_fastlaunch.py tests/test_bwd_split.py tests/test_kvcache_append.py \
    tests/test_capi_kvcache.py tests/test_gluon_fwd_hd256.py tests/test_hotpath_cpp.py} -m gpu -v -p no:cacheprovider \
    -n ${GPU_TEST_WORKERS:-4} 2>&1 | tee "$OUT/regression_gpu_tests.log" | grep -E "FAILED|ERROR|passed|failed|error" | tail -12 ;;
esac
case " $* " in *" host "*)  # host time of a warm eager call per launch path, beside torch.add (builds the launch helper)
  python3 benchmarks/bench_host.py --csv "$OUT/host.csv" 2>&1 | tee "$OUT/bench_host.log" | tail -16 ;;
esac
case " $* " in *" hostparts "*)  # the warm call's host time part by part, and the driver's cost per kernel parameter
  python3 experiments/probe_host_parts.py 2>&1 | tee "$OUT/host_parts.log" | tail -22 ;;
esac
case " $* " in *" gluon "*)  # flash_fwd_gluon: compile, numerics against float32, every tiling timed beside flash_fwd and cuDNN
  timeout ${GLUON_TIMEOUT:-280} python3 experiments/probe_gluon.py ${GLUON_ARGS:---quick --sweep} 2>&1 | tail -40 ;;
esac
case " $* " in *" hosttma "*)  # flash_fwd_host_tma: K/V through host tensor descriptors, beside the pointer kernel and cuDNN
  timeout ${HOSTTMA_TIMEOUT:-200} python3 experiments/probe_host_tma.py ${HOSTTMA_ARGS:---quick} 2>&1 | tail -30 ;;
esac
case " $* " in *" splitd "*)  # non-power-of-two head dims: split tiles against padding
  timeout ${SPLITD_TIMEOUT:-150} python3 benchmarks/bench_split_d.py --csv "$OUT/split_d.csv" ${SPLITD_ARGS:-} 2>&1 \
    | tee "$OUT/bench_split_d.log" | tail -16 ;;
esac
case " $* " in *" tunedecode "*)  # flash_decode's table on this GPU (copy $OUT/decode_tuning.csv back to kernels/flash_decode/)
  timeout ${TUNEDECODE_TIMEOUT:-200} lazytriton tune --kernel flash_decode --dtype ${TUNEDECODE_DTYPES:-bf16} --head-dim 64,128 \
    -j "$(nproc)" --splits-report --table kernels/flash_decode/tuning.csv 2>&1 | tee "$OUT/tune_decode.log" | tail -30
  cp kernels/flash_decode/tuning.csv "$OUT/decode_tuning.csv" ;;
esac
case " $* " in *" nvcvt "*)  # the float8 cache's V tile converted in the load's layout (NV_CVT) beside Triton's
  # conversion: the same probe twice, each in its own cache dir (the flag is a compile-target constexpr)
  for nv in "" --nv-cvt; do LAZYTRITON_CACHE_DIR=/tmp/lt-fp8tiles$nv timeout ${NVCVT_TIMEOUT:-200} \
    python3 experiments/probe_decode_fp8_tiles.py $nv ${NVCVT_ARGS:---batches 1,8,32 --lengths 4096,32768} 2>&1 \
    | tee "$OUT/fp8_tiles${nv}.log" | tail -16; done ;;
esac
case " $* " in *" tunebwd "*)  # flash_bwd's table: hd256 (its own candidates) and split head dims (rows of their own)
  timeout ${TUNEBWD_TIMEOUT:-420} lazytriton tune --kernel flash_bwd --dtype ${TUNEBWD_DTYPES:-bf16} \
    --head-dim ${TUNEBWD_DIMS:-256,96,192} --causal both --pairs ${TUNEBWD_PAIRS:-4096x4096,16384x16384} -j "$(nproc)" \
    --table kernels/flash_bwd/tuning.csv 2>&1 | tee "$OUT/tune_bwd.log" | tail -30
  cp kernels/flash_bwd/tuning.csv "$OUT/bwd_tuning.csv" ;;
esac
case " $* " in *" decodetma "*)  # probe: batch-1 split programs' K/V tiles through TMA (device or host descriptors)
  # beside cp.async pointer loads, at 16k and 32k keys (experiments/probe_decode_tma.py)
  python3 experiments/probe_decode_tma.py --loads ${DECODETMA_ARGS:-} --csv "$OUT/decode_tma.csv" 2>&1 \
    | tee "$OUT/probe_decode_tma.log" | tail -${DECODETMA_TAIL:-130} ;;
esac
case " $* " in *" decode "*)  # flash_attn_with_kvcache decoding: GB/s, contiguous and paged, beside SDPA
  python3 benchmarks/bench_decode.py --csv "$OUT/decode.csv" ${DECODE_ARGS:-} 2>&1 | tee "$OUT/bench_decode.log" | tail -40 ;;
esac
case " $* " in *" fusedcombine "*)  # the combine fused into the split kernel (dispatch.FUSED_COMBINE_BY_DEFAULT off):
  # its GPU tests, then bench_decode's grid with lazytriton_fused beside lazytriton and SDPA, then the graph replay
  timeout ${FUSED_TESTS_TIMEOUT:-200} python3 -P -m pytest tests/test_kvcache_fused_combine.py -m gpu -v \
    -p no:cacheprovider 2>&1 | tee "$OUT/fused_combine_tests.log" | grep -E "FAILED|ERROR|passed|failed|error" | tail -12
  timeout ${FUSED_BENCH_TIMEOUT:-240} python3 benchmarks/bench_decode.py --fused-combine --batches 1,8,32 \
    --lengths 1k,4k,16k,32k --csv "$OUT/decode_fused.csv" ${FUSED_ARGS:-} 2>&1 | tee "$OUT/bench_decode_fused.log" | tail -20
  timeout ${FUSED_PROBE_TIMEOUT:-150} python3 experiments/probe_decode_b1.py --fused --batch 1,8 \
    --lengths 1024,4096,16384,32768 2>&1 | tee "$OUT/probe_fused_combine.log" | tail -24 ;;
esac
case " $* " in *" decodecpp "*)  # the decoding call's warm path in C++ (kernels/flash_decode/_hotpath.cpp):
  # bench_decode's batch 1 and 8 rows with hot.py's Python lookup and tail (the launch helper and flash_fwd's tail built into the
  # package, the cache dir's helpers off), then with the C++ module built into the package folder: its lookup and
  # tail (lazytriton) beside the Python lookup with its tail (lazytriton_pylookup), interleaved; then its GPU tests
  # and the warm path's
  python3 -m lazytriton.driver.fastlaunch_build >/dev/null && python3 -m lazytriton.kernels.flash_fwd.hotpath_build \
    >/dev/null || echo "the launch helper or flash_fwd's tail not built"
  rm -f kernels/flash_decode/_hotpath.torch-*.so
  for tail in python cpp; do
    if [ $tail = cpp ]; then python3 -m lazytriton.kernels.flash_decode.hotpath_build || echo "the C++ tail not built"; fi
    LAZYTRITON_HELPERS=0 timeout ${DECODECPP_BENCH_TIMEOUT:-240} python3 benchmarks/bench_decode.py --batches 1,8 \
      --lengths 1k,4k,16k --layouts contiguous $([ $tail = cpp ] && echo --python-lookup) \
      --csv "$OUT/decode_$tail.csv" 2>&1 | tee "$OUT/bench_decode_$tail.log" | tail -16
  done
  LAZYTRITON_HELPERS=0 timeout ${DECODECPP_TESTS_TIMEOUT:-300} python3 -P -m pytest tests/test_decode_hotpath_cpp.py \
    tests/test_kvcache_hot.py -m gpu -v -p no:cacheprovider 2>&1 | tee "$OUT/decodecpp_tests.log" \
    | grep -E "FAILED|ERROR|passed|failed|error" | tail -12 ;;
esac
case " $* " in *" varlen "*)  # flash_attn_varlen_func on a mixed-length batch beside padded SDPA and the dense kernel
  python3 benchmarks/bench_varlen.py --csv "$OUT/varlen.csv" ${VARLEN_ARGS:-} 2>&1 | tee "$OUT/bench_varlen.log" | tail -30 ;;
esac
case " $* " in *" bwdatomic "*)  # probe: fused backward with atomic dQ (5 products) beside flash_bwd (7) and cuDNN
  timeout ${BWDATOMIC_TIMEOUT:-260} python3 experiments/probe_bwd_atomic.py ${BWDATOMIC_ARGS:-} 2>&1 \
    | tee "$OUT/bwd_atomic.log" | tail -16 ;;
esac
case " $* " in *" gluonbwd "*)  # probe: flash_bwd's dK/dV kernel in Gluon beside the Triton kernel and cuDNN
  timeout ${GLUONBWD_TIMEOUT:-240} python3 experiments/probe_gluon_bwd.py ${GLUONBWD_ARGS:-} 2>&1 \
    | tee "$OUT/gluon_bwd.log" | tail -16 ;;
esac
case " $* " in *" debugsections "*)  # the driver's module load of cubins with and without their debug sections
  # (compiler.PTXAS_OPTIONS): line_info_code.py compiles the default sm_90 variants both ways into two images, then
  # probe_module_load.py times each image's largest and smallest cubins in fresh processes (6 scenarios x
  # DEBUGSECTIONS_REPS, ~5 s each on the H100 host: the default 2 keeps the step near 4 minutes)
  dir=/tmp/lt-debugsections; mkdir -p $dir
  python3 -c "import sys; sys.path.insert(0, 'experiments'); from same_binaries import REPO, variants_file
print(variants_file(None, '$dir', sys.executable, REPO).read_text())" | grep ":sm_90:" > $dir/sm90.txt
  timeout ${DEBUGSECTIONS_TIMEOUT:-300} python3 experiments/line_info_code.py --variants $dir/sm90.txt --images $dir \
    2>&1 | tee "$OUT/line_info_code.log" | tail -1
  for side in kept served; do timeout 200 python3 experiments/probe_module_load.py --image $dir/$side.ltimg \
    --reps ${DEBUGSECTIONS_REPS:-2} 2>&1 | tee "$OUT/module_load_$side.log" | tail -12 | sed "s/^/$side: /"; done ;;
esac
case " $* " in *" appended "*)  # a decoding step that appends its new key, the split kernel as kv_append's
  # programmatic dependent: the GPU tests of the dependent launches (eager, in graphs after a memcpy node, the C API
  # and native core), probe_decode_appended.py (the split kernel launched plainly against as a dependent, bit for
  # bit), bench_decode's step without and with rotary, then the default grid read back to back and as a model's
  # layers (--layers auto: no cache in L2 from the call before)
  # (with carry [".whl", ".whl-hf"] transformers' static cache under reduce-overhead too: test_graph_pool.py)
  [ -d .whl-hf ] && python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site-hf .whl-hf/*.whl \
    >/dev/null 2>&1 && hf_site=:/tmp/site-hf
  (cd /tmp && PYTHONPATH=$PYTHONPATH${hf_site:-} timeout ${APPENDED_TESTS_TIMEOUT:-240} python3 -P -m pytest \
    -p no:cacheprovider -q -m gpu -n 4 "$OLDPWD"/tests/test_decode_pdl.py "$OLDPWD"/tests/test_kvcache_rotary.py \
    "$OLDPWD"/tests/test_native_decode.py "$OLDPWD"/tests/test_capi_kvcache.py "$OLDPWD"/tests/test_graph_pool.py \
    "$OLDPWD"/tests/test_decode_hotpath_cpp.py 2>&1 | tee "$OUT/appended_tests.log" | tail -6)
  timeout ${APPENDED_PROBE_TIMEOUT:-200} python3 experiments/probe_decode_appended.py ${APPENDED_ARGS:-} 2>&1 \
    | tee "$OUT/probe_appended.log" | tail -12
  timeout 150 python3 benchmarks/bench_decode.py --rotary interleaved --batches 1,8,64 --lengths 4k,32k \
    --csv "$OUT/decode_rotary.csv" 2>&1 | tee "$OUT/bench_decode_rotary.log" | tail -16
  for layers in 1 auto; do timeout 150 python3 benchmarks/bench_decode.py --layers $layers \
    --csv "$OUT/decode_layers_$layers.csv" 2>&1 | tee "$OUT/bench_decode_layers_$layers.log" | tail -36; done ;;
esac
