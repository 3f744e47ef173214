"""unorder-reduce-scatters: let FSDP's gradient reduce-scatters of one group run in any order among themselves.

`collective-order` keeps the collectives of a process group in their traced order, so a
reduce-scatter whose gradient is ready early queues behind one traced before it whose gradient
comes last (encoder L2: Inductor launches RS_27 and RS_25 before RS_26 and hides RS_27; no
order the rule allows can). The order of one group's collectives only has to be the same on
every rank, and fxsched's passes are deterministic on the same graph, as they are for the
gathers, which keep no collective order at all. This pass marks every FSDP gradient
reduce-scatter of a known group (role `fsdp_reduce_scatter`) `unordered` through
`Rewriter.unorder`, which redoes the `collective-order` edges of its group: the marked ones keep
their place among the group's other collectives (all-reduces, tensor-parallel ones, opaque
ones, those of unknown group), not among themselves. Legality stays in the edges: the passes
after it (`overlap-reduce-scatter` hoists each launch to its gradient, `gradients-first`) move
what the edges allow. It moves nothing itself.

Opt-in, in no built-in pipeline: it is right only where every rank runs the same graph through
the same pipeline (check with `runtime.agreement.check_ranks_agree`), as fxsched's ordering of
the gathers already is.
"""

from __future__ import annotations

import dataclasses

from ..cost.model import CostAnalysis
from ..ir import Launch, Program, Role
from ..ir.rewriter import Rewriter
from .base import ModulePass, PassContext, PassResult, register_pass
from .gathers import GatherAnalysis


@register_pass
@dataclasses.dataclass(frozen=True)
class UnorderReduceScatters(ModulePass):
    name = "unorder-reduce-scatters"
    preserves = (GatherAnalysis, CostAnalysis)  # no op moves, appears or goes
    reorders_only = False  # it rewires effect edges: the manager re-verifies it in full

    def apply(self, ctx: PassContext, program: Program) -> PassResult:
        picked, unknown_group = [], 0
        for op in program.ops():
            if isinstance(op, Launch) and op.role is Role.REDUCE_SCATTER:
                if op.may_unorder:
                    picked.append(op.name)
                else:  # of unknown group: it stays ordered against every group
                    unknown_group += 1
        already = sum(program.op(n).unordered for n in picked)
        marked = Rewriter(program).unorder(picked)
        return PassResult(marked > 0, {"unordered": marked, "already unordered": already,
                                       "unknown group": unknown_group})
