"""The merge of a bucket: the ops that replace its members, built through the rewriter.

A gather bucket packs its members' shards into one buffer (`cat`), gathers it once and copies
each member out of the result: the gathered buffer is rank-major (rank 0's packed shards, then
rank 1's, ...), so it is viewed as [ranks, packed], each member's column band is cloned into a
contiguous [ranks, shard] tensor and flattened, which is exactly what the member's own gather
returned. A reduce-scatter bucket views each gradient as [ranks, shard], concatenates them along
the shard dimension (row r: every member's chunk for rank r, in member order), reduce-scatters
the flattened result once, and each member reads its slice of the reduced chunk, exactly what
its own reduce-scatter returned. Collectives work on dim 0, so a shard or gradient of any rank
is flattened first (a reshape) and each member's result viewed back to its own shape.

The pass (passes/bucket.py) merges with `merge`; its trials (passes/bucket_trials.py) build a
candidate's ops with the same builders, so what is priced is what is made.
"""

from __future__ import annotations

import attrs

from ..ir import Compute, CopyOut, Launch, Phase, Program, TensorType, View, Wait
from ..ir.rewriter import Call, Operand, Rewriter, RewriteError

GATHER_OP = "all_gather_into_tensor.default"
REDUCE_SCATTER_OP = "reduce_scatter_tensor.default"
WAIT_OP = "wait_tensor.default"


@attrs.frozen
class Member:
    launch: str
    wait: str
    source: str        # what it gathers or reduces (its one operand)
    cast: str | None   # a gather's private cast of its shard, hoisted with it
    numel: int         # its shard's elements (a gather's input, a reduce-scatter's output)
    nbytes: int        # the collective's bytes (gathered output, reduce-scatter input)
    shape: tuple[int, ...]  # the collective's result


def merge(program: Program, members: list[Member], kind: str, name: str, rewriter=None) -> list[str]:
    """Replace `members` by one bucket named `name`; returns the created ops' names. Raises
    RewriteError where the bucket would cross an effect edge: check first with a `DryRun` as
    the rewriter (which changes nothing), as the program is half rewritten when it raises."""
    rewriter = rewriter or Rewriter(program)
    if kind == "gather":
        created = _merge_gathers(program, rewriter, members, name)
    else:
        created = _merge_reduce_scatters(program, rewriter, members, name)
    for m in members:
        rewriter.erase(m.wait)
        rewriter.erase(m.launch)
    return created


def _merge_gathers(program: Program, rw: Rewriter, members: list[Member], name: str) -> list[str]:
    first = program.op(members[0].launch)
    phase = first.phase
    skip = {n for m in members for n in (m.launch, m.wait)}
    # every member's shard (or its private cast) is ready where the first member launches
    for m in members[1:]:
        if m.cast is not None:
            rw.hoist(m.cast, before=first.name)
    flats = [flat_source(program, rw, m.source, f"{name}_in{i}", phase, before=first.name)
             for i, m in enumerate(members)]
    here = min((m.wait for m in members), key=program.schedule.index)
    wait_op = program.op(here)
    (pack, pack_call), (launch, launch_call), (wait, wait_call), (grid, grid_call) = gather_bucket_ops(
        name, first, wait_op, flats, sum(m.numel for m in members), sum(m.nbytes for m in members),
        tuple(p for m in members for p in program.op(m.launch).params))
    rw.create(pack, before=first.name, payload=pack_call)
    rw.create(launch, before=first.name, payload=launch_call)
    for m in members:
        rw.inherit(m.launch, launch.name, skip=skip)
    # the copy-outs of every member follow the bucket's one wait
    rw.create(wait, before=here, payload=wait_call)
    rw.create(grid, before=here, payload=grid_call)
    sources = {m.source for m in members}
    created = [*(f for f in flats if f not in sources), pack.name, launch.name, wait.name,
               grid.name]
    offset = 0
    for i, m in enumerate(members):
        band, copy, flat = (rw.create(op, before=here, payload=payload)
                            for op, payload in member_outputs(name, i, m, offset, wait_op.phase,
                                                              first.types[0].dtype, first.group_size))
        rw.inherit(m.wait, flat.name, skip=skip)
        rw.replace_uses(m.wait, flat.name)
        created += [band.name, copy.name, flat.name]
        offset += m.numel
    return created


def gather_bucket_ops(name: str, first: Launch, wait_op: Wait, sources: list[str], total: int, nbytes: int,
                      params: tuple) -> list[tuple]:
    """A gather bucket's own ops, each with its payload: the pack of `sources` (`total` elements)
    and the launch, made before its first member's launch `first`; the wait and the grid (the
    gathered buffer viewed as [ranks, total]), made before the wait `wait_op`."""
    ranks, dtype, phase = first.group_size, first.types[0].dtype, first.phase
    pack = _compute(f"{name}_pack", sources, phase, TensorType(dtype, (total,)), "aten.cat.default")
    launch = Launch(name=name, operands=(pack.name,), phase=phase, target=first.target,
                    types=(TensorType(dtype, (ranks * total,)),), group=first.group, group_size=ranks,
                    role=first.role, nbytes=nbytes, params=params, bucket=name, prefetched=first.prefetched,
                    anchor=first.anchor)
    wait = _wait_op(launch, wait_op)
    grid = View(name=f"{name}_grid", operands=(wait[0].name,), phase=wait_op.phase, target="aten.view.default",
                types=(TensorType(dtype, (ranks, total)),))
    return [(pack, Call("aten.cat.default", (_operands(len(sources)),))),
            (launch, Call(first.target, (Operand(0), ranks, first.group))),
            wait,
            (grid, Call("aten.view.default", (Operand(0), [ranks, total])))]


def member_outputs(name: str, i: int, m: Member, offset: int, phase: Phase, dtype, ranks: int) -> list[tuple]:
    """Member i's ops after the bucket's wait, each with its payload: its band of the grid
    (columns `offset` on), the copy-out of that band and the view of it as the member's result."""
    # clone keeps the strides of a dense input only: a column band is not dense, so the copy is
    # contiguous (rank-major, as the member's own gather) and views as flat
    band = View(name=f"{name}_band{i}", operands=(f"{name}_grid",), phase=phase, target="aten.slice.Tensor",
                types=(TensorType(dtype, (ranks, m.numel)),))
    copy = CopyOut(name=f"{name}_copy{i}", operands=(band.name,), phase=phase, target="aten.clone.default",
                   bucket=name, types=(TensorType(dtype, (ranks, m.numel)),))
    out = View(name=f"{name}_out{i}", operands=(copy.name,), phase=phase, target="aten.view.default",
               types=(TensorType(dtype, m.shape),))
    return [(band, Call("aten.slice.Tensor", (Operand(0), 1, offset, offset + m.numel))),
            (copy, Call("aten.clone.default", (Operand(0),))),
            (out, Call("aten.view.default", (Operand(0), list(m.shape))))]


def _merge_reduce_scatters(program: Program, rw: Rewriter, members: list[Member], name: str) -> list[str]:
    pos = program.schedule.index
    last = program.op(max((m.launch for m in members), key=pos))
    ranks, dtype, phase = last.group_size, last.types[0].dtype, last.phase
    total = sum(m.numel for m in members)
    skip = {n for m in members for n in (m.launch, m.wait)}
    # unordered members (unorder-reduce-scatters) make an unordered bucket, which their relaxed
    # collective-order edges fit; a bucket of ordered and unordered ones would need edges to the
    # other unordered ones that none of its members has
    unordered = {program.op(m.launch).unordered for m in members}
    if len(unordered) > 1:
        raise RewriteError(f"bucket %{name}: its reduce-scatters differ in collective order (unordered or not)")
    created = []
    rows = []
    for i, m in enumerate(members):
        # reshape: a gradient that is not contiguous is copied (never wrongly viewed)
        row = rw.create(View(name=f"{name}_rows{i}", operands=(m.source,), phase=phase, target="aten.reshape.default",
                             types=(TensorType(dtype, (ranks, m.numel)),)),
                        before=last.name, payload=Call("aten.reshape.default", (Operand(0), [ranks, m.numel])))
        rows.append(row.name)
    # row r of the pack: every member's chunk for rank r, in member order
    pack = rw.create(_compute(f"{name}_pack", rows, phase, TensorType(dtype, (ranks, total)), "aten.cat.default"),
                     before=last.name,
                     payload=Call("aten.cat.default", (_operands(len(rows)), 1)))
    flat = rw.create(View(name=f"{name}_flat", operands=(pack.name,), phase=phase, target="aten.view.default",
                          types=(TensorType(dtype, (ranks * total,)),)),
                     before=last.name, payload=Call("aten.view.default", (Operand(0), [ranks * total])))
    launch = rw.create(Launch(name=name, operands=(flat.name,), phase=phase, target=last.target,
                              types=(TensorType(dtype, (total,)),), group=last.group, group_size=ranks,
                              role=last.role, reduce_op=last.reduce_op, bucket=name, unordered=unordered.pop(),
                              params=tuple(p for m in members for p in program.op(m.launch).params)),
                       before=last.name, payload=Call(last.target, (Operand(0), last.reduce_op, ranks, last.group)))
    created += [*rows, pack.name, flat.name, launch.name]
    for m in members:
        rw.inherit(m.launch, launch.name, skip=skip)
    here, wait_op, wait = _wait(program, rw, members, launch)
    created.append(wait.name)
    offset = 0
    for i, m in enumerate(members):
        out = rw.create(View(name=f"{name}_out{i}", operands=(wait.name,), phase=wait_op.phase,
                             target="aten.slice.Tensor", types=(TensorType(dtype, (m.numel,)),)),
                        before=here, payload=Call("aten.slice.Tensor", (Operand(0), 0, offset, offset + m.numel)))
        created.append(out.name)
        if len(m.shape) != 1:  # a contiguous slice: it views as the member's own result
            out = rw.create(View(name=f"{name}_shape{i}", operands=(out.name,), phase=wait_op.phase,
                                 target="aten.view.default", types=(TensorType(dtype, m.shape),)),
                            before=here, payload=Call("aten.view.default", (Operand(0), list(m.shape))))
            created.append(out.name)
        rw.inherit(m.wait, out.name, skip=skip)
        rw.replace_uses(m.wait, out.name)
        offset += m.numel
    return created


def _wait(program: Program, rw: Rewriter, members: list[Member], launch: Launch) -> tuple[str, Wait, Wait]:
    """The bucket's one wait, created where the first member was waited after the bucket
    launches (where its last member launched): (that member's wait, its op, the new wait). What
    the members' waits returned is rebuilt just after it. A member waited before the bucket
    launches (overlap-reduce-scatter waits each as soon as its collective ends) is so waited
    later; the rewriter refuses the bucket where a user or effect successor of that wait comes
    before the new one."""
    pos = program.schedule.index
    launched = max(pos(m.launch) for m in members)
    here = min((m.wait for m in members if pos(m.wait) > launched), key=pos)
    wait_op = program.op(here)
    wait, payload = _wait_op(launch, wait_op)
    return here, wait_op, rw.create(wait, before=here, payload=payload)


def _wait_op(launch: Launch, wait_op: Wait) -> tuple[Wait, Call]:
    """The wait of a bucket's `launch`, as its member's `wait_op` (where it is made), with its payload."""
    return (Wait(name=f"{launch.name}_wait", operands=(launch.name,), phase=wait_op.phase, target=wait_op.target,
                 types=launch.types),
            Call(wait_op.target, (Operand(0),)))


def flat_source(program: Program, rw: Rewriter, source: str, name: str, phase: Phase, *, before: str) -> str:
    """`source` as a flat tensor: itself when it is one, else a reshape of it (a view when it is
    contiguous, a copy when not: never a wrong view)."""
    (t,) = program.op(source).types
    if len(t.shape) == 1:
        return source
    rw.create(View(name=name, operands=(source,), phase=phase, target="aten.reshape.default",
                   types=(TensorType(t.dtype, (t.numel,)),)),
              before=before, payload=Call("aten.reshape.default", (Operand(0), [t.numel])))
    return name


#: Operand(0), Operand(1), ...: frozen, so one of each is shared by every payload (a growing
#: bucket's trial builds its pack's payload again: one Operand per member each time)
_OPERAND_CACHE: list[Operand] = []


def _operands(n: int) -> list[Operand]:
    """[Operand(0), ..., Operand(n - 1)] (a new list of shared operands)."""
    cache = _OPERAND_CACHE
    if len(cache) < n:
        cache.extend(Operand(i) for i in range(len(cache), n))
    return cache[:n]


def _compute(name: str, operands: list[str], phase: Phase, type_: TensorType, target: str) -> Compute:
    return Compute(name=name, operands=tuple(operands), phase=phase, types=(type_,), target=target)
