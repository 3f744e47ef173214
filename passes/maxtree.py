"""A max segment tree with range add: the in-flight and memory curves of the budgeted passes."""

from __future__ import annotations

_BELOW_ALL = float("-inf")  # a side of the range where nothing was picked yet


class MaxTree:
    """Range add, range max over [0, n) (bottom-up lazy segment tree).

    The budgeted passes call it a few times per collective, so the walks are written out with
    no method call per visited tree node (those calls cost more than the work they did).
    """

    def __init__(self, n: int):
        self.n = max(1, n)
        self.t = [0] * (2 * self.n)
        self.d = [0] * self.n

    def add(self, lo: int, hi: int, value: int) -> None:
        t, d, n = self.t, self.d, self.n
        lo += n
        hi += n
        l0, r0 = lo, hi
        while lo < hi:
            if lo & 1:
                t[lo] += value
                if lo < n:
                    d[lo] += value
                lo += 1
            if hi & 1:
                hi -= 1
                t[hi] += value
                if hi < n:
                    d[hi] += value
            lo >>= 1
            hi >>= 1
        # the ancestors of both ends, a step up each in turn: from where the two paths meet in
        # one step they are one path, rebuilt once (one end's whole path then the other's rebuilt
        # that part twice). Every node is rebuilt last after its children are, so the tree is the
        # same (where one path reaches a node a step before the other, both rebuild it).
        lo, hi = l0, r0 - 1
        while lo > 1 or hi > 1:
            stepped = lo > 1
            if stepped:
                lo >>= 1
                a, b = t[2 * lo], t[2 * lo + 1]
                t[lo] = (a if a > b else b) + d[lo]
            if hi > 1:
                hi >>= 1
                if not (stepped and hi == lo):
                    a, b = t[2 * hi], t[2 * hi + 1]
                    t[hi] = (a if a > b else b) + d[hi]

    def max(self, lo: int, hi: int) -> int:
        """The largest value over [lo, hi), or 0 if that is larger (or the range is empty).

        Read bottom up with no pending add handed down: a node's value lacks the pending adds
        of its ancestors, and every node picked on the left lies under the node just before
        `lo` as it climbs (on the right, under `hi`), so each side adds those ancestors' pending
        adds on the way up, then the rest of them to the root. (Handing them down first walked
        both ends' paths from the root once more per query: 8k random spans over 180k slots,
        a max and an add each, 150 -> 100 ms.)"""
        t, d, n = self.t, self.d, self.n
        lo += n
        hi += n
        left = right = _BELOW_ALL
        while lo < hi:
            if lo & 1:
                if t[lo] > left:
                    left = t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > right:
                    right = t[hi]
            lo >>= 1
            hi >>= 1
            left += d[lo - 1]
            if hi < n:  # (a leaf's index only while nothing was picked on the right)
                right += d[hi]
        lo -= 1
        while lo > 1:
            lo >>= 1
            left += d[lo]
        while hi > 1:
            hi >>= 1
            if hi < n:
                right += d[hi]
        best = left if left > right else right
        return best if best > 0 else 0

    @classmethod
    def of(cls, values: list[int]) -> MaxTree:
        """A tree over [0, len(values)) holding `values`."""
        tree = cls(len(values))
        t, n = tree.t, tree.n
        t[n:n + len(values)] = values
        for p in range(n - 1, 0, -1):
            a, b = t[2 * p], t[2 * p + 1]
            t[p] = a if a > b else b
        return tree
