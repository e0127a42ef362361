"""One compile in a fresh interpreter: ``python -m lazytriton.compile_child VARIANT KEY``.

``lazytriton.compiler`` runs it where its own process cannot compile the
variant as a fresh one would (``lazytriton.float8_lowering``). It compiles in
this process and writes the entry's bytes (``Entry.encode``) on stdout; a
failure is a message on stderr and exit status 1.
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    from lazytriton.compiler import compile_in_process
    from lazytriton.variant import Variant

    if len(argv) != 2:
        print("usage: python -m lazytriton.compile_child VARIANT KEY", file=sys.stderr)
        return 2
    text, key = argv
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the compiler prints (Python or C) goes to stderr, never among the entry's bytes
    try:
        data = compile_in_process(Variant.parse(text), key).encode()
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    out.write(data)
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
