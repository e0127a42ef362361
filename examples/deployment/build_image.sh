#!/usr/bin/env bash
# Build a lazytriton image for NVIDIA H100/H200 (sm_90) and AMD MI300 (gfx942) on a
# machine without a GPU: Triton compiles for both targets on CPU. See README.md here.
#
#   examples/deployment/build_image.sh [OUT]          (default: dist/attention.ltimg)
#
# Settings (environment):
#   TARGETS        comma-separated targets            (default: sm_90,gfx942)
#   MISSES         misses.jsonl files from production, space-separated: their
#                  variants are built too and merged into the same image
#   JOBS           worker processes                   (default: all cores)
#   SHARD          I/N: build one part of the set (CI matrix); merge the parts later
#   PREWARM_ARGS   extra axis flags; a quick try: "--dtype bf16 --head-dim 64,128 --kernel flash_fwd"
#
# Run it again after an interruption: it compiles only what it had not built.
set -euo pipefail

OUT=${1:-dist/attention.ltimg}
TARGETS=${TARGETS:-sm_90,gfx942}
JOBS=${JOBS:-$(nproc)}
# Same inputs, same bytes: pin the one time field entries carry to the last commit.
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}
export SOURCE_DATE_EPOCH

mkdir -p "$(dirname "$OUT")"
shard=()
[ -n "${SHARD:-}" ] && shard=(--shard "$SHARD")

# 1. Every kernel family: its tuning table's rows for the targets, plus a default grid for the groups it
#    lacks (lazytriton prewarm --help); PREWARM_ARGS narrows or widens it.
# shellcheck disable=SC2086  # PREWARM_ARGS is a list of flags
lazytriton prewarm --target "$TARGETS" ${PREWARM_ARGS:-} -j "$JOBS" "${shard[@]}" --out "$OUT"

# 2. Optionally, what production compiled just in time (its miss logs), merged in.
if [ -n "${MISSES:-}" ]; then
    missed_args=()
    for file in $MISSES; do missed_args+=(--from-misses "$file"); done
    lazytriton prewarm "${missed_args[@]}" --target "$TARGETS" -j "$JOBS" "${shard[@]}" --out "$OUT.misses"
    lazytriton prewarm --merge "$OUT" "$OUT.misses" --out "$OUT"
    rm -f "$OUT.misses"
fi

# 3. What is in it (targets, entries, size), read back through the image reader.
python3 - "$OUT" <<'EOF'
import sys
from collections import Counter
from lazytriton.cache_format.image import Image

with Image(sys.argv[1]) as image:
    entries = [image.read(key) for key in image.keys()]  # every entry verified (checksums, key)
    size = image.path.stat().st_size
    binaries = sum(len(e.binary) for e in entries)
    per_target = Counter(e.target for e in entries)
    print(f"{image.path}: {len(entries)} entries {dict(sorted(per_target.items()))}, "
          f"{size / 2**20:.1f} MiB for {binaries / 2**20:.1f} MiB of binaries (1/{binaries / size:.1f}), "
          f"built by {', '.join(image.meta.get('compilers', []))}")
EOF
