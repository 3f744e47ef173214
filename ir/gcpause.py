"""`gc_paused()`: hold Python's cyclic GC off for a stage that builds or scans a large graph.

Such stages allocate millions of long-lived objects; the generational collector's full
passes over them find nothing to free and, at 100k nodes, cost a large share of the time.
The collector's previous state is restored on exit, so nesting is safe.
"""

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
