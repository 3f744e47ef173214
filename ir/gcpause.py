"""`gc_paused()`: hold Python's cyclic GC off for a stage that builds or scans a large graph.

Such stages allocate millions of long-lived objects; the generational collector's passes over
them find nothing to free and, at 100k nodes, cost a large share of the time. The collector's
previous state is restored on exit, so nesting is safe.

Leaving the outermost pause, everything the collector tracks is moved into its oldest
generation, unscanned (`gc.freeze()` then at once `gc.unfreeze()`; both only splice lists, and
freezing zeroes the youngest generation's count). Without this, the ~1M objects a 100k-node
run built sit in the youngest generation, and the first collections after the pause scan them
all: once as the youngest, again as the middle generation. Moved into the oldest, they are
scanned only by full collections, as every long-lived object is, and those are not brought
forward (CPython counts an object towards the next full collection when a collection of the
middle generation moves it there, not when unfreeze does).

Why not stay frozen, which would also spare them the full collections: frozen objects are
never collected. A long-running training process compiles graph after graph and drops them;
an FX graph is full of reference cycles (nodes and their users), so every graph frozen with it
would leak. Moved into the oldest generation they are still freed, by the next full collection.
When the caller has frozen objects of its own (`gc.get_freeze_count()`), unfreezing would thaw
them too, so then the pause only re-enables the collector.
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
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
