"""MaxTree (passes/maxtree.py) against a plain list: random range adds (some negative) and range
maxima (of empty ranges too), on sizes that are and are not powers of two."""

from __future__ import annotations

import random

import pytest

from fxsched.passes.maxtree import MaxTree


@pytest.mark.parametrize("seed", range(40))
def test_range_add_and_max_match_a_list(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 2, 3, 7, 8, 13, 64, 100, 257])
    values = [rng.randrange(0, 50) for _ in range(n)]
    tree = MaxTree.of(list(values)) if seed % 2 else MaxTree(n)
    if not seed % 2:
        values = [0] * n
    for _ in range(400):
        lo = rng.randrange(n + 1)
        hi = rng.randrange(lo, n + 1)
        if rng.random() < 0.5 and lo < hi:  # (callers add to non-empty spans only)
            value = rng.randrange(-60, 100)
            tree.add(lo, hi, value)
            values[lo:hi] = [v + value for v in values[lo:hi]]
        else:  # the largest value, or 0 when that is larger or the range empty
            got = tree.max(lo, hi)
            assert got == max([0, *values[lo:hi]]) and type(got) is int
