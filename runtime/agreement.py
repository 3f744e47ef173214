"""Do all ranks run the same collective schedule? A fingerprint of the collective order, and a
cross-rank check that fails with a clear error instead of a hang or wrong numbers.

Reordering collectives is safe only when every rank issues the same collectives in the same
order. Ranks that differ abort in gloo ("Received data size doesn't match expected size"),
hang, or — for collectives of the same size — silently exchange the wrong tensors. fxsched's
passes depend on nothing but the graph and the config, so ranks that start from the same graph
agree; `check_ranks_agree` checks it where that matters (a graph traced per rank, a pass
pipeline configured per rank).

    done = fxsched.schedule(gm)
    fingerprint(done.graph_module)       # sha256 hex of the collective order
    check_ranks_agree(done.graph_module) # in every rank, before running it

Where each rank traces its own sizes, `schedule(..., group=)` makes the ranks schedule one program
(`agree_sizes`) inside an `Agreement`: the ranks' statuses travel with the exchange, so where one
rank fails every rank of the group raises (`PeerFailure`) instead of waiting for it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

from ..ir import Launch, Opaque
from ..ir import tags
from ..ir.opclass import COLLECTIVE_NAMESPACES
from ..lowering.fx import value_types
from ..lowering.targets import collective_overload, synchronous_collective, target_name

__all__ = ["Agreement", "PeerFailure", "PlanMismatch", "ScheduleMismatch", "StructureMismatch", "agree_sizes",
           "check_ranks_agree", "collective_entries", "compare_entries", "cost_key", "describe", "fingerprint",
           "in_mesh_terms", "process_group"]

_VERSION = "fxsched-collectives-v2"
_NAMESPACES = (*COLLECTIVE_NAMESPACES, "c10d")  # ir's, and the c10d ops a make_fx of torch.distributed keeps
_GATHER_TAGS = (tags.ALL_GATHER, tags.ALL_GATHER_BACKWARD)
_ROLES = (*_GATHER_TAGS, tags.REDUCE_SCATTER)
#: collectives whose sizes are each rank's own: an all-to-all with split sizes (expert
#: parallelism) receives another number of tokens on each rank, a send or receive moves what its
#: peer pair agrees on, DTensor's all-to-all may shard unevenly. Their extents are left out of the
#: entry's type (dtype and rank count stay): counted, ranks whose schedules agree were told they
#: differ (the all-to-all, `f32[650,256]` against `f32[550,256]`).
_RANK_SIZED = frozenset({"all_to_all_single", "isend", "irecv", "batch_p2p_ops", "shard_dim_alltoall"})


class ScheduleMismatch(RuntimeError):
    """Ranks would issue different collectives, or the same ones in a different order.

    `ranks`: the ranks (in the group) whose schedule differs from the majority's, `agreeing`:
    the majority, `index`: the position of the first collective that differs, `digests`: every
    rank's fingerprint, `expected`/`found`: the collective at `index` on the majority and on
    the first differing rank (None past the end of a rank's list).
    """

    def __init__(self, message: str, *, ranks: list[int], agreeing: list[int], index: int,
                 digests: list[str], expected: dict | None, found: dict | None):
        super().__init__(message)
        self.ranks, self.agreeing, self.index = ranks, agreeing, index
        self.digests, self.expected, self.found = digests, expected, found


# ---- what a collective is -------------------------------------------------------------------

def _schema(node: fx.Node):
    """The schema of a call's op; a functional collective called by its packet (dynamo), its one
    overload's, as lowering reads it."""
    return getattr(collective_overload(node.target) or node.target, "_schema", None)


def _fx_collective(node: fx.Node) -> bool:
    schema = _schema(node) if node.op == "call_function" else None
    if schema is None:
        return False
    namespace, _, name = schema.name.partition("::")
    return (namespace in _NAMESPACES and not name.startswith("wait")) or synchronous_collective(schema)


def _fx_arg(node: fx.Node, name: str):
    schema = _schema(node)
    for arg, value in zip(schema.arguments, node.args):
        if arg.name == name:
            return value
    return node.kwargs.get(name)


def _names(value) -> list[str] | None:
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _type_text(kind: str, types) -> str:
    """The result types as the entry shows them; a rank-sized collective's without extents."""
    parts = kind.replace("::", ".").split(".")
    if len(parts) > 1 and parts[1] in _RANK_SIZED:
        return ", ".join(f"{t.dtype}[{','.join('?' * len(t.shape))}]" for t in types) or "?"
    return ", ".join(str(t) for t in types) or "?"


def _fx_entry(node: fx.Node) -> dict[str, Any]:
    meta = node.meta
    comm_type = meta.get(tags.COMM_TYPE)
    role = comm_type if comm_type in _ROLES else None
    params: list[str] = []
    if comm_type in _GATHER_TAGS:  # as lowering reads them: a bucket's members, else the parameter
        if meta.get(tags.BUCKET_ID) is not None:
            params = _names(meta.get(tags.BUCKET_MEMBERS)) or []
        else:
            params = _names(meta.get(tags.PARAM_NAME)) or []
    group = _fx_arg(node, "group_name")
    size = _fx_arg(node, "group_size")
    kind = target_name(node)
    return {
        "kind": kind,
        "group": None if group is None else str(group),
        "group_size": size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None,
        "type": _type_text(kind, value_types(node)),
        "role": role,
        "params": params,
    }


def _ir_entry(op) -> dict[str, Any]:
    role = getattr(op, "role", None)  # an opaque collective has no role and realises no parameter
    return {
        "kind": op.target,
        "group": op.group,
        "group_size": op.group_size,
        "type": _type_text(op.target, op.types),
        "role": None if role is None else role.value,
        "params": list(getattr(op, "params", ())),
    }


def _ir_collective(op) -> bool:
    """A launch, or an opaque collective (coalesced, not waited exactly once) — not an opaque
    wait: ranks must agree on those as on every other collective, as the FX side counts them."""
    if isinstance(op, Launch):
        return True
    if not isinstance(op, Opaque):
        return False
    parts = op.target.replace("::", ".").split(".")
    name = parts[1] if len(parts) > 1 and parts[0] in _NAMESPACES else parts[0]
    return not name.startswith("wait")


def collective_entries(graph_or_program) -> list[dict[str, Any]]:
    """The collectives of a GraphModule (or fx.Graph), or of a Program, in schedule order.

    Each entry: `index` (position in the collective order), `kind` (the op), `group` and
    `group_size`, `type` (result dtype and shape, `?` when unknown), `role` (the FSDP
    `comm_type`, if any) and `params` (the parameter names an FSDP gather realises). Waits are
    not collectives of their own. A lowered Program reads its FX nodes, so it gives the same
    entries as the GraphModule raised from it; a parsed one reads its launch ops. Node meta
    (`val`, tags) is what tells sizes and names apart: a GraphModule that lost it (pickled)
    still fingerprints kinds, groups and order.
    """
    entries = []
    if isinstance(graph_or_program, (fx.GraphModule, fx.Graph)):
        graph = graph_or_program.graph if isinstance(graph_or_program, fx.GraphModule) else graph_or_program
        entries = [_fx_entry(n) for n in graph.nodes if _fx_collective(n)]
    elif hasattr(graph_or_program, "schedule") and hasattr(graph_or_program, "op"):
        program = graph_or_program
        payload = getattr(program, "payload", None) or {}
        for name in program.schedule:
            node = payload.get(name)
            if isinstance(node, fx.Node):
                if _fx_collective(node):
                    entries.append(_fx_entry(node))
            elif _ir_collective(program.op(name)):
                entries.append(_ir_entry(program.op(name)))
    else:
        raise TypeError(f"fingerprint takes a GraphModule, an fx.Graph or a Program, not {type(graph_or_program).__name__}")
    return [{"index": i, **e} for i, e in enumerate(entries)]


def _digest(entries: Sequence[dict[str, Any]]) -> str:
    text = json.dumps([_VERSION, *entries], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def fingerprint(graph_or_program) -> str:
    """sha256 (hex) of the ordered collective list of `collective_entries`: equal on every rank
    exactly when the ranks issue the same collectives in the same order."""
    return _digest(collective_entries(graph_or_program))


# ---- comparing ranks ------------------------------------------------------------------------

def describe(entry: dict[str, Any] | None) -> str:
    """One collective as a person reads it."""
    if entry is None:
        return "no collective (its list ends here)"
    parts = [entry["kind"], f"group {entry['group']!r}"]
    if entry["group_size"] is not None:
        parts.append(f"of {entry['group_size']}")
    parts.append(entry["type"])
    if entry["role"]:
        parts.append(entry["role"])
    if entry["params"]:
        parts.append("params " + ", ".join(entry["params"]))
    return " ".join(parts)


def _first_difference(per_rank: Sequence[Sequence[Any]], digests: list[str]):
    """Where ranks' lists (of collectives, of program lines) disagree, given each list's digest:
    (agreeing, differing, index, rank, expected, found) — the ranks with the majority's digest
    (ties: the side of the lowest rank) and the others, the first position `index` where one of
    the others differs and the lowest such `rank`, and the item there on the majority's list and on
    that rank's (None past a list's end). Some digest must differ."""
    counts = Counter(digests)
    reference = max(counts, key=lambda d: (counts[d], -digests.index(d)))
    agreeing = [r for r, d in enumerate(digests) if d == reference]
    differing = [r for r, d in enumerate(digests) if d != reference]
    expected_list = per_rank[agreeing[0]]

    def first_difference(items) -> int:
        for i, (a, b) in enumerate(zip(expected_list, items)):
            if a != b:
                return i
        return min(len(expected_list), len(items))

    index, rank = min((first_difference(per_rank[r]), r) for r in differing)
    found_list = per_rank[rank]
    expected = expected_list[index] if index < len(expected_list) else None
    found = found_list[index] if index < len(found_list) else None
    return agreeing, differing, index, rank, expected, found


def compare_entries(per_rank: Sequence[Sequence[dict[str, Any]]]) -> ScheduleMismatch | None:
    """None when every rank's collective list is the same; else the error naming the ranks that
    differ from the majority (ties: the side of the lowest rank) and the first differing collective."""
    digests = [_digest(entries) for entries in per_rank]
    if len(set(digests)) == 1:
        return None
    agreeing, differing, index, rank, expected, found = _first_difference(per_rank, digests)
    expected_list, found_list = per_rank[agreeing[0]], per_rank[rank]
    shown = ", ".join(f"rank {r} {d[:12]}" for r, d in enumerate(digests))
    message = (
        f"ranks disagree on the collective schedule: rank{'s' if len(differing) > 1 else ''} "
        f"{', '.join(map(str, differing))} differ{'' if len(differing) > 1 else 's'} from rank"
        f"{'s' if len(agreeing) > 1 else ''} {', '.join(map(str, agreeing))} "
        f"(fingerprints: {shown}).\n"
        f"  first difference at collective #{index}:\n"
        f"    rank {agreeing[0]}: {describe(expected)}\n"
        f"    rank {rank}: {describe(found)}\n"
        f"  ({len(expected_list)} vs {len(found_list)} collectives.) Running these schedules together "
        "would hang or exchange the wrong tensors: give every rank the same graph and the same "
        "pass configuration."
    )
    return ScheduleMismatch(message, ranks=differing, agreeing=agreeing, index=index, digests=digests,
                            expected=expected, found=found)


def _device(group, device):
    """`device` where given; else where the exchanged tensors live: the current CUDA device with NCCL, else CPU."""
    if device is not None:
        return device
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _all_gather_bytes(data: bytes, group, device) -> list[bytes]:
    """Every rank's `data`, in group rank order, through fixed-size tensor all-gathers (no
    pickling, no numpy): the lengths first, then the bytes padded to the longest."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = max(int(n.item()) for n in lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    if data:
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    padded = padded.to(device)
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return [bytes(t[:int(n.item())].cpu().tolist()) for t, n in zip(gathered, lengths)]


def _members(group_name: str) -> list[int] | None:
    """The global ranks of the process group registered as `group_name` in this process (None
    when none is, or it cannot be resolved)."""
    try:
        pg = dist.distributed_c10d._resolve_process_group(group_name)
        return sorted(dist.get_process_group_ranks(pg))
    except Exception:  # an unregistered name (a traced graph's fake group), a backend without ranks
        return None


def _place(members: list[int]) -> str:
    """A group as the same group of every rank's mesh sees it: its size and the steps between its
    sorted ranks (a 2x2 mesh's dp groups {0,2} and {1,3}: "2 ranks, step 2"; its tp groups: step 1)."""
    steps = sorted({b - a for a, b in zip(members, members[1:])})
    if len(steps) <= 1:
        return f"{len(members)} ranks, step {steps[0] if steps else 0}"
    return f"{len(members)} ranks, steps {[b - a for a, b in zip(members, members[1:])]}"


def in_mesh_terms(entries: Sequence[dict[str, Any]], members=_members) -> list[dict[str, Any]]:
    """`entries` with each group named by its place in the mesh (`_place`) instead of this rank's
    name for it, where that place tells it apart from this rank's other groups; a group whose
    ranks are unknown (`members(name)` None), or which shares its place with another of this
    rank's groups (two groups over the same ranks), keeps its name.

    On a device mesh each rank names its groups otherwise (a 2x2 mesh's rank 0: dp "1", tp "3";
    rank 1: dp "2", tp "3"), so lists that name them differ on ranks whose schedules agree. Named
    by place, the groups of every rank map one to one onto places (on each rank no two groups share
    a label), and a group two ranks share gets the same label on both: lists equal in these terms
    issue each group's collectives in the same order on each of its ranks, interleaved with the
    other groups' alike, which can neither hang nor exchange the wrong tensors."""
    names = sorted({e["group"] for e in entries if e["group"] is not None})
    places = {}
    for name in names:
        ranks = members(name)
        if ranks is not None:
            places[name] = _place(ranks)
    shared = Counter(places.values())
    label = {name: f"<{place}>" for name, place in places.items() if shared[place] == 1}
    return [{**e, "group": label.get(e["group"], e["group"])} for e in entries]


def check_ranks_agree(graph_or_program, group: dist.ProcessGroup | None = None, *,
                      device: torch.device | str | None = None) -> str:
    """Check that every rank of `group` (default: the world) has the same collective schedule.

    Every rank of the group must call it: it is a collective itself (two small all-gathers of
    the fingerprint, two more of the collective lists only when the fingerprints differ).
    Returns the common fingerprint, or raises ScheduleMismatch on every rank, naming the ranks
    that differ and the first collective where they do. Ranks are numbered within `group`.
    Where the ranks name their groups otherwise (a device mesh: each rank's dp and tp groups have
    names of their own), each group is compared by its place in the mesh (`in_mesh_terms`), and
    the fingerprint returned is of the lists so named.
    `device` holds the exchanged tensors: CPU, or with NCCL the current CUDA device (default).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("check_ranks_agree needs an initialised torch.distributed process group "
                           "(call it in every rank, after init_process_group)")
    device = _device(group, device)
    entries = collective_entries(graph_or_program)
    digest = _digest(entries)
    digests = [d.decode() for d in _all_gather_bytes(digest.encode(), group, device)]
    if all(d == digest for d in digests):
        return digest
    # every rank takes the same branches: each decision reads what all ranks sent
    entries = in_mesh_terms(entries)
    digest = _digest(entries)
    digests = [d.decode() for d in _all_gather_bytes(digest.encode(), group, device)]
    if all(d == digest for d in digests):
        return digest
    lists = [json.loads(b) for b in _all_gather_bytes(json.dumps(entries).encode(), group, device)]
    mismatch = compare_entries(lists)
    if mismatch is None:  # equal lists with unequal digests: different fxsched versions
        raise ScheduleMismatch(f"ranks computed different fingerprints {digests} for equal collective "
                               "lists: do all ranks run the same fxsched?", ranks=[], agreeing=[],
                               index=-1, digests=digests, expected=None, found=None)
    raise mismatch


# ---- one program on every rank ----------------------------------------------------------------

class StructureMismatch(RuntimeError):
    """Ranks asked to agree (`agree_sizes`) lowered programs that differ in more than sizes: no
    schedule can be one for all of them. `ranks`: the ranks that differ from the majority,
    `agreeing`: the majority, `index`: the first line of `ir.sizes.structure` that differs (ops
    in schedule order, then effect edges), `expected`/`found`: that line on the majority and on
    the first differing rank (None past the end)."""

    def __init__(self, message: str, *, ranks: list[int], agreeing: list[int], index: int,
                 expected: str | None, found: str | None):
        super().__init__(message)
        self.ranks, self.agreeing, self.index = ranks, agreeing, index
        self.expected, self.found = expected, found


def _rank_sized(op) -> bool:
    parts = op.target.replace("::", ".").split(".")
    return len(parts) > 1 and parts[1] in _RANK_SIZED


def process_group(group):
    """The process group `group` names: a ProcessGroup, `"world"` (or `dist.group.WORLD`), or the
    name of a registered group (as collectives' `group_name`). None where nothing is to agree:
    `"world"` without an initialised torch.distributed, or a group of one rank."""
    if group is None:
        return None
    if isinstance(group, str):
        if group == "world":
            if not (dist.is_available() and dist.is_initialized()):
                return None
            group = dist.group.WORLD
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"process group {group!r}: torch.distributed is not initialised "
                                   "(call init_process_group in every rank first)")
            group = torch._C._distributed_c10d._resolve_process_group(group)
    elif not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("agreeing across ranks needs an initialised torch.distributed process group")
    return group if dist.get_world_size(group) > 1 else None


def agree_sizes(program, group, *, device: torch.device | str | None = None) -> dict[str, Any]:
    """Give every rank of `group` one program: after checking that the ranks' programs are equal
    but for their sizes (`StructureMismatch` otherwise, on every rank, naming the first op that
    differs), set every extent and launch size to its largest over the ranks, in place. Every
    rank then prices the same program with the same model, its deterministic passes give it the
    same order, and what the passes count in memory is at least what each rank holds, so a
    budget or peak cap holds on every rank. A collective whose sizes differ between the ranks
    (but for those whose sizes are each rank's own: an all-to-all with split sizes, a send or a
    receive) is an error too: the ranks could not run it together.

    Every rank of `group` must call it (it is a collective: two small all-gathers and an
    all-reduce of one int64 per extent; the programs' text only when they differ). `group` as
    `process_group` takes it; None or a group of one rank: nothing to do. A rank whose program
    cannot be read (its digest or sizes raise) still joins the first all-gather, with its error,
    and every other rank raises `PeerFailure` (`Agreement`). Returns what it did:
    `ranks`, `sizes` (how many it exchanged), `differ` (the ops whose sizes differ between the
    ranks, alike on every rank; a note of the program says how many) and `raised` (those this
    rank's program took larger sizes for)."""
    with Agreement(group, device=device, settles=False) as agreement:
        return agreement.agree(program)


# ---- failing together -------------------------------------------------------------------------

class PeerFailure(RuntimeError):
    """Another rank of the group failed while the ranks were agreeing on one schedule
    (`Agreement`): raised on the ranks that did not fail, so that none waits for the failed one.
    `ranks`: the ranks (in the group) that failed, `reasons`: each one's error, in a line. The
    failing ranks raise their own errors."""

    def __init__(self, message: str, *, ranks: list[int], reasons: list[str]):
        super().__init__(message)
        self.ranks, self.reasons = ranks, reasons


class PlanMismatch(RuntimeError):
    """The ranks of a group were asked to schedule with other pipelines or cost models (or the
    drop-in was enabled on some only): their deterministic passes would order the collectives
    otherwise. Raised on every rank. `ranks`: the ranks that differ from the majority, `plans`:
    every rank's (pipeline text and cost model)."""

    def __init__(self, message: str, *, ranks: list[int], plans: list[str]):
        super().__init__(message)
        self.ranks, self.plans = ranks, plans


_UNRESOLVED = object()
#: how much of a failed rank's error the others are told (its type and first line)
_REASON_CHARS = 400


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:_REASON_CHARS]


def cost_key(cost_model: Any) -> str:
    """A cost model as the ranks compare it: a profile name (or None) by name, a {target: ms}
    table by a digest of its items, anything else (a CostModel, a function) by its kind only: a
    function that reads the rank is not seen (README: give every rank the same model)."""
    if cost_model is None or isinstance(cost_model, (str, int, float)):
        return repr(cost_model)
    if isinstance(cost_model, dict):
        try:
            items = json.dumps(sorted((str(k), v) for k, v in cost_model.items()))
        except TypeError:
            pass
        else:
            return "table " + hashlib.sha256(items.encode()).hexdigest()[:16]
    return f"a {type(cost_model).__qualname__}"


class Agreement:
    """One schedule's agreement among the ranks of `group`, failures included.

    A context manager around all of one rank's work on one schedule (its options read, its graph
    lowered, the passes run), with two rendezvous inside, each a collective of every rank:
    `agree(program, pipeline=, cost_model=)` — every rank's status (ok, or failed with its error
    in a line), its program's structure digest and its plan (pipeline text and cost model) in one
    all-gather, then its sizes in one all-reduce — and `settle()` after the passes: every rank's
    status again. A rank that raises in the block before a rendezvous it owes joins that
    rendezvous with its error as it leaves the block, and then raises its own: so where one rank
    fails (a lowering error, a bad option, a pass) every rank of the group leaves with an error —
    the others with `PeerFailure`, naming the failed ranks and why — and none waits in a
    collective the failed rank never issues (or, worse, pairs it with that rank's next one).
    Errors that every rank raises from what all ranks sent (`PlanMismatch`, `StructureMismatch`,
    a collective of other sizes on the ranks, `PeerFailure`) owe nothing more.

    After `settle()` each rank raises its program (deterministic in the program the ranks agreed
    on: its failures, an fxsched bug, are alike on every rank). A rank that dies (a crash, a kill)
    joins nothing: the others wait for the group's timeout. `group` as `process_group` takes it
    (None, or one rank: nothing is exchanged). `settles=False` (`agree_sizes` alone): no settle
    follows `agree`."""

    def __init__(self, group, *, device: torch.device | str | None = None, settles: bool = True):
        self.group, self.device, self.settles = group, device, settles
        self._pg = _UNRESOLVED
        self._owed: str | None = "agree"  # the rendezvous this rank must still join: "agree", "settle" or None

    def __enter__(self) -> Agreement:
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, Exception) and self._owed is not None:
            self._owed = None
            try:
                statuses = self._rendezvous({"ok": False, "reason": _reason(exc)})
            except Exception as failed:  # the group itself is unusable here: this rank's error is what matters
                exc.add_note(f"fxsched could not tell the other ranks of the group ({_reason(failed)})")
            else:
                failed = [r for r, s in enumerate(statuses) if not s["ok"]]
                if len(failed) > 1:  # (so there is a group)
                    others = [r for r in failed if r != dist.get_rank(self._group())]
                    exc.add_note(f"ranks {others} of the group failed too: "
                                 + "; ".join(f"rank {r}: {statuses[r]['reason']}" for r in others))
        return False

    def _group(self):
        if self._pg is _UNRESOLVED:
            self._pg = process_group(self.group)
        return self._pg

    def _rendezvous(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's `message` (a status), in group rank order; one per rank where there is no group."""
        pg = self._group()
        if pg is None:
            return [message]
        self._owed = None  # a collective that fails is not joined again
        data = json.dumps(message, sort_keys=True).encode()
        return [json.loads(b) for b in _all_gather_bytes(data, pg, _device(pg, self.device))]

    def _raise_failures(self, statuses: list[dict[str, Any]]) -> None:
        failed = [r for r, s in enumerate(statuses) if not s["ok"]]
        if not failed:
            return
        reasons = [statuses[r]["reason"] for r in failed]
        name = getattr(self._group(), "group_name", self.group)
        raise PeerFailure(
            f"rank{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))} of group {name!r} failed while the "
            f"ranks were agreeing on one schedule, so this rank stops too (none waits for a rank that left):\n"
            + "\n".join(f"  rank {r}: {reason}" for r, reason in zip(failed, reasons)),
            ranks=failed, reasons=reasons)

    def agree(self, program, *, pipeline: str | None = None, cost_model: Any = None) -> dict[str, Any]:
        """The ranks' statuses and plans, then `agree_sizes`' work on `program` (returns what it
        returns). `program` None: only the statuses and plans (the drop-in disabled, with
        `pipeline` saying so; torchtitan's pass list built); every rank must then say the same."""
        from ..ir.sizes import op_sizes, sizes, structure, structure_digest, with_sizes

        pg = self._group()
        if pg is None:
            self._owed = None
            return {"ranks": 1, "sizes": 0, "differ": [], "raised": []}
        device = _device(pg, self.device)
        # everything that can fail on one rank alone comes before the first collective
        plan = f"pipeline {pipeline!r}, cost model {cost_key(cost_model)}"
        digest = None if program is None else structure_digest(program)
        mine = [] if program is None else sizes(program)
        # the largest and (negated) the smallest of each size over the ranks, in one all-reduce: which
        # ops differ between the ranks is then known alike on every rank, so every rank raises alike
        both = torch.tensor(mine + [-v for v in mine], dtype=torch.int64, device=device)
        statuses = self._rendezvous({"ok": True, "digest": digest, "plan": plan})
        self._raise_failures(statuses)
        plans = [s["plan"] for s in statuses]
        if any(p != plan for p in plans):
            raise _plan_mismatch(plans, pg)
        if program is None:
            return {"ranks": len(statuses), "sizes": 0, "differ": [], "raised": []}
        digests = [s["digest"] for s in statuses]
        if any(d != digest for d in digests):  # the programs' text, to say where
            try:
                text = "\n".join(structure(program)).encode()
            except Exception as exc:  # this rank still sends something: the others wait for it
                text = f"(this rank's program could not be printed: {_reason(exc)})".encode()
            every = [b.decode().split("\n") for b in _all_gather_bytes(text, pg, device)]
            raise _structure_mismatch(every, digests, pg)
        if mine:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
        self._owed = "settle" if self.settles else None
        both = both.cpu().tolist()
        largest, smallest = both[:len(mine)], [-v for v in both[len(mine):]]
        differ, at = [], 0
        for op in program.ops():
            n = len(op_sizes(op))
            if largest[at:at + n] != smallest[at:at + n]:
                differ.append(op.name)
            at += n
        raised = with_sizes(program, largest)
        world = dist.get_world_size(pg)
        for name in differ:
            op = program.op(name)
            if _ir_collective(op) and not _rank_sized(op):
                self._owed = None  # every rank finds it in what all sent
                raise RuntimeError(
                    f"%{name} ({op.target}, group {op.group!r}) has other sizes on the ranks of the group (up to "
                    f"{_types(op)}): they cannot run it together; give every rank of the group the same collectives")
        if differ:
            program.notes.append(f"sizes agreed over the {world} ranks of the group: {len(differ)} ops differ in size "
                                 f"between them (first %{differ[0]}); each takes its largest on every rank, so every "
                                 "rank schedules one program")
        return {"ranks": world, "sizes": len(mine), "differ": differ, "raised": raised}

    def settle(self) -> None:
        """After the passes: every rank says whether it got this far; `PeerFailure` where one did not."""
        if self._owed != "settle":
            return
        self._raise_failures(self._rendezvous({"ok": True}))


def _plan_mismatch(plans: list[str], group) -> PlanMismatch:
    counts = Counter(plans)
    reference = max(counts, key=lambda p: (counts[p], -plans.index(p)))
    differing = [r for r, p in enumerate(plans) if p != reference]
    holders = {p: ", ".join(str(r) for r, q in enumerate(plans) if q == p) for p in plans}
    shown = "\n".join(f"  rank{'s' if counts[p] > 1 else ''} {ranks}: {p}" for p, ranks in holders.items())
    return PlanMismatch(
        f"the ranks of group {getattr(group, 'group_name', group)!r} were asked to schedule with other pipelines or "
        f"cost models, so their collectives would come in other orders:\n{shown}\n"
        "  Give every rank of the group the same pipeline, options and cost model.", ranks=differing, plans=plans)


def _types(op) -> str:
    return ", ".join(str(t) for t in op.types) or "?"


def _structure_mismatch(every: list[list[str]], digests: list[str], group) -> StructureMismatch:
    agreeing, differing, index, rank, expected, found = _first_difference(every, digests)
    if expected is None and found is None:  # equal text: a field it does not show, or another fxsched
        return StructureMismatch(
            f"ranks' programs differ (digests {sorted(set(digests))}) in nothing their text shows: do all ranks "
            "run the same fxsched?", ranks=differing, agreeing=agreeing, index=-1, expected=None, found=None)
    what = "op" if (expected or found or "").startswith("%") else "line"
    message = (
        f"ranks' graphs differ in more than sizes, so no schedule can be one for all of them: rank"
        f"{'s' if len(differing) > 1 else ''} {', '.join(map(str, differing))} differ"
        f"{'' if len(differing) > 1 else 's'} from rank{'s' if len(agreeing) > 1 else ''} "
        f"{', '.join(map(str, agreeing))} (group {getattr(group, 'group_name', group)!r}).\n"
        f"  first difference at {what} #{index} (ops in schedule order, sizes shown as ?, then effect edges):\n"
        f"    rank {agreeing[0]}: {expected if expected is not None else 'nothing (its program ends here)'}\n"
        f"    rank {rank}: {found if found is not None else 'nothing (its program ends here)'}\n"
        "  Each rank's sizes may be its own (they are agreed on); its ops, operands, dtypes, tensor ranks, "
        "tags and effects may not: give every rank of the group the same graph.")
    return StructureMismatch(message, ranks=differing, agreeing=agreeing, index=index, expected=expected, found=found)
