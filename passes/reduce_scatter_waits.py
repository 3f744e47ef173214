"""Where overlap-reduce-scatter puts each reduce-scatter's wait: one walk down the order with
the simulator's clock (`plan_waits`). Kept apart from the pass so that each reads in one sitting."""

from __future__ import annotations

from collections import Counter
from heapq import heappop, heappush
from itertools import count, repeat
from math import inf

from ..cost.simulate import OTHER, WAIT, Clock, step_of
from ..ir import Launch, Op, Program, Wait, waits_of


def plan_waits(program: Program, ms, launches: list[str], travelling: set[str], limit: int,
               collectives: dict[str, Op] | None = None) -> tuple[list[tuple[str, str]], dict]:
    """Where each reduce-scatter wait goes: one walk down the order with the simulator's clock.

    The walk takes each such wait out where it reaches it and puts it back in before an op that
    stays put (one not beside an op that travels) once the clock there reads past its
    collective's end — or before the first op it must precede. The gradients of every
    reduce-scatter launched and not yet waited are in flight; a wait is held only while they fit
    the budget up to the next op that stays put. Where they do not, waits go back in (held ones
    or just taken out), those whose collective ends soonest first: the least exposed time for the
    bytes they free. Waits going back in before one op keep the order they were taken out in. A
    wait so goes only as far as hides its collective, and the walk sees its own result the same
    (a second run moves nothing). Returns [(wait, the op it goes before)] in the order they go
    back in, and counts. `collectives`: the program's launches and waits by name, as
    `launches_and_waits` finds them (the pass has them already)."""
    schedule = program.schedule
    names = schedule.names()
    n = len(names)
    node, succ = program.node_data, program.successors
    launch_of, nbytes, due, left = {}, {}, {}, {}
    for launch in launches:
        op = node[launch]["op"]
        sources = op.operands if len(op.types) > 1 else op.operands[:1]  # coalesced: every input
        nbytes[launch] = sum(node[o]["op"].nbytes_out for o in dict.fromkeys(sources))
        waits = waits_of(program, launch)
        left[launch] = len(waits)   # its waits not yet back in: in flight until the last
        for wait in waits:
            launch_of[wait] = launch
            due[wait] = min((schedule.index(s) for s in succ[wait]), default=n)  # it stays before that
    runs = _Runs(names, launch_of, travelling, nbytes)
    stays, rise = runs.stays, runs.rise
    # what the walk reads of each op, picked out in C (a lookup and a call per op were most of
    # this walk at 100k nodes): its cost, and whether it steps the clock by a rule of its own (a
    # launch or a wait); any other op only adds its cost to the compute stream's time
    if collectives is None:
        collectives = launches_and_waits(program)
    costs = list(map(ms.get, names, repeat(0.0)))
    timed = map(collectives.__contains__, names)

    clock, level = Clock(), 0   # level: bytes of the reduce-scatters launched, a wait of which is out
    taken: dict[str, int] = {}  # wait -> its place in the order taken out
    stepped: dict[str, int] = {}  # wait -> the ops the clock had stepped when it was taken out
    fresh, held = [], set()     # taken out since the last op; held past an op
    ends: list[tuple[float, int, str]] = []   # held: (its collective's end, taken, wait), a heap
    dues: list[tuple[int, int, str]] = []     # held: (its earliest successor, taken, wait), a heap
    overlapped, over = set(), set()           # launches: a wait went past an op; put back for the budget
    plan = []
    t = 0.0  # the clock's time, kept here between the steps that need the clock itself
    for i, name, cost, rule in zip(count(), names, costs, timed):
        if rule and name in launch_of:
            taken[name], stepped[name] = len(taken), i - len(taken)
            fresh.append(name)
            continue
        now = t if (fresh or held) and stays(i) else -inf   # past its end: only before an op that stays
        if fresh or held and ((ends and ends[0][0] <= now) or (dues and dues[0][0] <= i) or level + rise(i) > limit):
            clock.t = t
            back = set()
            while ends and ends[0][0] <= now:
                back.add(heappop(ends)[2])
            while dues and dues[0][0] <= i:
                back.add(heappop(dues)[2])
            back &= held   # each heap holds every held wait, and some that went back already
            back.update(w for w in fresh if clock.ends[launch_of[w]] <= now or due[w] <= i)
            # held past this op, they must fit the budget up to the next op that stays put
            gone = Counter(map(launch_of.get, back))
            peak = level + rise(i) - sum(nbytes[la] for la, k in gone.items() if k == left[la])
            if peak > limit:
                rest = [w for w in (*held, *fresh) if w not in back] if stays(i) else [w for w in fresh if w not in back]
                for wait in sorted(rest, key=lambda w: (clock.ends[launch_of[w]], taken[w])):
                    if peak <= limit:
                        break
                    back.add(wait)
                    over.add(launch := launch_of[wait])
                    gone[launch] += 1
                    peak -= nbytes[launch] if gone[launch] == left[launch] else 0
            for wait in fresh:
                if wait not in back:
                    held.add(wait)
                    heappush(ends, (clock.ends[launch_of[wait]], taken[wait], wait))
                    heappush(dues, (due[wait], taken[wait], wait))
            fresh = []
            for wait in sorted(back, key=taken.__getitem__):
                held.discard(wait)
                launch = launch_of[wait]
                if i - len(taken) > stepped[wait]:
                    overlapped.add(launch)   # it went past an op
                plan.append((wait, name))
                clock.step(wait, (WAIT, ms.get(wait, 0.0), None, launch))
                left[launch] -= 1
                level -= 0 if left[launch] else nbytes[launch]
            t = clock.t
        if rule:
            level += nbytes.get(name, 0)
            s = step_of(collectives[name], cost)
            if s[0] != OTHER or s[1]:  # a collective, or an op that costs something
                clock.t = t
                clock.step(name, s)
                t = clock.t
        elif cost:  # as Clock.step steps any other op
            t += cost
    overlapped -= over
    return plan, {"overlapped": len(overlapped), "over budget": len(over),
                  "in place": len(launches) - len(overlapped) - len(over)}



def launches_and_waits(program: Program) -> dict[str, Op]:
    """The program's launches and waits, by name, in the node table's order (`Program.ops_of`)."""
    return {op.name: op for op in program.ops_of((Launch, Wait))}


class _Runs:
    """Which ops stay put — neither travelling nor right after one that travels (the first op
    counts as after one; the waits the walk takes out are no ops here) — and the bytes launched
    from each op up to the next that stays put. Worked out only where the walk asks, which is
    only while a wait is out: two walks over the whole order were a quarter of `plan_waits` at
    100k nodes. Each `rise` fills in the run it walked, so the walk's questions cost O(N) in all."""

    def __init__(self, names: list[str], launch_of: dict[str, str], travelling: set[str], nbytes: dict[str, int]):
        self.names, self.launch_of, self.travelling, self.nbytes = names, launch_of, travelling, nbytes
        self.rises: dict[int, int] = {}

    def stays(self, i: int) -> bool:
        names, taken = self.names, self.launch_of
        if names[i] in taken or names[i] in self.travelling:
            return False
        before = i - 1
        while before >= 0 and names[before] in taken:
            before -= 1
        return before >= 0 and names[before] not in self.travelling

    def rise(self, i: int) -> int:
        rises, n = self.rises, len(self.names)
        if i in rises:
            return rises[i]
        end = i + 1  # the next op that stays put, or one whose rise is known
        while end < n and end not in rises and not self.stays(end):
            end += 1
        total = rises[end] if end < n and end in rises and not self.stays(end) else 0
        for j in range(end - 1, i - 1, -1):
            total += self.nbytes.get(self.names[j], 0)
            rises[j] = total
        return total
