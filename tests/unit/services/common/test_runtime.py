"""services.common.runtime.freeze_startup_heap, in a fresh interpreter: freezing the test process's own
heap would keep every later test's garbage that is alive now."""

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]

PROBE = textwrap.dedent("""
    import gc, time, weakref
    from services.common.runtime import freeze_startup_heap

    class Node:
        pass

    startup = [[Node() for _ in range(1000)] for _ in range(300)]  # a large heap built at startup
    gc.collect()
    started = time.perf_counter()
    gc.collect()
    before = time.perf_counter() - started
    freeze_startup_heap()
    started = time.perf_counter()
    gc.collect()
    after = time.perf_counter() - started

    later = Node()
    later.cycle = later  # garbage made after the freeze is still collected
    alive = weakref.ref(later)
    del later
    gc.collect()
    print(gc.get_freeze_count(), before, after, alive() is None)
""")


def test_frozen_startup_heap_is_not_walked_and_later_garbage_is_collected() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, check=True)
    frozen, before, after, collected = result.stdout.split()
    assert int(frozen) > 300_000  # the startup objects moved to the permanent generation
    assert float(after) < float(before) / 10  # a full collection no longer walks them
    assert collected == "True"
