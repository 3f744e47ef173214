"""Where each anchored launch chain goes, decided one gather at a time on a live schedule.

Shared by `budget` (which plans on a scratch copy to decide what fits) and `prefetch`
(which applies the plan). A chain goes just before the later of its anchor and the slot
after its latest predecessor — legality is read off the graph's edges, nothing else — or, where
that goes over the peak-memory cap, just before the earliest slot after it that fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..cost.simulate import stream_of
from ..ir import Cast, CopyOut, Free, Launch, Program, Schedule, View, Wait
from ..ir.holds import NO_EARLIER_SLOT  # noqa: F401  (budget and prefetch import it from here)
from .gathers import Gather, GatherAnalysis
from .memory_cap import OVER_PEAK_CAP, Headroom

LATER_FOR_CAP = "later for peak cap"  # statistic: anchored over the cap, moved to the earliest slot after that fits
_COMMUNICATION = (Launch, Wait, View, Cast, CopyOut)  # the ops of launch chains and realizations
#: what a slot found for a chain may not be anchored at: communication, which a rewrite may erase
#: (bucket merges launches) or a pass move, and frees (unshard erases a parameter's forward free)
NOT_ANCHORS = (*_COMMUNICATION, Free)
#: (gather, why admit refused, its position, the chain's first position) -> a later position to try
Later = Callable[[Gather, str, int, int], int | None]


def plan(program: Program, analysis: GatherAnalysis, schedule: Schedule,
         admit: Callable[[Gather, str], str | None] = lambda g, t: None, later: Later | None = None,
         need_order: NeedOrder | None = None) -> Iterator[tuple[Gather, str | None, str | None]]:
    """Move anchored, unheld chains on `schedule`; yield (gather, target, reason it stayed).

    Where `admit` refuses the target and `later` names a position between it and the chain, the
    chain goes there instead if `admit` takes that (a partial prefetch). `need_order` (on
    `schedule`): a chain placed later than its anchor (by `later`, or by this rule) bounds the
    chains needed after it on its stream, which go no earlier than just after it."""
    node, pred = program.node_data, program.predecessors  # raw dicts: views cost more here
    pos = schedule.index
    floor = need_order
    for g in analysis.gathers:
        op: Launch = node[g.launch]["op"]
        if op.anchor is None or op.hold is not None:
            continue
        chain = set(g.chain)
        # just before the anchor, and after everything the chain reads or must follow
        outside = [p for name in g.chain for p in pred[name] if p not in chain]
        position = max(pos(op.anchor), max(map(pos, outside), default=-1) + 1)
        pushed = False
        if floor is not None:
            bound = floor.bound(g)
            if bound > position:
                position, pushed = bound, True
                floor.bounded[g.launch] = schedule[bound]
        first = min(map(pos, g.chain))
        if position >= first:
            yield g, None, NO_EARLIER_SLOT
            continue
        target = schedule[position]
        reason = admit(g, target)
        if reason is not None and later is not None:
            at = later(g, reason, position, first)
            if at is not None and position < at < first and admit(g, schedule[at]) is None:
                target, reason, pushed = schedule[at], None, True
        if reason is None:
            schedule.move_before(list(g.chain), target)
            if floor is not None and pushed:
                floor.placed(g, target)
        yield g, target, reason


class NeedOrder:
    """A stream runs its collectives in launch order, so a gather launched ahead of one needed
    before it delays that one by its whole time. Where a chain goes later than its anchor (over
    the in-flight budget or the peak cap there), the chains needed after it on its stream would
    still launch at their own, earlier anchors and queue in front of it (a generated graph of
    30k nodes: 460 small gathers for later layers, 4.6 ms, ahead of one moved later for the
    budget, which waited 3.05 ms on them): each goes no earlier than just after the latest chain
    moved later that is needed before it (just before the same slot, so after the chains placed
    there since, in the order they are needed). A bound only ever moves a chain later than its
    anchor, never across one of its own edges (it stays before its first slot or is not moved).

    Not checked: where the stream would be idle when the one moved later launches, a chain held
    back behind it could have run in that idle time (three 3 ms gathers around 1 ms ops: 14 ms
    against 13 without the bound). Planning both ways and keeping the shorter simulated order
    kept the bounds on every benchmarked workload and took budget from 0.16 to 0.39 s at 30k
    generated nodes, so it is not done; a cheaper test would be whether the stream is still busy
    when the one moved later launches."""

    def __init__(self, program: Program, schedule: Schedule, op_of: Callable[[str], Launch] | None = None):
        self.program, self.schedule = program, schedule
        # launch -> its op (budget hands its table over: a lookup by name costs a cache miss or
        # more at 100k nodes); the program's own by default
        self.op_of = op_of or program.op
        # stream -> (need position, target) of the latest chain moved later: what is bounded by it
        # goes before the same target, after it and after the chains placed there since
        self.last: dict[str, tuple[int, str]] = {}
        self.bounded: dict[str, str] = {}  # launch -> the target a bound sent it to

    def bound(self, g: Gather) -> int:
        """The earliest position `g`'s chain may go to (-1: none)."""
        last = self.last.get(stream_of(self.op_of(g.launch)))
        if last is None or last[0] > self.schedule.index(g.first_consumer):
            return -1  # needed before the one moved later (gathers go in entry order): no bound
        return self.schedule.index(last[1])

    def took(self, g: Gather, target: str | None) -> bool:
        """Whether a chain placed at `target` went there for a bound (that slot becomes its anchor)."""
        return target is not None and self.bounded.get(g.launch) == target

    def placed(self, g: Gather, target: str) -> None:
        """`g`'s chain went later than its anchor: it bounds those needed after it."""
        stream = stream_of(self.op_of(g.launch))
        need = self.schedule.index(g.first_consumer)
        last = self.last.get(stream)
        if last is None or need >= last[0]:  # one needed earlier (out of entry order) bounds nothing after it
            self.last[stream] = (need, target)


class LaterForCap:
    """`plan`'s `later` under a peak cap (budget's and prefetch's): a chain over the cap at its
    anchor goes to the earliest slot after it that fits (`earliest_fit`) on `schedule`; `took(g,
    target)` says whether a chain placed at `target` went there so (a partial prefetch: that slot
    becomes its anchor)."""

    def __init__(self, room: Headroom, schedule: Schedule):
        self.room, self.schedule = room, schedule
        self.offered: dict[str, str] = {}  # launch -> the later slot offered

    def __call__(self, g: Gather, reason: str, lo: int, hi: int) -> int | None:
        if reason != OVER_PEAK_CAP:
            return None
        room = self.room
        at = earliest_fit(lambda target: room.fits_earlier(g.chain, target), room.program, self.schedule, lo, hi)
        if at is not None:
            self.offered[g.launch] = self.schedule[at]
        return at

    def took(self, g: Gather, target: str | None) -> bool:
        return target is not None and self.offered.get(g.launch) == target


def earliest_fit(fits: Callable[[str], bool], program: Program, schedule: Schedule, lo: int, hi: int) -> int | None:
    """The earliest position in (lo, hi) before which a chain fits, or None: `fits(name)` says
    whether it fits launched before `name` (under the peak cap as `Headroom` counts it, or the
    in-flight budget), and a chain holds its bytes from its slot on, so a later slot adds less (a
    binary search; the move itself is checked again when taken)."""
    if hi - lo < 2 or not fits(schedule[hi - 1]):
        return None
    lo += 1
    hi -= 1
    last = hi
    while lo < hi:  # fits at hi; not known at lo
        mid = (lo + hi) // 2
        if fits(schedule[mid]):
            hi = mid
        else:
            lo = mid + 1
    # it becomes the gather's anchor: not an op a rewrite may erase or a pass move (NOT_ANCHORS);
    # the first other op from there (later fits too)
    while hi <= last and isinstance(program.op(schedule[hi]), NOT_ANCHORS):
        hi += 1
    return hi if hi <= last else None
