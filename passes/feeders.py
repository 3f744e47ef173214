"""Feeders analysis: what travels with a launch (`Program.private_feeders` of kind View).

hide times each reduce-scatter from just after its feeders' other predecessors, and
overlap-reduce-scatter hoists it with them: both ask for the same launches, and the feeders
are read off the graph's edges, which the scheduling passes leave as they are. Each is found on
first ask and kept, so the second pass reads none of those edges again (a cache miss or more
per node read at 100k nodes).
"""

from __future__ import annotations

from ..ir import Program, View
from .base import Analysis


class Feeders(Analysis):
    def __init__(self, program: Program):
        self._program = program
        self._found: dict[str, frozenset[str]] = {}

    @classmethod
    def compute(cls, program: Program, ctx=None) -> Feeders:
        return cls(program)

    def of(self, launch: str) -> frozenset[str]:
        """`launch` and the views that feed only it, directly or through each other."""
        found = self._found.get(launch)
        if found is None:
            found = self._found[launch] = frozenset(self._program.private_feeders(launch, (View,)))
        return found

    def __eq__(self, other) -> bool:
        # a kept one against a fresh one: the same for every launch either was asked about
        return isinstance(other, Feeders) and all(
            self.of(name) == other.of(name) for name in self._found.keys() | other._found.keys())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Feeders({len(self._found)} launches asked about)"
