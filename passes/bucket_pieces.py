"""bucket_pieces: stretches of the schedule as max-plus maps, for the bucket pass's quick trials.

passes/bucket_sweep.py's quick trials jump each stretch of the program between two of a trial's
own changes at once: what `Clock.step`'s rules do over it, as maps of the state before it (the
compute time t -> max(t + a, b); the one stream it launches on, and each launch's end, as
max(t + alpha, stream + beta, gamma)). This file holds those maps (`_Piece`), the scan that makes
one and can go on (`_Scan`, stepped by `_SharedBaseSweep._scan`), and their composition
(`_compose`: two stretches in turn as one map; `_Launches`: a composed piece's launches' ends,
made where asked). Max-plus maps compose exactly but for rounding: the sums are added in another
order (~1e-15 of the step), which the trials' `settle` leaves to the exact sweep near a decision.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs


@attrs.frozen
class _Piece:
    """A stretch of the program as it is, as maps of the state before it (`_SharedBaseSweep._piece`):
    the compute time max(t + a, b); the one stream it launches on (None: none) max(t + fa,
    stream + fb, fc), and each launch's end (name -> (alpha, beta, gamma, gathered bytes)); its
    launches' largest end + tail (`tails`, the three terms); the collectives in flight before it
    that it waits; the highest the gathered bytes in flight rise over it (from 0)."""

    a: float
    b: float
    waited: tuple
    stream: object
    fa: float
    fb: float
    fc: float
    launches: dict = attrs.field(eq=False)
    tails: tuple
    high: int
    rise: int  # the gathered bytes its launches add (the sum over `launches`: a jump adds it at once)
    #: a chain of pieces made one (`_compose`): the gathered bytes of its waits (each in flight
    #: since before the trials' first slot), and whether a jump of any of them moves the level
    #: (None: a piece, whose jump sees that itself)
    drop: int = 0
    resets: object = None


def _compose(first: _Piece, then: _Piece, pending: dict, lazy: bool = False) -> _Piece | None:
    """The stretch of `first` then `then` as one `_Piece`, or None where they launch on two
    streams. Max-plus maps compose: t -> max(t + a, b) after t -> max(t + a', b') is
    t -> max(t + a' + a, max(b' + a, b)), and likewise the stream and each launch's end, which
    read the compute time and the stream as they are after `first`. The same figures as
    jumping the two in turn, but for rounding (sums added in another order: ~1e-15 of the step,
    where `settle` lets the exact sweep decide anything within NEAR_MS). A jump pops the
    collectives a piece waits from the trial's in-flight set; each is in flight in the sweep's
    clock (where the piece found it) and waited nowhere else, so it pops `pending`'s bytes.
    `lazy`: the launches' ends are composed where asked (`_Launches`), not here."""
    if first.stream is None:
        stream = then.stream
    elif then.stream is None or then.stream == first.stream:
        stream = first.stream
    else:
        return None
    a, b, fa, fb, fc = first.a, first.b, first.fa, first.fb, first.fc   # (no stream: -inf, 0.0, -inf)

    def after(la, lb, lc):  # max(t1 + la, s1 + lb, lc), t1 and s1 as `first` leaves them
        return max(a + la, fa + lb), fb + lb, max(b + la, fc + lb, lc)

    if then.stream is None:
        sa, sb, sc = fa, fb, fc
    else:
        sa, sb, sc = after(then.fa, then.fb, then.fc)
    if lazy:
        launches = _Launches(first.launches, then.launches, (a, b, fa, fb, fc))
    else:
        launches = dict(first.launches)
        for name, (la, lb, lc, extra) in then.launches.items():
            launches[name] = (*after(la, lb, lc), extra)
    ta, tb, tc = after(*then.tails)
    tails = (max(first.tails[0], ta), max(first.tails[1], tb), max(first.tails[2], tc))
    drops, resets = [], []
    for piece in (first, then):
        if piece.resets is None:
            drop = sum(pending.get(n, 0) for n in piece.waited)
            drops.append(drop)
            resets.append(piece.rise - drop != 0 or piece.high != 0)
        else:
            drops.append(piece.drop)
            resets.append(piece.resets)
    high = max(first.high, first.rise - drops[0] + then.high)
    then_b = b + then.a
    return _Piece(a + then.a, then_b if then_b > then.b else then.b, first.waited + then.waited, stream, sa, sb, sc,
                  launches, tails, high, first.rise + then.rise, drops[0] + drops[1], resets[0] or resets[1])


def _after(via: tuple, end: tuple) -> tuple:
    """A launch's end map (alpha, beta, gamma, bytes) of a piece, read before a piece `via`
    (its a, b, fa, fb, fc) that runs before it (as in `_compose`)."""
    a, b, fa, fb, fc = via
    la, lb, lc, extra = end
    return max(a + la, fa + lb), fb + lb, max(b + la, fc + lb, lc), extra


class _Launches(Mapping):
    """The launches of a piece composed of `own`'s piece then one whose launches are `rest`,
    each end read before the first (`_after` through `via`, the first's map): made where asked,
    as most composed pieces are jumped and their launches never read (a suffix made by
    `_SharedBaseSweep._suffixes` holds the next one's, which holds the next one's, ...)."""

    __slots__ = ("own", "rest", "via", "whole")

    def __init__(self, own: dict, rest, via: tuple):
        self.own, self.rest, self.via, self.whole = own, rest, via, None

    def get(self, name, default=None):
        vias, node = [], self
        while True:
            got = node.own.get(name)
            if got is not None:
                break
            vias.append(node.via)
            node = node.rest
            if not isinstance(node, _Launches):
                got = node.get(name)
                break
        if got is None:
            return default
        for via in reversed(vias):
            got = _after(via, got)
        return got

    def _whole(self) -> dict:
        if self.whole is None:
            nodes, node = [], self
            while isinstance(node, _Launches) and node.whole is None:
                nodes.append(node)
                node = node.rest
            whole = dict(node if not isinstance(node, _Launches) else node.whole)
            for n in reversed(nodes):
                whole = {name: _after(n.via, end) for name, end in whole.items()}
                whole.update(n.own)
                n.whole = whole
        return self.whole

    def __getitem__(self, name):
        got = self.get(name)
        if got is None:
            raise KeyError(name)
        return got

    def __iter__(self):
        return iter(self._whole())

    def __len__(self):
        return len(self._whole())


class _Scan:
    """`_SharedBaseSweep._piece`'s scan of slots [lo, hi), as far as it went, to go on from:
    the `_Piece` terms so far and the in-flight level; `makes`: how many of the sweep's makes
    it is known to hold after; `false`: the piece is False from `hi` on."""

    __slots__ = ("lo", "hi", "makes", "false", "a", "b", "waited", "stream", "fa", "fb", "fc", "launches",
                 "level", "high", "rise", "tails")

    def __init__(self, lo: int, makes: int):
        ninf = -math.inf
        self.lo = self.hi = lo
        self.makes, self.false = makes, False
        self.a, self.b, self.waited = 0.0, ninf, []
        self.stream, self.fa, self.fb, self.fc = None, ninf, 0.0, ninf
        self.launches, self.level, self.high, self.rise = {}, 0, 0, 0
        self.tails = [ninf, ninf, ninf]  # the largest end + tail of its launches (all pending after it)
