"""The one lock around Triton's global state, shared by the compiler and the interpreter.

Triton keeps global state (its knobs, TRITON_CACHE_DIR set for the length of a compile): one compile at a
time per process. The interpreter takes the lock too, once, while it loads its private copy of
triton.language, and while it loads a kernel's module against that copy.
"""
import threading

TRITON_LOCK = threading.RLock()
