"""Which waits complete a launch: its one wait, or a coalesced launch's wait per result.

A coalesced launch's results are views of it (FX's getitems), each read by one wait that names
the launch (`Wait.launch`); every other launch is read by its one wait directly. Passes and the
simulator ask here rather than looking for a wait among the launch's users.
"""

from __future__ import annotations

from .ops import View, Wait
from .program import DATA, Program


def waits_of(program: Program, launch: str) -> list[str]:
    """The waits that complete `launch`: its direct wait, or a coalesced launch's waits (in no
    particular order), found through its result views."""
    node, succ = program.node_data, program.successors
    found = []
    for user, edge in succ[launch].items():
        if edge["kind"] != DATA:
            continue
        op = node[user]["op"]
        if isinstance(op, Wait):
            found.append(user)
        elif isinstance(op, View):
            found += [w for w, e in succ[user].items()
                      if e["kind"] == DATA and isinstance(w_op := node[w]["op"], Wait) and w_op.launch == launch]
    return found


def result_views(program: Program, launch: str) -> list[str]:
    """A coalesced launch's result views (the getitems its waits read); empty for any other launch."""
    node, succ = program.node_data, program.successors
    return [user for user, edge in succ[launch].items() if edge["kind"] == DATA and isinstance(node[user]["op"], View)
            and any(e["kind"] == DATA and getattr(node[w]["op"], "launch", None) == launch for w, e in succ[user].items())]
