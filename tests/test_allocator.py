"""engine/allocator.py: with the thresholds fixed, a freed large block no longer raises glibc's
mmap threshold, so the next mid-size request is a mapping returned on free, not arena memory.
Each case runs in a fresh interpreter: a long test process holds free arena chunks that glibc
would serve a request from before mapping anything."""
import json
import subprocess
import sys

SCENARIO = r"""
import ctypes, ctypes.util, json, sys
from mawforge.engine.allocator import bound_allocator
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t)
                for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
libc.mallinfo2.restype = MI
bound = [bound_allocator(), bound_allocator()] if sys.argv[1] == "bound" else []
big = libc.malloc(16 << 20)     # unbound glibc raises its mmap threshold to 16 MiB on this free
libc.free(big)
before = libc.mallinfo2()
mids = [libc.malloc(1 << 20) for _ in range(8)]
during = libc.mallinfo2()
for m in mids:
    libc.free(m)
after = libc.mallinfo2()
print(json.dumps({"bound": bound, "mapped": during.hblks - before.hblks,
                  "arena_free_growth": after.fordblks - before.fordblks}))
"""


def _run(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", SCENARIO, mode], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_freed_blocks_do_not_stay_in_the_arenas():
    bound, unbound = _run("bound"), _run("unbound")
    assert bound["bound"] == [True, True]                 # glibc (every Linux this project runs on); idempotent
    assert bound["mapped"] == 8                           # each 1 MiB request is its own mapping...
    assert bound["arena_free_growth"] <= 64 << 10         # ...returned on free, nothing left in the arenas
    assert unbound["mapped"] == 0                         # the control: without the fix they came from the arena
    assert unbound["arena_free_growth"] >= 4 << 20        # and stayed there once freed
