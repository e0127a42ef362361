"""An image's dictionary size against its bytes and a fresh process's first read.

Every process serving a kernel from an image decompresses and digests the image's dictionary before its first
entry, so the dictionary's size is a cold-start cost; its gain is the image's bytes. This writes the same
entries (``*.entry`` files in ``--entries``: ``bench_image_codecs.py``'s scratch folder, or any cache of encoded
entries) into one image for each size in ``--sizes`` (KiB, 0: plain zstd, no dictionary), then times, in fresh
processes taking the images in turns, the CPU time to open the image and read its first key (``Image`` then
``Image.read``: the dictionary's load, one entry's decompression and checks) after zstandard is imported.
Prints each size's image bytes, its ratio to the raw binaries and the median first read.

    python3 experiments/dictionary_first_read.py --entries DIR [--sizes 0,64,128,256,512] [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lazytriton.cache_format import Entry
from lazytriton.cache_format import image as image_format

CHILD = """
import sys, time
import zstandard  # imported first: its import is the same whatever the dictionary
from lazytriton.cache_format.image_reader import Image
start = time.thread_time()
image = Image(sys.argv[1])
image.read(next(iter(image.keys())))
print((time.thread_time() - start) * 1e3)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=Path, required=True, help="a folder of *.entry files")
    parser.add_argument("--sizes", default="0,64,128,256,512", help="dictionary sizes in KiB (0: none)")
    parser.add_argument("--runs", type=int, default=15, help="fresh processes per size")
    args = parser.parse_args()
    entries = [Entry.decode(path.read_bytes(), expected_key=path.stem) for path in sorted(args.entries.glob("*.entry"))]
    if not entries:
        raise SystemExit(f"no *.entry files in {args.entries}")
    sizes = [int(size) for size in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="dict-first-read-") as tmp:
        infos = {}
        for size in sizes:
            codec = "zstd-dict" if size else "zstd"
            infos[size] = image_format.write_image(Path(tmp) / f"{size}.ltimg", entries, codec=codec,
                                                   dict_bytes=size << 10)
        times: dict[int, list[float]] = {size: [] for size in sizes}
        for _ in range(args.runs):
            for size in sizes:
                out = subprocess.run([sys.executable, "-c", CHILD, str(infos[size].path)], capture_output=True,
                                     text=True, check=True, cwd=tmp)
                times[size].append(float(out.stdout))
    binary = infos[sizes[0]].binary_bytes
    print(f"{len(entries)} entries, {binary / 2**20:.2f} MiB of binaries; open + first read in a fresh process, "
          f"thread CPU, median of {args.runs}")
    print(f"{'dictionary':>12} {'dict bytes':>10} {'image MiB':>10} {'ratio':>7} {'first read ms':>14}")
    for size in sizes:
        info = infos[size]
        print(f"{f'{size} KiB' if size else 'none':>12} {info.dict_bytes:>10} {info.stored_bytes / 2**20:>10.3f} "
              f"{info.stored_bytes / binary:>7.3f} {statistics.median(times[size]):>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
