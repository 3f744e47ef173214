"""Where overlap-reduce-scatter puts each reduce-scatter's wait: one walk down the order with
the simulator's clock (`plan_waits`). Kept apart from the pass so that each reads in one sitting."""

from __future__ import annotations

from collections import Counter
from heapq import heappop, heappush
from math import inf

from ..cost.simulate import OTHER, WAIT, Clock, step_of
from ..ir import Program, waits_of


def plan_waits(program: Program, ms, launches: list[str], travelling: set[str], limit: int) -> tuple[list[tuple[str, str]], dict]:
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
    back in, and counts."""
    names = program.schedule.names()
    n = len(names)
    pos = {name: i for i, name in enumerate(names)}
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
            due[wait] = min((pos[s] for s in succ[wait]), default=n)  # it stays before that
    # which ops stay put, and the bytes launched from each op up to the next that stays put
    stays, travels = [False] * n, True
    for i, name in enumerate(names):
        if name not in launch_of:
            stays[i], travels = not (travels or name in travelling), name in travelling
    rise = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        rise[i] = nbytes.get(names[i], 0) + (0 if i + 1 == n or stays[i + 1] else rise[i + 1])

    clock, level = Clock(), 0   # level: bytes of the reduce-scatters launched, a wait of which is out
    taken: dict[str, int] = {}  # wait -> its place in the order taken out
    stepped: dict[str, int] = {}  # wait -> the ops the clock had stepped when it was taken out
    fresh, held = [], set()     # taken out since the last op; held past an op
    ends: list[tuple[float, int, str]] = []   # held: (its collective's end, taken, wait), a heap
    dues: list[tuple[int, int, str]] = []     # held: (its earliest successor, taken, wait), a heap
    overlapped, over = set(), set()           # launches: a wait went past an op; put back for the budget
    plan = []
    for i, name in enumerate(names):
        if name in launch_of:
            taken[name], stepped[name] = len(taken), i - len(taken)
            fresh.append(name)
            continue
        t = clock.t if stays[i] else -inf   # past its end: only before an op that stays
        if fresh or held and ((ends and ends[0][0] <= t) or (dues and dues[0][0] <= i) or level + rise[i] > limit):
            back = set()
            while ends and ends[0][0] <= t:
                back.add(heappop(ends)[2])
            while dues and dues[0][0] <= i:
                back.add(heappop(dues)[2])
            back &= held   # each heap holds every held wait, and some that went back already
            back.update(w for w in fresh if clock.ends[launch_of[w]] <= t or due[w] <= i)
            # held past this op, they must fit the budget up to the next op that stays put
            gone = Counter(map(launch_of.get, back))
            peak = level + rise[i] - sum(nbytes[la] for la, k in gone.items() if k == left[la])
            if peak > limit:
                rest = [w for w in (*held, *fresh) if w not in back] if stays[i] else [w for w in fresh if w not in back]
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
        level += nbytes.get(name, 0)
        s = step_of(node[name]["op"], ms.get(name, 0.0))
        if s[0] != OTHER or s[1]:  # an op that is not a collective and costs nothing steps no clock
            clock.step(name, s)
    overlapped -= over
    return plan, {"overlapped": len(overlapped), "over budget": len(over),
                  "in place": len(launches) - len(overlapped) - len(over)}
