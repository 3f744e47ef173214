"""Raise a Program into torch.fx in schedule order, meta kept: a fresh GraphModule, or the
lowered one itself with its own nodes relinked.

`raise_program` copies: the fresh module's Python code is generated lazily, on its first call
or `.code` (torch's `_LazyGraphModule`, as Inductor's own passes use): a scheduling pass hands
the graph on and most callers never run its code, and generating it is over half of raising
at 30k nodes. `raise_in_place` copies nothing: the drop-in schedules the caller's module in
place, so its own nodes (meta, names, users, everything callers hold) are put in the new order;
it can where the passes only reordered them (`reorders_only`; the torch.compile pass asks).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

from torch import fx
from torch.fx.immutable_collections import immutable_dict
from torch.fx.node import Node, map_arg

try:  # torch-internal; without it, fall back to an eager recompile
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover
    _GraphModule = fx.GraphModule
try:  # map_arg without its Python frame (two calls per raised node)
    from torch._C import _fx_map_arg
except ImportError:  # pragma: no cover
    _fx_map_arg = map_arg

import torch

from ..ir import CopyOut, Launch, Marker, Phase, Program, View, tags
from ..ir.errors import InputError
from ..ir.gcpause import gc_paused
from ..ir.rewriter import Call, Operand
from . import lint as fxlint


class RaisingError(InputError):
    """The program cannot be raised to FX: it was not lowered from a GraphModule (parsed from
    text), or it was lowered from another module, or an op has no FX node to copy."""


def raise_program(program: Program, *, lint: bool = True,
                  meta: Mapping[str, Mapping[str, Any]] | None = None) -> fx.GraphModule:
    """Copy each lowered FX node into a new graph in schedule order; markers vanish, and so do
    ops a rewriting pass erased. An op whose operands a pass replaced (ir/rewriter.py) reads
    its new operands' nodes: lowering made the operands from the node's inputs, in order. An
    op a pass created is built from its `Call` (see `_build`).

    `meta`: op name -> entries to add to its raised node's `meta` (the package face tags the
    gathers a run moved so, without a walk of the raised graph to find their nodes). Each
    launch marked `unordered` is tagged so from the op itself (`unordered_launches`), so every
    caller's raised graph says what its schedule assumed."""
    with gc_paused():
        return _raise(program, lint, meta or {})


def raise_in_place(program: Program, *, lint: bool = True) -> fx.GraphModule:
    """Relink the lowered GraphModule's own nodes into schedule order (markers vanish) and return it.

    Only the order changes: node objects, names, args and meta stay as they were, but for the
    tag each unordered launch's node gets (`unordered_launches`). The module's
    code is NOT regenerated here: call `recompile()` once the caller is done with the graph
    (the drop-in tags meta first, and one code generation is most of what it costs).
    `lint`: check what relinking can break, that every node comes after its inputs (a
    RaisingError names the first that does not, and the graph is left as it was). The rest of
    `graph.lint()` (ownership, names, the lookup table, targets) reads what relinking leaves as
    it was: lint the graph before lowering it, as `fxsched.schedule` and the drop-in do.
    """
    source = _origin(program)
    graph = source.graph
    order = _scheduled_nodes(program)
    if len(order) != len(graph.nodes) or any(map(is_not, map(_graph, order), repeat(graph))):
        raise RaisingError("the program's FX nodes are not those of its module's graph "
                           "(was the graph changed after lowering?): cannot reorder it in place")
    if lint:
        _check_inputs_first(order)
    # appending each node at the end (before the graph's sentinel) in schedule order: C does the
    # unlinking and the order keys, and a node already in place costs one relink
    root = graph._root
    for node in order:
        root.prepend(node)
    payload = program.payload
    for name in unordered_launches(program):
        payload[name].meta[tags.UNORDERED] = True
    return source


def unordered_launches(program: Program) -> list[str]:
    """The launches marked `unordered` (`unorder-reduce-scatters`), which raising tags
    `tags.UNORDERED` so that lowering the raised graph marks them again; in the graph's order,
    picked out in C (`Program.ops_of`)."""
    return [op.name for op in program.ops_of(Launch) if op.unordered]


def _check_inputs_first(order: list[fx.Node]) -> None:
    """Raise RaisingError at the first node scheduled before one of its inputs."""
    seen: set[fx.Node] = set()
    add, covers = seen.add, seen.issuperset
    for node in order:
        if not covers(node._input_nodes):
            late = next(n for n in node._input_nodes if n not in seen)
            raise RaisingError(f"%{node.name} would run before its input %{late.name}: the schedule is "
                               "not a topological order of the graph (was it verified?)")
        add(node)


def reorders_only(program: Program) -> bool:
    """Whether the passes only reordered `program`'s lowered nodes, so that `raise_in_place`
    raises what `raise_program` would: no op created or erased, every op still reading what
    its FX node reads."""
    graph, ops = _origin(program).graph, program.graph._node
    if len(program.payload) != len(graph.nodes):
        return False
    for name, node in program.payload.items():
        if not isinstance(node, fx.Node) or node.graph is not graph or not _reads_its_inputs(node, ops[name]["op"], program.payload):
            return False
    return True


def _reads_its_inputs(node: fx.Node, op, payload: dict) -> bool:
    """Whether `op`'s operands are still `node`'s FX inputs, in order, as lowering made them:
    the nodes the program's `payload` holds under the operands' names are those inputs (found
    by the program's own name strings, without reading the FX nodes' names, which lowering
    copied: lowering/fx.py, `names`)."""
    inputs, operands = node._input_nodes, op.operands  # its inputs' own dict, not a list copy
    return len(inputs) == len(operands) and not any(map(is_not, map(payload.get, operands), inputs))


def _origin(program: Program) -> fx.GraphModule:
    source = program.origin
    if not isinstance(source, fx.GraphModule):
        raise RaisingError("this program was not lowered from a GraphModule (parsed from text?): "
                           "nothing to raise it into")
    return source


def _scheduled_nodes(program: Program) -> list[fx.Node]:
    """The lowered FX nodes in schedule order; markers have none."""
    nodes = program.graph._node
    payload = program.payload
    order = []
    for name in program.schedule:
        node = payload.get(name)
        if isinstance(node, Call):
            raise RaisingError(f"%{name} was created by a pass: it has no FX node to reorder in place "
                               "(raise a copy with raise_program)")
        if node is None:
            op = nodes[name]["op"]
            if isinstance(op, Marker):
                continue
            raise RaisingError(f"%{name} ({op.KIND}) has no FX node to raise from")
        order.append(node)
    return order


def _raise(program: Program, lint: bool, meta: Mapping[str, Mapping[str, Any]]) -> fx.GraphModule:
    source = _origin(program)
    graph = fx.Graph(owning_module=source, tracer_cls=source.graph._tracer_cls)
    graph._codegen = source.graph._codegen
    env: dict[fx.Node, fx.Node] = {}
    create, remap = _copier(graph), env.__getitem__
    ops, payload = program.graph._node, program.payload
    made: dict[str, fx.Node] = {}  # the nodes of ops a pass created, by name

    def value(name: str) -> fx.Node:
        return made[name] if name in made else env[payload[name]]

    for name in program.schedule:
        node, op = payload.get(name), ops[name]["op"]
        if node is None:
            if isinstance(op, Marker):
                continue
            raise RaisingError(f"%{name} ({op.KIND}) has no FX node to raise from")
        if isinstance(node, Call):
            made[name] = _build(graph, op, node, value)
            continue
        # Graph.node_copy, less its `copy.meta = ...`: assigning an attribute of a node already in
        # the graph goes through Node.__setattr__, which takes it out of the graph's lookup table
        # and puts it back (a tenth of raising); filling the new node's empty meta dict is the same
        # copy. (`_args` and `_kwargs` are what the `args` and `kwargs` properties return, less a
        # Python call each; most nodes have no kwargs to map.) Named by the schedule's string,
        # the FX node's name as lowering copied it (lowering/fx.py, `names`): the same text.
        kwargs = node._kwargs
        try:  # each FX input read as its own copy, as the op reads it unless a pass rewrote it
            args, kwargs = _fx_map_arg(node._args, remap), _fx_map_arg(kwargs, remap) if kwargs else kwargs
        except KeyError:  # an FX input not raised before it: the op no longer reads it
            args = None
        if args is not None:
            copy = env[node] = create(node.op, node.target, args, kwargs, name, node.type)
            # whether the op reads those copies, in order: each is named by its op's own string,
            # the very object in the op's operands (`_reads_its_inputs` was ~15% of raising);
            # where not, the copy reads what the op does (below)
            rewired = op.operands != tuple(map(_name, copy._input_nodes))
        else:
            copy, rewired = None, True
        if rewired:
            # a rewriting pass changed what it reads (or a name was not kept): each FX input maps
            # to its operand's node
            mapper = dict(zip(node._input_nodes, map(value, op.operands))).__getitem__
            kwargs = node._kwargs
            args, kwargs = _fx_map_arg(node._args, mapper), _fx_map_arg(kwargs, mapper) if kwargs else kwargs
            if copy is None:
                copy = env[node] = create(node.op, node.target, args, kwargs, name, node.type)
            else:  # (through the properties: users and the lookup table kept)
                copy.args, copy.kwargs = args, kwargs
        copy.meta.update(node.meta)
        if rewired and not _reads_its_inputs(node, op, payload) and node.op == "call_function" and isinstance(op, View):
            # a view of a new input (a bucket's copy-out): lowering reads a reshape as a view only
            # where its val shares its input's storage, so it takes its val from that input
            _fake_val(copy)
        if node.op == "placeholder" and copy.name != node.name:
            raise RaisingError(f"input %{node.name} was renamed to {copy.name}")
    for name, entries in meta.items():
        value(name).meta.update(entries)
    for name in unordered_launches(program):  # the op's own mark, whoever raises it (`_tags`)
        value(name).meta[tags.UNORDERED] = True
    gm = _GraphModule(source, graph, class_name=type(source).__name__)
    gm.meta.update(source.meta)
    if lint:
        _lint_raised(gm, create)
    return gm


def _lint_raised(gm: fx.GraphModule, create) -> None:
    """`gm.graph.lint()`, less what `_copier`'s copy makes true (a tenth of raising at 100k
    nodes): every node of the graph was made by Node() in this graph (an op it knows, a callable
    or str target: Node.__init__ refuses the rest), entered in the lookup table, named by the
    graph's namespace (names are unique), and its inputs are nodes raised before it (`env` and
    `made` hold nothing else: an input not raised yet fails the lookup). What is left is the
    targets of get_attr and call_module nodes, looked up in the new module; where one does not
    resolve, lint runs in full and raises its own error. Copies made by `graph.create_node` (a
    module with create-node hooks, which may change the graph) are linted in full."""
    graph = gm.graph
    if create == graph.create_node or not fxlint.targets_resolve(graph, gm):  # (the bound method: _copier's fallback)
        fxlint.lint(graph)


_name, _graph = attrgetter("name"), attrgetter("graph")


def _copier(graph: fx.Graph):
    """`graph.create_node` for copies of nodes of another graph, less its walk of every argument
    for raw symbolic scalars (it only warns; these arguments passed it when their node was made,
    and nodes map to nodes): that walk, through torch's pytree, was a third of raising at 100k
    nodes. Names, the insert point, the lookup table and node count are kept as create_node
    keeps them. A graph whose module has create-node hooks, or a torch without these
    internals, gets create_node itself.

    Where this torch's namespace and lookup table are the ones `_fast_internals` checked, the
    three torch calls per node around Node() are done here (a quarter of raising, at 10k nodes
    as at 100k): a name that is a valid identifier, not a builtin and not taken is kept as
    `create_name` keeps it (`_keep_name`), with no regular expression; the lookup table's
    bucket of each (op, target) is found once, not by hashing the target per node (an op
    overload's hash is a Python call); the node is associated with its name as
    `associate_name_with_obj` does."""
    try:
        namespace, insert, table = graph._graph_namespace, graph._insert, graph._find_nodes_lookup_table
        graph._len  # noqa: B018  (checked here, incremented below)
    except AttributeError:  # pragma: no cover  (another torch)
        return graph.create_node
    if getattr(graph.owning_module, "_create_node_hooks", None):
        return graph.create_node
    create_name, associate, add = namespace.create_name, namespace.associate_name_with_obj, table.insert
    if not _fast_internals(namespace, table):  # pragma: no cover  (another torch)
        def create(op, target, args, kwargs, name, type_expr) -> fx.Node:
            name = create_name(name, None)
            node = Node(graph, name, op, target, args or (), kwargs or immutable_dict(), type_expr)
            associate(name, node)
            insert(node)
            add(node)
            graph._len += 1
            return node

        return create

    used, counts, owners, buckets_by_key = namespace._used_names, namespace._base_count, namespace._obj_to_name, table.table
    buckets: dict[tuple[str, int], dict] = {}  # (op, id(target)) -> the table's bucket (the graph holds each target)

    def create(op, target, args, kwargs, name, type_expr) -> fx.Node:
        if not _keep_name(name, used, counts):
            name = create_name(name, None)
        node = Node(graph, name, op, target, args or (), kwargs or immutable_dict(), type_expr)
        if owners.setdefault(node, name) is not name:  # (associate_name_with_obj)
            raise AssertionError("obj is already associated")
        insert(node)
        key = (op, id(target))
        bucket = buckets.get(key)
        if bucket is None:  # (_FindNodesLookupTable.insert: its key is the node's op and target)
            bucket = buckets[key] = buckets_by_key[(op, target if op == "call_function" else None)]
        bucket[node] = None
        graph._len += 1
        return node

    return create


def _keep_name(name: str, used: set[str], counts: dict[str, int]) -> bool:
    """Whether `_Namespace.create_name(name, None)` keeps `name` as it is, recording what it
    records when so: it keeps an ASCII identifier not taken (`used`) and no builtin or keyword
    (`_illegal_names`). Its regular expression `^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\\d+))?$` matches
    such a name, splitting it into a base and, where the name ends in `_` and ASCII digits after
    a non-empty base, a number; the base's count is set to the number, or (no number) to the
    count it had, 0 when none. False (nothing recorded): create_name must make the name."""
    if name in used or name in _ILLEGAL_NAMES or not name.isascii() or not name.isidentifier():
        return False
    head, _, tail = name.rpartition("_")
    if head and tail.isdigit():
        counts[head] = int(tail)
    else:
        counts[name] = counts.get(name, 0)
    used.add(name)
    return True


try:  # torch-internal: the names a generated name may not shadow, and what `_keep_name` mirrors
    from torch.fx.graph import _FindNodesLookupTable, _Namespace, _illegal_names as _ILLEGAL_NAMES, _name_regex
except ImportError:  # pragma: no cover  (another torch)
    _FindNodesLookupTable = _Namespace = _ILLEGAL_NAMES = _name_regex = None

_NAME_PATTERN = r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$"
_SAMPLE_NAMES = ("x", "x_1", "x_1", "x", "x_01", "a_b_2", "_1", "__1", "_", "a_", "a__", "ab_12_", "x_1a",
                 "sum", "input", "def", "x_2", "mm", "mm_7", "mm", "y1", "1y", "a-b", "é", "t_٣", "x_3")
_FAST_CHECKED: list[bool] = []


def _fast_internals(namespace, table) -> bool:
    """Whether `_copier` may stand in for this torch's create_name, associate_name_with_obj and
    lookup-table insert: the namespace and table are torch's own classes, with the internals
    they had where `_keep_name` was written from create_name, and once per process `_keep_name`
    and create_name are run side by side on names of each case (kept, numbered, taken,
    builtin, keyword, invalid, non-ASCII) and leave the same names and the same state."""
    if (_Namespace is None or type(namespace) is not _Namespace or type(table) is not _FindNodesLookupTable
            or not isinstance(getattr(namespace, "_used_names", None), set)
            or not isinstance(getattr(namespace, "_base_count", None), dict)
            or not isinstance(getattr(namespace, "_obj_to_name", None), dict)
            or not isinstance(getattr(table, "table", None), dict)
            or getattr(_name_regex, "pattern", None) != _NAME_PATTERN):
        return False
    if not _FAST_CHECKED:
        theirs, ours = _Namespace(), _Namespace()
        same = True
        for name in _SAMPLE_NAMES:
            expected = theirs.create_name(name, None)
            got = name if _keep_name(name, ours._used_names, ours._base_count) else ours.create_name(name, None)
            same = same and got == expected
        _FAST_CHECKED.append(same and theirs._used_names == ours._used_names
                             and theirs._base_count == ours._base_count)
    return _FAST_CHECKED[0]


def _build(graph: fx.Graph, op, call: Call, value) -> fx.Node:
    """The FX node of an op a pass created: `call`'s torch op on the op's operands' nodes,
    named as the op, tagged as lowering would read it back (so the raised graph lowers to the
    same program), with a fake `val` computed from its inputs' when they have them."""
    target = _torch_op(call.target)
    operands = op.operands

    def arg(a):
        if isinstance(a, Operand):
            return value(operands[a.index])
        if isinstance(a, (list, tuple)):
            return type(a)(arg(x) for x in a)
        return a

    args, kwargs = arg(tuple(call.args)), {k: arg(v) for k, v in call.kwargs.items()}
    node = graph.create_node("call_function", target, args, kwargs, op.name)
    node.meta.update(_tags(op))
    _fake_val(node)
    return node


def _fake_val(node: fx.Node) -> None:
    """Set the node's `val` to its op run on its inputs' fake vals, when they all have one."""
    vals = [n.meta.get("val") for n in node.all_input_nodes]
    fake = next((getattr(v, "fake_mode", None) for v in vals if getattr(v, "fake_mode", None) is not None), None)
    if fake is not None and all(isinstance(v, torch.Tensor) for v in vals):
        with fake:
            node.meta["val"] = node.target(*fx.map_arg(node.args, lambda n: n.meta["val"]),
                                           **fx.map_arg(node.kwargs, lambda n: n.meta["val"]))


def _torch_op(name: str):
    """The torch op an IR target names: `aten.cat.default` is torch.ops.aten.cat.default."""
    namespace, *rest = name.split(".")
    found = getattr(torch.ops, namespace)
    try:
        for part in rest:
            found = getattr(found, part)
    except AttributeError as exc:
        raise RaisingError(f"no torch op {name!r} to build a created op from") from exc
    return found


def _tags(op) -> dict:
    """The `node.meta` tags lowering reads an op of this kind from (docs/design.md)."""
    meta = {tags.AUTOGRAD_BACKWARD: op.phase is Phase.BACKWARD}
    if isinstance(op, Launch) and op.role is not None:
        meta[tags.COMM_TYPE] = op.role.value
        if op.is_gather and op.nbytes is not None:
            meta[tags.UNSHARDED_NBYTES] = op.nbytes
        if op.bucket is not None:
            meta.update({tags.PARAM_NAME: op.bucket, tags.BUCKET_ID: op.bucket,
                         tags.BUCKET_MEMBERS: list(op.params)})
        elif len(op.params) == 1:
            meta[tags.PARAM_NAME] = op.params[0]
        if op.unordered:
            meta[tags.UNORDERED] = True
    elif isinstance(op, CopyOut):
        meta[tags.BUCKET_COPY_OUT] = op.bucket
    return meta
