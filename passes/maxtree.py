"""A max segment tree with range add: the in-flight and memory curves of the budgeted passes."""

from __future__ import annotations


class MaxTree:
    """Range add, range max over [0, n) (bottom-up lazy segment tree).

    The budgeted passes call it a few times per collective, so the walks are written out with
    no method call per visited tree node (those calls cost more than the work they did).
    """

    def __init__(self, n: int):
        self.n = max(1, n)
        self.h = self.n.bit_length()
        self.t = [0] * (2 * self.n)
        self.d = [0] * self.n

    def _build(self, p: int) -> None:
        """Recompute the ancestors of node p from their children, bottom up."""
        t, d = self.t, self.d
        while p > 1:
            p >>= 1
            a, b = t[2 * p], t[2 * p + 1]
            t[p] = (a if a > b else b) + d[p]

    def _push(self, p: int) -> None:
        """Hand the pending adds of node p's ancestors down, top down."""
        t, d, n = self.t, self.d, self.n
        for s in range(self.h, 0, -1):
            i = p >> s
            if i and d[i]:
                value = d[i]
                for child in (2 * i, 2 * i + 1):
                    t[child] += value
                    if child < n:
                        d[child] += value
                d[i] = 0

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
        t = self.t
        lo += self.n
        hi += self.n
        self._push(lo)
        self._push(hi - 1)
        best = 0
        while lo < hi:
            if lo & 1:
                if t[lo] > best:
                    best = t[lo]
                lo += 1
            if hi & 1:
                hi -= 1
                if t[hi] > best:
                    best = t[hi]
            lo >>= 1
            hi >>= 1
        return best

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
