"""One node of the cluster example: a process with its own local cache, sharing a tier with the others.

    python node.py resolve VARIANTS_FILE      resolve every variant listed (one per line), print one JSON line
    python node.py publish IMAGE              put every entry of a prewarm image into the shared tier

The shared tier, the cache dir and the signing key come from the environment
(``LAZYTRITON_SHARED``, ``LAZYTRITON_CACHE_DIR``, ``LAZYTRITON_SIGNING_KEY``).
This process imports no torch; it imports triton only if it has to compile.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from lazytriton import runtime
from lazytriton.variant import Variant


def resolve(variants_file: Path) -> dict[str, object]:
    """Resolve each variant once, in an order of this node's own (so nodes collide on different keys)."""
    variants = [Variant.parse(line) for line in variants_file.read_text().splitlines() if line.strip()]
    random.shuffle(variants)
    rt = runtime.get()
    start = time.perf_counter()
    sources = [rt.resolve(variant).source for variant in variants]
    return {"compiles": rt.compiles, "sources": {s: sources.count(s) for s in sorted(set(sources))},
            "seconds": round(time.perf_counter() - start, 2), "counters": rt.counters()}


def publish(image_path: Path) -> dict[str, object]:
    """Publish the entries of an image (a prewarm shard) to the shared tier, signed if a key is set."""
    from lazytriton.cache_format.image import Image

    shared = runtime.get().shared
    if shared is None:
        raise SystemExit("LAZYTRITON_SHARED is not set: nowhere to publish")
    image = Image(image_path)
    published = 0
    try:
        for key in image.keys():
            entry = image.read(key)  # verified on read
            if entry is not None and shared.put(key, entry):
                published += 1
    finally:
        image.close()
    return {"published": published}


if __name__ == "__main__":
    command, path = sys.argv[1], Path(sys.argv[2])
    print(json.dumps(resolve(path) if command == "resolve" else publish(path)))
