"""bucket_dryrun: `DryRun`, the rewriter's checks of a bucket merge without the rewrite
(passes/bucket_trials.py prices each candidate bucket through one).
"""

from __future__ import annotations

import math

from ..ir import EFFECT, Free, Program, View, Wait
from ..ir.storage import storage_readers, storage_root
from ..ir.rewriter import RewriteError


class DryRun:
    """The rewriter's checks of a merge without the rewrite: what `merge` would create (`before`:
    anchor -> [op], in order), hoist and erase, raising RewriteError where the rewriter would.

    New ops sit just before an existing anchor, so an existing op is before a new one exactly
    when it is before its anchor; a hoisted op sits before them all."""

    def __init__(self, program: Program, cache: dict | None = None):
        self.program = program
        self.pos = program.schedule.index
        # storage roots and readers of existing ops, shared by the trials of one run (the ops a
        # trial reads are its members', which no other bucket of the run touches)
        self.cache = {} if cache is None else cache
        self.anchor: dict[str, str] = {}           # new op -> the existing op it is created before
        self.before: dict[str, list] = {}          # anchor -> [(op, payload)]
        self.hoisted: dict[str, str] = {}          # op -> the anchor it moves before
        self.erased: list[str] = []
        self.ops: dict[str, object] = {}           # new op name -> op
        self.readers: dict[str, tuple] = {}        # new storage -> (first free, last other read) of it

    def _at(self, name: str) -> float:
        """A position to compare with an existing op's: a new or hoisted op's is just before its anchor."""
        if name in self.anchor:
            return self.pos(self.anchor[name]) - 0.5
        if name in self.hoisted:
            return self.pos(self.hoisted[name]) - 0.75
        return self.pos(name)

    def create(self, op, *, before: str, payload=None):
        for operand in op.operands:
            self.check_operand(op.name, operand, before)
        self.anchor[op.name] = before
        self.ops[op.name] = op
        self.before.setdefault(before, []).append((op, payload))
        return op

    def check_operand(self, name: str, operand: str, before: str) -> None:
        """What `create` checks of each operand of a new op `name` created before `before`."""
        if operand not in self.anchor and operand not in self.program.graph:
            raise RewriteError(f"create(%{name}): operand %{operand} is not defined")
        if operand in self.anchor and self.pos(self.anchor[operand]) > self.pos(before):
            raise RewriteError(f"create(%{name}): operand %{operand} is not scheduled before %{before}")
        if operand not in self.anchor and self._at(operand) >= self.pos(before):
            raise RewriteError(f"create(%{name}): operand %{operand} is not scheduled before %{before}")
        if operand not in self.anchor:  # a read of existing storage after a free of it
            for a in self._frees_of(operand):
                if self._at(a) < self.pos(before):
                    raise RewriteError(f"%{name} would read storage that %{a} frees before it")

    def hoist(self, name: str, *, before: str) -> None:
        program = self.program
        if not program.op(name).MOVABLE:
            raise RewriteError(f"hoist(%{name}): {program.op(name).KIND} ops do not move")
        if self.pos(name) < self.pos(before):
            return
        for p, e in program.graph._pred[name].items():
            if self._at(p) >= self.pos(before):
                raise RewriteError(f"hoist(%{name}) before %{before}: it follows %{p}")
        self.hoisted[name] = before

    def inherit(self, old: str, new: str, *, skip=frozenset()) -> None:
        graph, at = self.program.graph, self._at(new)
        for p, e in graph._pred[old].items():
            if e["kind"] == EFFECT and p not in skip and p != new and self._at(p) >= at:
                raise RewriteError(f"%{new} would run before %{p}, which %{old} follows ({e['why']})")
        for s_, e in graph._succ[old].items():
            if e["kind"] == EFFECT and s_ not in skip and s_ != new and self._at(s_) <= at:
                raise RewriteError(f"%{new} would run after %{s_}, which follows %{old} ({e['why']})")

    def replace_uses(self, old: str, new: str) -> None:
        """The users of `old` read `new`: they come after it, and no free of `new`'s storage (a
        free of any storage that now is `new`'s) comes before another of its readers."""
        program = self.program
        at = self._at(new)
        key = ("users", old)
        if key not in self.cache:
            self.cache[key] = program.users(old)
        for user in self.cache[key]:
            if at >= self.pos(user):
                raise RewriteError(f"replace_uses(%{old}, %{new}): %{new} is not scheduled before %{user}")
        root = new
        while root in self.ops and isinstance(self.ops[root], (View, Wait)) and self.ops[root].operands:
            root = self.ops[root].operands[0]
        first_free, last_read = self.readers.get(root, (math.inf, -math.inf))
        for a in self._readers(old):
            if isinstance(program.op(a), Free):
                first_free = min(first_free, self.pos(a))
            else:
                last_read = max(last_read, self.pos(a))
        self.readers[root] = (first_free, last_read)
        if first_free < last_read:
            raise RewriteError(f"a reader of %{new} would follow a free of its storage")

    def erase(self, name: str) -> None:
        self.erased.append(name)

    def _readers(self, name: str) -> set[str]:
        key = ("readers", name)
        if key not in self.cache:
            self.cache[key] = storage_readers(self.program, name)
        return self.cache[key]

    def _frees_of(self, name: str) -> list[str]:
        """The frees of `name`'s storage."""
        key = ("frees", name)
        if key not in self.cache:
            program = self.program
            root = storage_root(program, name)
            self.cache[key] = [a for a in storage_readers(program, root)
                               if isinstance(program.op(a), Free) and _frees(program, a, root)]
        return self.cache[key]


def _frees(program: Program, name: str, root: str) -> bool:
    op = program.op(name)
    return bool(op.operands) and storage_root(program, op.operands[0]) == root
