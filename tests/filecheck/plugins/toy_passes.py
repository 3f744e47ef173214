"""A pass from outside fxsched, as a user writes one (see docs/adding-a-pass.md).

`fxsched opt --load-pass-plugin tests/filecheck/plugins/toy_passes.py -p mark-heavy` runs it;
toy.fxir is its IR test.
"""

from __future__ import annotations

import dataclasses

import attrs

from fxsched.ir import Compute, Program
from fxsched.passes import ModulePass, PassContext, PassResult, option, register_pass


@register_pass
@dataclasses.dataclass(frozen=True)
class MarkHeavy(ModulePass):
    """Marks computes whose target is `target` as heavy (the anchor pass prefetches behind them)."""

    name = "mark-heavy"
    reorders_only = True  # it updates op attributes only: no ops or edges added or removed

    target: str = option("aten.mm", "computes with this target are marked heavy")

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        marked = 0
        for op in list(program.ops()):
            if isinstance(op, Compute) and op.target == self.target and not op.heavy:
                program.replace(attrs.evolve(op, heavy=True))
                marked += 1
        return PassResult(marked > 0, {"marked": marked})
