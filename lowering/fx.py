"""Lower a tagged torch.fx GraphModule into a Program. All reading of FSDP tags lives here.

Malformed tags give a LoweringError naming the FX node, or a conservative choice (the
gather stays where it is, or the node becomes a barrier) recorded in `program.notes`.

Storage effects are worked out here (see ir/effects.py for the rules): what each call writes
(`Lowering.writes`), which ops alias their input (schemas say may-alias; `meta["val"]` storage
identity says whether, where there is a val), and which collectives are opaque; what a call's
target says, apart from its args and meta, is worked out once per target in lowering/targets.py.
"""

from __future__ import annotations

import operator
from itertools import compress
from operator import attrgetter, is_not

import attrs
import torch
from torch import fx

from ..ir import (DTYPE_BYTES, Barrier, Cast, Compute, Constant, CopyOut, EffectError, Free, Input, Launch, Op, Opaque,
                  Output, Phase, Program, Role, Schedule, TensorType, View, Wait, derive_effects, storage_candidates)
from ..ir.errors import InputError
from ..ir.gcpause import gc_paused
from ..ir.ops import WAIT_ON_NO_LAUNCH
from ..ir.text import EXPLICIT
from ..ir import tags
from ..ir.holds import BUCKET_WITHOUT_MEMBERS, NO_PARAMETER_NAME
from .targets import (FUNCTIONAL_HOPS, P2P_BATCH, TRITON_FUNCTIONAL, TRITON_MUTATION, _MODULES_RETURNING_INPUT,
                      _PLAIN_ATTRIBUTES, _VIEW_ATTRIBUTES, _Target, _classify, _graph_communicates, _graph_draws,
                      _graph_side_effect, _graph_state, _graph_tensors, _graph_writes, _random_module, _subgraphs,
                      _updates_running_stats, _written_arguments, pads_first_dim_end, runs_random_op,
                      synchronous_collective, target_name, triton_written, wrapped_collective)

GATHER_TAGS = {tags.ALL_GATHER: Role.GATHER, tags.ALL_GATHER_BACKWARD: Role.REGATHER}
FREE_TAGS = (tags.RESHARD_FREE, tags.RESHARD_FREE_BACKWARD)
REDUCE_SCATTER_TAG = tags.REDUCE_SCATTER
KNOWN_COMM_TYPES = frozenset({*GATHER_TAGS, *FREE_TAGS, REDUCE_SCATTER_TAG})


_NAME = attrgetter("name")
_OPERANDS = attrgetter("operands")


class LoweringError(InputError):
    """A tag the lowering cannot interpret safely; the message names the FX node."""


def _node_operands(value) -> list[fx.Node]:
    """The FX nodes in an argument (a node, or a list/tuple of them)."""
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, fx.Node)]
    return []


def _earlier(firsts: dict[int, str], key: int | None, name: str) -> str | None:
    """The node recorded first for storage `key` in `firsts`, if it is not `name` (which is
    recorded when it is the first); None too when the storage is unknown."""
    if key is None:
        return None
    first = firsts.setdefault(key, name)
    return first if first != name else None


def _storage_key(value) -> int | None:
    """An identity of a `meta["val"]` tensor's storage (FakeTensors of views share one)."""
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except Exception:  # a tensor without storage (sparse, some subclasses)
        return None


_DTYPES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.complex64: "c64", torch.complex128: "c128", torch.int64: "i64", torch.int32: "i32",
           torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b1"}
for _name, _short in (("float8_e4m3fn", "f8e4m3"), ("float8_e5m2", "f8e5m2")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _short


def _type(value, cache: dict | None = None) -> TensorType:
    """The TensorType of one `meta["val"]` element (`cache`: see `_one_type`)."""
    return _one_type(value, cache)[0]


def _one_type(value, cache: dict | None = None) -> tuple[TensorType]:
    """`(TensorType,)` of one `meta["val"]` element: what a single-tensor node's `types` is.
    `cache` maps (dtype, shape) to the tuple already made for it: a graph has few distinct
    ones, converting the shape dim by dim was most of the cost, and one tuple serves every
    node of that type. A symbolic shape is unhashable and is not cached."""
    if not isinstance(value, torch.Tensor):
        return _NONE_TYPES
    key = (value.dtype, value.shape)
    if cache is not None:
        try:
            return cache[key]
        except KeyError:
            pass
        except TypeError:  # a symbolic extent (SymInt) cannot be hashed
            cache = None
    dtype, shape = key
    if dtype not in _DTYPES:  # a dtype the IR has no short name for: teach it the long one
        _DTYPES[dtype] = str(dtype).removeprefix("torch.")
        DTYPE_BYTES.setdefault(_DTYPES[dtype], dtype.itemsize)
    result = (TensorType(_DTYPES[dtype], tuple(d if isinstance(d, int) else -1 for d in shape)),)
    if cache is not None:
        cache[key] = result
    return result


_NONE_TYPES = (TensorType("none"),)


def value_types(node: fx.Node, cache: dict | None = None) -> tuple[TensorType, ...]:
    """The types of `meta["val"]` (a tensor, or a tuple/list of them); empty when absent.
    `cache`: see `_one_type`."""
    value = node.meta.get("val")
    if value is None:
        return ()
    if isinstance(value, (tuple, list)):
        return tuple(_one_type(v, cache)[0] for v in value)
    return _one_type(value, cache)


def _nbytes(node: fx.Node, notes: list[str]) -> int | None:
    value = node.meta.get(tags.UNSHARDED_NBYTES)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    notes.append(f"%{node.name}: fsdp_unsharded_nbytes={value!r} is not a non-negative int: size unknown")
    return None


class _Lowering:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.notes: list[str] = []
        self.backward_seen = False
        self.late_forward = 0
        # per-graph caches: (node.op, id(target)) -> _Target (by identity, so a target need not be
        # hashable; the graph keeps every target alive), and (dtype, shape) -> (TensorType,)
        self.targets: dict[tuple[str, int], _Target] = {}
        self.types: dict = {}
        self.impurity: dict[tuple[str, int], bool] = {}  # (node.op, id(target)) -> node.is_impure
        self.storages: dict[fx.Node, int | None] = {}  # storage identity of meta["val"]
        self.launches: set[str] = set()  # names lowered as a Launch (what a Wait may wait on)
        self.coalesced: set[str] = set()  # those of them that are coalesced (waited through getitems)
        self.launch_writes: dict[str, tuple[str, ...]] = {}
        self.output: str | None = None  # the output's name, once lowered
        self.attributes: dict[int, str] = {}  # storage of a get_attr's tensor -> the first get_attr of it
        self.input_storages: dict[int, str] = {}  # storage of an input's val -> the first input of it
        self.attribute_storage: dict[str, int] = {}  # a get_attr of a tensor -> its storage
        self.states: dict[int, frozenset[int]] = {}  # id of a called module -> `module_state`
        self.module_calls: list[tuple[str, frozenset[int]]] = []  # call_module reading state: (name, storages)
        self.p2p_batches: set[str] = set()  # batch_p2p_ops calls (barriers, as their waits)
        # a higher-order op (or called GraphModule) whose result may be one of several operands, or
        # a view of one (its subgraph returns an input at a position fxsched cannot tell) -> those
        # operands: its `may_alias` (`hop_alias`)
        self.one_of: dict[str, tuple[str, ...]] = {}
        # a result of several tensors' storages (a view of several, a higher-order op's) -> per
        # element: the operand whose storage it is (a name), those it may be each of or fresh (a
        # tuple; empty: fresh), or None (unknown: any the op may be); `viewed_items`, `hop_alias`
        self.items: dict[str, tuple[str | tuple[str, ...] | None, ...]] = {}
        self.returns: dict[int, list[int] | None] = {}  # id of a subgraph -> `returned_inputs`
        # id of a subgraph -> per element of its returned tuple, the inputs it may share (None: no node)
        self.returns_each: dict[int, list[tuple[int, ...] | None] | None] = {}
        self.unorder_tagged: list[fx.Node] = []  # nodes tagged `fsdp_unordered` (read back by `collective`)
        self.fake_mode = None  # the FakeTensorMode of the first val with storage (see `storage`)
        self.results: dict[str, tuple | list] = {}  # an op returning its arguments (or a getitem of its result) -> what it returns
        self.same: dict[str, str] = {}  # a getitem of such a result -> the argument it is
        self.rebinds: list[str] = []  # the `set_` calls (each rebinds its first operand to another storage)
        # the nodes lowered so far -> their positions; per op, the operands it was made with and
        # their positions (what derive_effects walks: found here, by node, where the node's inputs
        # are at hand; see `positions`), None once an input is no node lowered before it (add_all
        # then says which)
        self.position: dict[fx.Node, int] = {}
        # the program's name of each node, by position: a fresh copy of the node's name, all made
        # in one loop before the walk (`_lower_in_order`), so that the copies lie together in
        # memory, where FX's strings lie each among its node's objects, ~1.5 KB apart. The IR
        # names each op by this one str object everywhere (op, operands, writes, aliases, graph
        # and schedule keys): the passes' name-keyed lookups (each reads its key's hash) then
        # read strings that stay in cache and find each key by identity (an equal string that
        # is another object is compared byte by byte). At 100k nodes the reference pipeline's
        # passes took 1.54 -> 1.42 s for 19 ms of copying (10k: see the commit). Names read off
        # FX nodes go through `name_of`.
        self.names: list[str] = []
        self.given: list[tuple[str, ...]] = []
        self.numbers: list[tuple[int, ...]] | None = []
        self.aliasable: dict[str, int] = {}  # inputs and get_attrs (what an alias of one reads) -> positions

    def name_of(self, node: fx.Node) -> str:
        """The program's name of an FX node (`names`): the copy made for it, once it is lowered;
        else its own name (a node not lowered before: lowering or lint says so)."""
        at = self.position.get(node)
        return node.name if at is None else self.names[at]

    def target(self, node: fx.Node) -> _Target:
        key = (node.op, id(node.target))
        try:
            return self.targets[key]
        except KeyError:
            found = self.targets[key] = _classify(node.op, node.target)
            return found

    def pads_for_gather(self, node: fx.Node) -> bool:
        """DTensor's pad of a smaller shard before its all-gather (`pads_first_dim_end`, every
        user a functional all-gather)."""
        return (pads_first_dim_end(node) and bool(node.users)
                and all(user.op == "call_function" and self.target(user).all_gather for user in node.users))

    def draws_inside(self, node: fx.Node) -> bool:
        """A higher-order op whose subgraph (`invoke_subgraph`, `cond`, ...: a GraphModule it is
        given) draws from the RNG, at any depth, or that runs an op it is given that draws
        (`auto_functionalized(op, ...)`, `runs_random_op`): it is random as its random ops are."""
        return runs_random_op(node) or any(_graph_draws(sub, self.target) for sub in _subgraphs(self.gm, node))

    def hop_writes(self, node: fx.Node) -> tuple[tuple[str, ...], str | None, bool]:
        """`writes` of a higher-order op: a user's triton kernel writes the tensors it is given;
        one whose subgraph writes in place, or one fxsched does not know (`FUNCTIONAL_HOPS`) and
        can see no subgraph of, every tensor it is given."""
        hop = node.target.name()
        if hop in (TRITON_MUTATION, TRITON_FUNCTIONAL):
            return tuple(map(self.name_of, triton_written(node))), None, False
        subgraphs = _subgraphs(self.gm, node)
        if subgraphs:
            alias = self.hop_alias(node, subgraphs)  # (one of several: `one_of`, None here)
            if any(_graph_writes(sub, self.target) for sub in subgraphs):
                return tuple(self.name_of(n) for n in node.all_input_nodes if n.op != "get_attr"), alias, True
            return (), alias, False
        if hop in FUNCTIONAL_HOPS:
            return (), None, False
        return tuple(map(self.name_of, node.all_input_nodes)), None, True

    def hop_alias(self, node: fx.Node, subgraphs: list[fx.GraphModule]) -> str | None:
        """The operand a higher-order op's result may share storage with (or a call_module's of a
        GraphModule, `split_module`'s stages): a subgraph that returns one of its inputs (or a view
        of it, or what an in-place op on it returned) hands that operand back, so reads of the
        result must keep their order with writes of it. Which operand an input is: the arguments
        after the (last) subgraph, when as many as its inputs (a module call's arguments); else any
        tensor operand. A result that may be one of several operands (two inputs returned, or one
        at a position fxsched cannot tell) may be each of them: None here, and those operands in
        `one_of` (the op's `may_alias`: each access of the result, or of a getitem of it, counts as
        an access of each of theirs)."""
        tensors = [n for n in node.all_input_nodes if n.op != "get_attr"]
        if node.op == "call_module":
            operands = list(node.args) if not node.kwargs else None
        else:
            # the arguments after the last subgraph, less leading constants (`invoke_subgraph`'s
            # identifier), or the one list there (`cond`'s operands): `wrap`, `tag_activation_checkpoint`
            # and `invoke_subgraph` pass them to the subgraph's inputs in order
            at = max((i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
                      and isinstance(attrgetter(a.target)(self.gm), fx.GraphModule)), default=None)
            operands = list(node.args[at + 1:]) if at is not None else None
            while operands and not isinstance(operands[0], (fx.Node, list, tuple)):
                operands.pop(0)
            if operands is not None and len(operands) == 1 and isinstance(operands[0], (list, tuple)):
                operands = list(operands[0])
        found: list[fx.Node] = []
        for sub in subgraphs:
            returned = self.returned_inputs(sub)
            if returned is None:  # a subgraph fxsched could not lower: any operand
                found += tensors
                continue
            known = operands is not None and len(operands) == len(sub.graph.find_nodes(op="placeholder"))
            for at in returned:
                if not known or not isinstance(operands[at], fx.Node):
                    found += tensors
                else:
                    found.append(operands[at])
        found = list(dict.fromkeys(found))
        if len(found) > 1:
            self.one_of[self.name_of(node)] = tuple(map(self.name_of, found))
            each = [self.returns_each.get(id(sub)) for sub in subgraphs] if operands is not None else [None]
            if (all(e is not None and len(e) == len(each[0]) for e in each)
                    and all(len(operands) == len(sub.graph.find_nodes(op="placeholder")) for sub in subgraphs)):
                # every subgraph returns a tuple: per position, a getitem of it aliases the one input
                # every subgraph returns there, or may be each of those some subgraph may return
                # there (`cond`'s branches returning different ones; or fresh), not every one the
                # op may be (`item`)
                self.items[self.name_of(node)] = tuple(self.hop_item([e[i] for e in each], operands)
                                              for i in range(len(each[0])))
            return None
        return self.name_of(found[0]) if found else None

    def hop_item(self, each: list[tuple[int, ...] | None], operands: list) -> str | tuple[str, ...] | None:
        """`items`' entry for one position of a higher-order op's tuple, given what each subgraph
        returns there (`returns_each`'s entries): the operand's name where each returns one same
        input; else the operands any may return (it may be each of them, or fresh); None where one
        returns no node (a nested tuple) or an input that is no node of the op."""
        if any(e is None for e in each) or any(not isinstance(operands[at], fx.Node) for e in each for at in e):
            return None
        if len(each[0]) == 1 and all(e == each[0] for e in each):
            return self.name_of(operands[each[0][0]])
        return tuple(self.name_of(operands[at]) for at in sorted({at for e in each for at in e}))

    def returned_inputs(self, sub: fx.GraphModule) -> list[int] | None:
        """The positions of `sub`'s inputs whose storage its output shares (an input returned, a
        view of one, an in-place op's result on one); None when `sub` cannot be lowered."""
        key = id(sub)
        if key not in self.returns:
            try:
                program = _lower(sub)
            except InputError:
                self.returns[key] = None
                return None
            inputs = [n.name for n in sub.graph.find_nodes(op="placeholder")]
            output = next(iter(sub.graph.find_nodes(op="output")), None)
            roots: dict[str, str] = {}
            # (a result that may be an input's storage, `may_alias`, may hand that input back too)
            returned = {root for n in (output.all_input_nodes if output is not None else ())
                        for root in storage_candidates(program, n.name, roots)}
            self.returns[key] = [at for at, name in enumerate(inputs) if name in returned]
            # per element of a returned tuple, the inputs it may share storage with (None: no tuple;
            # per element, None where it is no node: a nested tuple may hold inputs)
            elements = output.args[0] if output is not None and output.args else None
            self.returns_each[key] = None if not isinstance(elements, (list, tuple)) else [
                tuple(at for at, name in enumerate(inputs) if name in storage_candidates(program, e.name, roots))
                if isinstance(e, fx.Node) else None for e in elements]
        return self.returns[key]

    def viewed(self, node: fx.Node, info: _Target) -> tuple[str, ...]:
        """The operands a custom op's result views by its schema (`info.viewed`), in its order."""
        names = [self.name_of(n) for at in info.viewed for n in _node_operands(self.argument(node, info.schema, at))]
        return tuple(dict.fromkeys(names))

    @staticmethod
    def argument(node: fx.Node, schema, at: int):
        """The value the call passes for the schema's argument at position `at`."""
        argument = schema.arguments[at]
        if at < len(node.args) and not argument.kwarg_only:
            return node.args[at]
        return node.kwargs.get(argument.name)

    def viewed_items(self, node: fx.Node, info: _Target) -> tuple[str | tuple[str, ...], ...] | None:
        """Per element of a view of several tensors, the tensor it views (`items`), where that is
        known: `broadcast_tensors`' and `meshgrid`'s i-th result views the i-th tensor given (a
        list, or Python's varargs), a custom op's by its schema (`_viewed_items`); else by the
        call's `meta["val"]` (`val_items`: `Tensor(a)[] -> Tensor(a)[]`, whose schema pins no
        position); None where none of these says (an element that is no node, no val)."""
        if info.viewed_items:
            values = [self.argument(node, info.schema, at) for at in info.viewed_items]
        elif info.positional:
            args = node.args
            values = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
        else:
            return self.val_items(node)
        if not values or not all(isinstance(v, fx.Node) for v in values):
            return None
        return tuple(map(self.name_of, values))

    def val_items(self, node: fx.Node) -> tuple[str | tuple[str, ...], ...] | None:
        """Per element of a list or tuple `meta["val"]`, the operand whose val shares its storage
        (FakeTensors of one mode: `storage`), or those that do where several share it (aliasing
        operands: it may be each); None where an element has no such storage or shares no
        operand's (a real-mode val says nothing; a fresh element is not what the op's schema says
        of it)."""
        value = node.meta.get("val")
        if not isinstance(value, (list, tuple)) or not value:
            return None
        found = []
        for element in value:
            key = self.key(element)
            names = tuple(self.name_of(n) for n in node._input_nodes if key is not None and self.storage(n) == key)
            if not names:
                return None
            found.append(names[0] if len(names) == 1 else names)
        return tuple(found)

    def item(self, node: fx.Node) -> str | tuple[str, ...] | None:
        """`items`' entry for `getitem(source, i)`, when `source` is in `items`: the tensor whose
        storage it is, those it may be each of (or fresh), or None (unknown: any the source may be)."""
        if len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], fx.Node):
            return None
        items, at = self.items.get(self.name_of(node.args[0])), node.args[1]
        if items is None or type(at) is not int or not -len(items) <= at < len(items):
            return None
        return items[at]

    def covered(self, node: fx.Node) -> bool:
        """Whether every user of `node` (in `items`) is a plain getitem of an element whose storages
        are known (`item`): each lowers as an access of those alone, and nothing else reads the op's
        own result, so the op need not be (`may_alias`) every storage its elements may be."""
        if self.name_of(node) not in self.items or not node.users:
            return False
        for user in node.users:
            if (user.op != "call_function" or user.target is not operator.getitem or self.item(user) is None
                    or user.args[0] is not node or user.meta.get(tags.COMM_TYPE) is not None
                    or user.meta.get(tags.BARRIER)):
                return False
        return True

    def result_item(self, node: fx.Node) -> None:
        """`getitem(source, i)` of a result in `results` (at any depth): record what it is, the
        argument's tensor (`same`), or its list (`results`)."""
        source, at = node.args[0], node.args[1]
        value = self.results.get(self.name_of(source)) if isinstance(source, fx.Node) else None
        if not isinstance(value, (list, tuple)) or not isinstance(at, int) or not -len(value) <= at < len(value):
            return
        item = value[at]
        if isinstance(item, fx.Node):
            item = self.name_of(item)
            self.same[self.name_of(node)] = self.same.get(item, item)
        elif isinstance(item, (list, tuple)):
            self.results[self.name_of(node)] = item

    def impure(self, node: fx.Node) -> bool:
        """`node.is_impure(impure_random=False)`, once per target: it reads the target (a
        schema, torch's side-effect registries, a module's flag), and the arguments only of a
        higher-order op (asked per node); per node it was a tenth of lowering."""
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return node.is_impure(impure_random=False)
        key = (node.op, id(node.target))
        try:
            return self.impurity[key]
        except KeyError:
            found = self.impurity[key] = self.target(node).side_effect or node.is_impure(impure_random=False)
            return found

    def opaque(self, node: fx.Node) -> bool:
        """A collective whose result is not waited exactly once (a coalesced one: each of its
        results): it cannot be reasoned about."""
        if node.op != "call_function":
            return False
        info = self.target(node)
        return info.collective and not info.wait and not self.waited(node)

    def waited(self, node: fx.Node) -> bool:
        """`waited_once`; for a coalesced collective, `coalesced_results`."""
        return self.coalesced_results(node) is not None if self.target(node).coalesced else self.waited_once(node)

    def coalesced_results(self, node: fx.Node) -> list[fx.Node] | None:
        """A coalesced collective's getitems, one per result, each waited once (`waited_once`);
        None when it has another user, a result taken twice or not at all, or is no functional
        coalesced one (an in-place one, `all_reduce_coalesced_`, stays opaque)."""
        info = self.target(node)
        if not info.coalesced or info.written or not node.users:
            return None
        # one result per input (the first argument, a list): each must be waited
        inputs = node.args[0] if node.args else None
        count = len(inputs) if isinstance(inputs, (list, tuple)) else None
        indices = []
        for user in node.users:
            if (user.op != "call_function" or user.target is not operator.getitem or len(user.args) != 2
                    or not isinstance(user.args[1], int) or not self.waited_once(user)):
                return None
            indices.append(user.args[1])
        if count is None or sorted(indices) != list(range(count)):
            return None
        return list(node.users)

    def waited_once(self, node: fx.Node) -> bool:
        """The node's one user is a wait on it alone (so it lowers to the launch's Wait)."""
        if len(node.users) != 1:
            return False
        user = next(iter(node.users))
        return self.target(user).wait and len(user._input_nodes) == 1

    def attribute(self, node: fx.Node) -> str | None:
        """The earlier get_attr of the storage this get_attr reads, if any (then records this one:
        a graph may name one module tensor in several get_attr nodes, make_fx a tensor closed over
        once per use, and tied attributes share a tensor under two names)."""
        try:
            value = attrgetter(node.target)(self.gm)
        except AttributeError:
            return None
        key = _storage_key(value)
        name = self.name_of(node)
        if key is not None:
            self.attribute_storage[name] = key
        return _earlier(self.attributes, key, name)

    def module_state(self, module: torch.nn.Module) -> frozenset[int]:
        """The storages of a called module's parameters and buffers (its submodules' too)."""
        key = id(module)
        if key not in self.states:
            tensors = [*module.parameters(), *module.buffers()]
            self.states[key] = frozenset(k for k in map(_storage_key, tensors) if k is not None)
        return self.states[key]

    def storage(self, node: fx.Node) -> int | None:
        """`key` of the node's `meta["val"]`, once per node."""
        try:
            return self.storages[node]
        except KeyError:
            key = self.storages[node] = self.key(node.meta.get("val"))
            return key

    def key(self, value) -> int | None:
        """`_storage_key` of a val, None where it says nothing about storage."""
        key = _storage_key(value)
        mode = getattr(value, "fake_mode", None)
        if mode is not None and key is not None:
            # FakeTensors of one mode share storages as the traced tensors did; real-mode make_fx
            # gives each val a mode of its own and a fresh storage (a view's val shares nothing
            # with its input's): such a val says nothing about storage
            if self.fake_mode is None:
                self.fake_mode = mode
            elif mode is not self.fake_mode:
                key = None
        return key

    def shared(self, node: fx.Node) -> str | None:
        """The operand whose `meta["val"]` shares the storage of the node's own (None: none does,
        or there is no val to say)."""
        key = self.storage(node)
        if key is None:
            return None
        for operand in node._input_nodes:
            if self.storage(operand) == key:
                return self.name_of(operand)
        return None

    def tagged_result(self, node: fx.Node, info: _Target, name: str, operands: tuple) -> tuple[str | None, tuple]:
        """(`alias`, `may_alias`) of a node tagged `barrier`: nothing crosses it, but its result is
        still what the op returns (an in-place op's operand, a view's source, a higher-order op's
        returned input), which reads after the barrier must order with the writes after it through.
        A val that shows the storage decides; a view that may copy is taken for a view."""
        if self.storage(node) is not None:
            return self.shared(node), ()
        if info.view:
            return (operands[0] if operands else None), ()
        writes, alias, unknown = self.writes(node, info)
        may_alias = self.may_return(node, writes) if unknown else ()
        several = self.one_of.pop(name, ())
        if several and not self.covered(node):
            may_alias = tuple(dict.fromkeys((*may_alias, *several)))
        return (None if may_alias else alias), may_alias

    def writes(self, node: fx.Node, info: _Target) -> tuple[tuple[str, ...], str | None, bool]:
        """The operands whose storage the call writes, the one its result aliases, and whether
        fxsched cannot see into the call.

        A schema says which arguments it writes (in-place and `out=` overloads, mutating
        collectives); an overload packet, what any of its overloads could write that the call
        passes; a Python call of a known module given `out=`, its `out`; a Python in-place call (`relu_`, `x.add_`, `operator.iadd`), a call with
        `inplace=True`, or a module built with `inplace=True` writes its first argument; a call
        fxsched cannot classify (a function of no known module, a module not from torch.nn) is
        taken to write every tensor it is given.
        """
        args, kwargs = node.args, node.kwargs
        if info.schema is not None:
            if not info.written:
                return (), None, False
            names = []
            for at, name in info.written:
                value = args[at] if at < len(args) and not info.schema.arguments[at].kwarg_only else kwargs.get(name)
                names += [self.name_of(n) for n in _node_operands(value)]
            alias = None
            if info.schema.name == "aten::set_" and len(args) > 1 and isinstance(args[1], fx.Node):
                # `x.set_(y)`: x (and the result) now views y's storage (`_rebind` makes x's
                # later uses read the result)
                self.rebinds.append(self.name_of(node))
                return tuple(dict.fromkeys(names)), self.name_of(args[1]), False
            if info.result_alias is not None:
                name = dict(info.written)[info.result_alias]
                value = args[info.result_alias] if info.result_alias < len(args) else kwargs.get(name)
                alias = self.name_of(value) if isinstance(value, fx.Node) else None
            return tuple(dict.fromkeys(names)), alias, False
        if info.packet:
            names = []
            for overload in node.target.overloads():
                schema = getattr(node.target, overload)._schema
                for at, name in _written_arguments(schema):  # a keyword-only one (`out=`) only if passed so
                    value = args[at] if at < len(args) and not schema.arguments[at].kwarg_only else kwargs.get(name)
                    names += [self.name_of(n) for n in _node_operands(value)]
            names = list(dict.fromkeys(names))
            return tuple(names), (names[0] if names else None), False
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            return self.hop_writes(node)
        if info.undeclared:  # a batch norm called from Python updates its running stats
            names = [self.name_of(n) for at, name in info.undeclared
                     for n in _node_operands(args[at] if 0 <= at < len(args) else kwargs.get(name))]
            if names:
                return tuple(dict.fromkeys(names)), None, False
        out = _node_operands(kwargs.get("out")) if info.known and node.op != "call_module" else ()
        if out:  # a Python call given `out=` (`torch.add(x, y, out=buf)`, `torch.max(x, 0, out=(v, i))`) writes it
            names = tuple(dict.fromkeys(map(self.name_of, out)))
            return names, (names[0] if isinstance(kwargs["out"], fx.Node) else None), False
        inplace = (info.py_inplace or kwargs.get("inplace") is True
                   or (info.inplace_at is not None and info.inplace_at < len(args) and args[info.inplace_at] is True))
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            inplace = getattr(module, "inplace", False) is True
            known = type(module).__module__.startswith("torch.nn")
        else:
            known = info.known
        if not inplace and not known:
            return tuple(map(self.name_of, node.all_input_nodes)), None, True
        first = args[0] if args and isinstance(args[0], fx.Node) else None
        if (inplace and first is not None and info.name.rsplit(".", 1)[-1] == "set_" and len(args) > 1
                and isinstance(args[1], fx.Node)):  # `x.set_(y)` called from Python: as aten's set_ above
            self.rebinds.append(self.name_of(node))
            return (self.name_of(first),), self.name_of(args[1]), False
        if inplace and first is not None:
            returns_it = info.name.rsplit(".", 1)[-1].strip("_") not in ("setitem", "delitem")
            first = self.name_of(first)
            return (first,), (first if returns_it else None), False
        if info.python_written:  # named like aten ops that write lists (`torch._foreach_add_([a, b], c)`): what they write
            names = [self.name_of(n) for schema in info.python_written for at, name in _written_arguments(schema)
                     for n in _node_operands(args[at] if at < len(args) and not schema.arguments[at].kwarg_only
                                             else kwargs.get(name))]
            return tuple(dict.fromkeys(names)), None, False
        return (), None, False

    def phase(self, node: fx.Node) -> Phase:
        if node.meta.get(tags.AUTOGRAD_BACKWARD):
            self.backward_seen = True
            return Phase.BACKWARD
        if self.backward_seen:  # forward ops past the first backward one join the backward phase
            self.late_forward += 1
            return Phase.BACKWARD
        return Phase.FORWARD

    def lower(self, node: fx.Node) -> Op:
        kind = node.op
        # the op's name, the copy of the node's (see `names`); its operands, the copies made for
        # its inputs, found by their positions (the inputs read off the node's own dict of them:
        # `all_input_nodes` copies it to a list)
        names, position = self.names, self.position
        name = names[len(position)]
        if self.numbers is not None:
            try:
                numbers = tuple(map(position.__getitem__, node._input_nodes))
            except KeyError:
                self.numbers = None
            else:
                self.numbers.append(numbers)
                operands = tuple(map(names.__getitem__, numbers))
        if self.numbers is None:
            operands = tuple(map(self.name_of, node._input_nodes))
        self.given.append(operands)
        position[node] = len(position)
        types = value_types(node, self.types)
        # the output ends the program and inputs read nothing: derive_effects's order rules
        # (ir/effects.py) then keep the graph's own order, which the manager relies on (api.py)
        if self.output is not None:
            raise LoweringError(f"%{node.name} follows the graph's output %{self.output}: nothing may")
        if kind == "placeholder":
            if operands:
                raise LoweringError(f"input %{node.name} reads {['%' + o for o in operands]}: "
                                    "an input's default may not be another node")
            self.aliasable[name] = position[node]
            first = _earlier(self.input_storages, self.storage(node), name)
            if first is not None:
                # inputs traced as views of one storage (make_fx(f)(x[:3], x[1:])): the later is an
                # alias of the first, so that writes through one are ordered against reads of the other
                return Input.make(name, self.realias(first), Phase.FORWARD, types, target=str(node.target),
                                  alias=first)
            return Input.make(name, operands, Phase.FORWARD, types, target=str(node.target))
        if kind == "output":
            self.output = node.name
            return Output.make(name, operands, Phase.FORWARD, ())
        phase = self.phase(node)
        # the fields every op has, as `make` takes them first (lowering's ops are built with
        # `Op.make`: no conversion, as every value here already has its field's type)
        base = (name, operands, phase, types)  # for the helpers below
        if kind == "get_attr":
            self.aliasable[name] = position[node]
            first = self.attribute(node)
            if first is not None:
                # the same tensor (or storage) read again: an alias of the first read, so that the
                # writes through one are ordered against the reads through the other
                return Constant.make(name, self.realias(first), phase, types, target=str(node.target), alias=first)
            return Constant.make(name, operands, phase, types, target=str(node.target))
        info = self.target(node)
        target = info.name
        meta = node.meta
        comm_type = meta.get(tags.COMM_TYPE)
        if meta.get(tags.UNORDERED):
            self.unorder_tagged.append(node)
        if info.collective and (meta.get(tags.BARRIER) or comm_type in FREE_TAGS):
            # a collective (or its wait) turned into a barrier or free would leave its partner
            # unpaired: say which tag, not what the verifier makes of the result
            tag = f"{tags.BARRIER}={meta[tags.BARRIER]!r}" if meta.get(tags.BARRIER) else f"comm_type={comm_type!r}"
            raise LoweringError(f"%{node.name} ({target}) is a collective {'wait' if info.wait else 'launch'} "
                                f"tagged {tag}: barrier and free tags go on other nodes; remove the tag")
        if comm_type is not None and comm_type not in KNOWN_COMM_TYPES:
            self.notes.append(f"%{node.name}: unknown comm_type={comm_type!r} (known: "
                              f"{', '.join(sorted(KNOWN_COMM_TYPES))}): treated as untagged")
        if meta.get(tags.BARRIER):
            alias, may_alias = self.tagged_result(node, info, name, operands)
            return Barrier.make(name, operands, phase, types, target=target, reason="tagged barrier", heavy=info.heavy,
                                attention=info.attention, alias=alias, may_alias=may_alias)
        if comm_type in GATHER_TAGS and info.all_gather:
            return self.gather(node, target, GATHER_TAGS[comm_type], base)
        if comm_type in FREE_TAGS:
            return self.free(node, target, base)
        if info.collective:
            return self.collective(node, info, comm_type, base)
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            wrapped, group = wrapped_collective(node)
            if wrapped:
                # the op it runs communicates (a symmetric-memory all-reduce that writes its input,
                # functionalized): a synchronous collective, kept in place and in its group's order
                self.notes.append(f"%{node.name}: {target} runs a collective: kept in place, in order with group "
                                  f"{group!r}")
                return Opaque.make(name, operands, phase, types, target=target, group=group,
                                   reason="synchronous collective")
        if comm_type in GATHER_TAGS:
            self.notes.append(f"%{node.name}: comm_type={comm_type!r} on {target}, not a collective: ignored")
        if info.clone and meta.get(tags.BUCKET_COPY_OUT) is not None:
            return CopyOut.make(name, operands, phase, types, target=target, bucket=str(meta[tags.BUCKET_COPY_OUT]))
        sources = self.viewed(node, info) if info.viewed else ()
        if info.view:
            if self.results and node.target is operator.getitem:
                self.result_item(node)
            if self.items and node.target is operator.getitem:
                item = self.item(node)
                if type(item) is str:
                    # an element of a result of several tensors' storages that views one known tensor:
                    # an alias of it alone (ordered with its writes, not every source's). A View's
                    # source is its first operand, which raising reads as the node's (the tuple), so
                    # a Compute that also reads that tensor and aliases it
                    return Compute.make(name, (*operands, item), phase, types, target=target, alias=item)
                if item:  # it may be each of a few (`cond`'s branches returning different ones) alone
                    return Compute.make(name, (*operands, *item), phase, types, target=target, may_alias=item)
            several = sources if len(sources) > 1 else (operands if info.several and len(operands) > 1 else ())
            if several:
                items = self.viewed_items(node, info)
                if items is not None:
                    self.items[name] = items
                    if self.covered(node):
                        several = ()  # each getitem is the access of its own element's storages
                # views of each of several tensors (`broadcast_tensors(a, b)`, `meshgrid`, a custom
                # op's `(Tensor(a) x, Tensor(b) y) -> (Tensor(a), Tensor(b))` or `Tensor(a)[] ->
                # Tensor(a)[]`): a View has one source, so the result may be each of theirs, and each
                # access of it (or of a getitem of it) counts as an access of each (`Op.may_alias`)
                return Compute.make(name, operands, phase, types, target=target, heavy=info.heavy,
                                    attention=info.attention, may_alias=several)
            if sources and sources[0] != operands[0]:
                # a view of another argument than the first (a custom op's): a View's source is its
                # first operand, and raising relinks operands in their order, so its result aliases it
                return Compute.make(name, operands, phase, types, target=target, heavy=info.heavy,
                                    attention=info.attention, alias=sources[0])
            return self.view(node, info, base)
        if (kind == "call_function" and node.target is getattr and len(node.args) == 2
                and isinstance(node.args[0], fx.Node) and node.args[1] not in _PLAIN_ATTRIBUTES):
            if node.args[1] in _VIEW_ATTRIBUTES:
                return View.make(name, operands, phase, types, target=target)
            # `p.grad`, `p.main_grad`, `d._local_tensor`: a tensor that each getattr of it returns
            # again, which one may write and another read: ordered as an alias of its owner
            return View.make(name, operands, phase, types, target=target, maybe=True)
        if info.returned:
            # a tuple of the tensors it was given (out= overloads, c10d ops): its getitems are those
            # tensors (`result_item`), not fresh storage nor all the first one's
            self.results[name] = tuple(None if at is None else self.argument(node, info.schema, at)
                                       for at in info.returned)
        writes, alias, unknown = self.writes(node, info)
        # a random call touches the RNG state only: ordered with the other random ops, no barrier
        # (torch calls Python's torch.rand* impure whatever impure_random says)
        random = (info.random or (kind == "call_module" and _random_module(self.gm.get_submodule(node.target)))
                  or (isinstance(node.target, torch._ops.HigherOrderOperator) and self.draws_inside(node)))
        may_alias = self.may_return(node, writes) if unknown else ()
        if self.one_of or len(sources) > 1:
            # a result that may be (a view of) one of several operands: a higher-order op's
            # (`hop_alias`), a custom op's viewing several arguments and writing one; unless a val
            # shows the storage it shares
            several = self.one_of.pop(name, ()) or (sources if len(sources) > 1 else ())
            if several and self.covered(node):
                several = ()  # each getitem is the access of its own element's storages (`hop_alias`)
            if several and self.shared(node) is None:
                may_alias = tuple(dict.fromkeys((*may_alias, *several)))
        # a barrier's result still shares what its subgraph returns (Inductor's `control_deps`
        # around a view or an in-place op of its input): nothing crosses the barrier, but reads of
        # the result after it order with writes of that input after it only through the alias
        barrier_alias = None if may_alias else (self.shared(node) or alias)
        # the graphs it runs: a higher-order op's subgraphs, a called GraphModule (`split_module`'s stage)
        inner = (_subgraphs(self.gm, node) if isinstance(node.target, torch._ops.HigherOrderOperator)
                 else [self.gm.get_submodule(node.target)] if kind == "call_module"
                 and isinstance(self.gm.get_submodule(node.target), fx.GraphModule) else [])
        # collectives, sends or receives in it (a send and its wait in an `invoke_subgraph`): no
        # collective or point-to-point order sees them, and a receive's wait moved above the op, or the
        # op above the receive, waits for a send no rank posts. A side effect in it
        # (`inductor.resize_storage_bytes_` freeing its input), a barrier in the graph itself: a read
        # of that input could move past the free
        why = ("collective inside" if any(_graph_communicates(sub, self.target) for sub in inner)
               else "side effect inside" if any(_graph_side_effect(sub, self.target) for sub in inner) else None)
        if why is not None:
            if kind == "call_module" and barrier_alias is None and not may_alias:
                barrier_alias = self.hop_alias(node, inner)
                may_alias = () if barrier_alias is not None else self.one_of.pop(name, ())
            return Barrier.make(name, operands, phase, types, target=target, reason=why,
                                heavy=info.heavy, attention=info.attention, alias=barrier_alias, may_alias=may_alias)
        if (unknown or not writes) and not random and self.impure(node):
            return Barrier.make(name, operands, phase, types, target=target, reason="side effect",
                                heavy=info.heavy, attention=info.attention, alias=barrier_alias, may_alias=may_alias)
        if (unknown and isinstance(node.target, torch._ops.HigherOrderOperator)
                and any(map(_graph_state, _subgraphs(self.gm, node)))):
            # its subgraph writes, and reads tensors of its own (make_fx's constant for a closed-over
            # buffer) that the graph may read too, no operand naming them: ordered against everything
            return Barrier.make(name, operands, phase, types, target=target, reason="module state",
                                heavy=info.heavy, attention=info.attention, alias=barrier_alias, may_alias=may_alias)
        if kind == "call_module":
            module = self.gm.get_submodule(node.target)
            state = self.module_state(module)
            if _updates_running_stats(module) or (state and not type(module).__module__.startswith("torch.nn")):
                # the module writes its own buffers (a module fxsched does not know may), which no
                # operand names (get_attr nodes may read them, a second call of it writes them
                # again): ordered against everything
                return Barrier.make(name, operands, phase, types, target=target, reason="module state",
                                    heavy=info.heavy, attention=info.attention, may_alias=may_alias)
            if state:  # it reads its state: a barrier if a get_attr of it is written (`_module_state_barriers`)
                self.module_calls.append((name, state))
        if unknown and writes:
            self.notes.append(f"%{node.name}: {target} is a call fxsched cannot see into: taken to write "
                              f"{', '.join('%' + w for w in writes)}"
                              + ("; no meta['val'] says whether its result is one of them (or a view of one): "
                                 "ordered as each of their storages too (may_alias)" if may_alias else ""))
        alias = self.shared(node) or alias or (sources[0] if len(sources) == 1 else None)
        if (alias is None and kind == "call_module" and self.storage(node) is None and node.args
                and isinstance(node.args[0], fx.Node)
                and isinstance(self.gm.get_submodule(node.target), _MODULES_RETURNING_INPUT)):
            alias = self.name_of(node.args[0])  # no val says whether it is its input or a view of it: take it to be
        if alias is None and kind == "call_module" and isinstance(self.gm.get_submodule(node.target), fx.GraphModule):
            alias = self.hop_alias(node, [self.gm.get_submodule(node.target)])
            several = self.one_of.pop(name, ())
            if several and not self.covered(node):
                may_alias = tuple(dict.fromkeys((*may_alias, *several)))
        if isinstance(node.target, torch._ops.HigherOrderOperator):
            # its subgraph reads tensors of its own (make_fx's constant for a buffer a `cond` branch
            # closes over) that no operand names: a barrier where a get_attr of the graph writes one
            # (`_module_state_barriers`), as a called module reading its state is
            state = frozenset(k for sub in _subgraphs(self.gm, node) for k in map(_storage_key, _graph_tensors(sub))
                              if k is not None)
            if state:
                self.module_calls.append((name, state))
        if (info.cast or pads_first_dim_end(node)) and not writes:
            if alias is None and self.pads_for_gather(node):
                # the shard as gathered: a rank whose shard is whole gathers it as it is (no pad),
                # one with a smaller shard pads it first; taken for the shard itself (`alias`: no
                # storage, no time, `cost/`; read until the gather's wait), every rank's graph
                # orders and prices as the one without pads, so the cost-guided passes take the
                # same decisions on every rank (`bucket` packed 6 gathers on rank 0, 4 on rank 1)
                alias = operands[0]
            return Cast.make(name, operands, phase, types, target=target, alias=alias)
        # a call fxsched cannot see into (a Python function of no known module, a module not from
        # torch.nn) may draw from the generator as it may write what it is given: ordered with the
        # random ops too (two `torch.fx.wrap`'d `x + torch.randn_like(x)`, a leaf module's
        # `rand_like` and a `torch.rand_like`: 213 of 240 legal orders drew other numbers). A
        # higher-order op's subgraphs say (`draws_inside`).
        random = random or (unknown and not isinstance(node.target, torch._ops.HigherOrderOperator))
        return Compute.make(name, operands, phase, types, target=target, heavy=info.heavy, attention=info.attention,
                            random=random, writes=writes, alias=alias, may_alias=may_alias)

    def may_return(self, node: fx.Node, writes: tuple[str, ...]) -> tuple[str, ...]:
        """The operands a call fxsched cannot see into may return, or a view of one (`Op.may_alias`):
        every tensor it is given (its `writes`), unless a `meta["val"]` with storage says (`storage`:
        fresh, or shared with an operand, `shared`), or the val holds no tensor, or fxsched looks
        into the call after all (a higher-order op's subgraph, a called GraphModule: `hop_alias`)."""
        if not writes or self.storage(node) is not None:
            return ()
        value = node.meta.get("val")
        if value is not None and not isinstance(value, (torch.Tensor, list, tuple)):
            return ()  # an int, a bool, ...: no storage to share
        if node.op == "call_module":
            if isinstance(self.gm.get_submodule(node.target), fx.GraphModule):
                return ()
        elif isinstance(node.target, torch._ops.HigherOrderOperator) and _subgraphs(self.gm, node):
            return ()
        return writes

    def realias(self, first: str) -> tuple[str]:
        """The operands of the op being lowered, which reads `first` (an earlier input or
        get_attr), not its node's inputs."""
        operands = self.given[-1] = (first,)
        if self.numbers is not None:
            self.numbers[-1] = (self.aliasable[first],)
        return operands

    def positions(self, ops: list[Op]) -> list[tuple[int, ...]] | None:
        """Each op's operands as positions in `ops` (one op per node, in order): those recorded
        where the op still has the operands it was made with (the same tuple), else (an op made
        otherwise, or rewritten since: `_rebind`) found by name."""
        numbers = self.numbers
        if numbers is None:
            return None
        by_name = None
        for at in compress(range(len(ops)), map(is_not, map(_OPERANDS, ops), self.given)):
            if by_name is None:
                by_name = dict(zip(map(_NAME, ops), range(len(ops)))).__getitem__
            numbers[at] = tuple(map(by_name, ops[at].operands))
        return numbers

    def view(self, node: fx.Node, info: _Target, base: tuple) -> Op:
        """A schema alias: a view; one that may copy (reshape, contiguous, to) is a view when its
        `meta["val"]` shares its input's storage, a computation when it does not, and a `maybe` view
        (ordered as an alias, never the ground of a use-after-free) when there is no val."""
        name, operands, phase, types = base
        if not info.may_copy:
            return View.make(name, operands, phase, types, target=info.name)
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        if source is not None and self.storage(node) is not None and self.storage(source) is not None:
            if self.storage(node) == self.storage(source):
                return View.make(name, operands, phase, types, target=info.name)
            return Compute.make(name, operands, phase, types, target=info.name, heavy=info.heavy,
                                attention=info.attention)
        self.notes.append(f"%{node.name}: {info.name} may alias %{source.name if source else '?'} or copy it, and no "
                          "meta['val'] says which: ordered as an alias")
        return View.make(name, operands, phase, types, target=info.name, maybe=True)

    def collective(self, node: fx.Node, info: _Target, comm_type, base: tuple) -> Op:
        """A launch with its one wait, a wait on a launch, or else an opaque op that keeps its place."""
        name, operands, phase, types = base
        target = info.name
        writes, alias, _ = self.writes(node, info)
        group = _group(node, info)
        if info.schema.name == P2P_BATCH:
            self.p2p_batches.add(name)
            return Barrier.make(name, operands, phase, types, target=target, reason="point-to-point batch")
        if info.wait:
            source = next(iter(node._input_nodes)) if len(node._input_nodes) == 1 else None
            if (self.p2p_batches and source is not None and source.target is operator.getitem
                    and isinstance(source.args[0], fx.Node) and self.name_of(source.args[0]) in self.p2p_batches):
                # its result is a tensor the batch received into (whose users may name it), now complete
                return Barrier.make(name, operands, phase, types, target=target, reason="point-to-point batch")
            if (source is not None and source.target is operator.getitem and isinstance(source.args[0], fx.Node)
                    and self.name_of(source.args[0]) in self.coalesced):
                # one result of a coalesced launch
                return Wait.make(name, operands, phase, types, target=target, launch=self.name_of(source.args[0]))
            source = self.name_of(source) if source is not None else None
            if source not in self.launches:
                self.notes.append(f"%{node.name}: wait on {['%' + n.name for n in node.all_input_nodes]}, not on a "
                                  "launch: kept in place, in order with every group's collectives")
                # it completes whatever its operand's collective writes: take it to write its operand;
                # and it returns its operand (wait_tensor returns the tensor it is given, whose
                # schema says fresh): a write through either is ordered with reads of the other
                return Opaque.make(name, operands, phase, types, target=target, reason=WAIT_ON_NO_LAUNCH,
                                   writes=tuple(map(self.name_of, node.all_input_nodes)),
                                   alias=operands[0] if len(operands) == 1 else None)
            # a wait completes its launch's write: it writes (and returns) the launch's result too
            launch_writes = self.launch_writes.get(source, ())
            return Wait.make(name, operands, phase, types, target=target, writes=(source,) if launch_writes else (),
                             alias=source if launch_writes else None)
        if self.opaque(node):
            reason = ("synchronous collective" if synchronous_collective(info.schema)
                      else "coalesced collective whose results are not each waited once" if info.coalesced
                      else "collective not waited exactly once")
            if info.coalesced and info.result_alias is not None:
                # an in-place coalesced one (`all_reduce_coalesced_(inputs) -> Tensor[](a!)`) returns
                # its list: each getitem of the result is that input (`result_item`)
                given = self.argument(node, info.schema, info.result_alias)
                if isinstance(given, (list, tuple)):
                    self.results[name] = tuple(given)
            self.notes.append(f"%{node.name}: {target}: {reason}: kept in place, in order with group {group!r}")
            return Opaque.make(name, operands, phase, types, target=target, group=group,
                               group_size=_group_size(node, info), reason=reason, writes=writes, alias=alias)
        if comm_type in GATHER_TAGS:
            self.notes.append(f"%{node.name}: comm_type={comm_type!r} on {target}: not a gather, kept in order")
        role = Role.REDUCE_SCATTER if comm_type == REDUCE_SCATTER_TAG else None
        self.launches.add(name)
        if info.coalesced:
            self.coalesced.add(name)
        self.launch_writes[name] = writes
        launch = Launch.make(name, operands, phase, types, target=target, group=group,
                             group_size=_group_size(node, info), role=role, writes=writes, alias=alias,
                             reduce_op=_reduce_op(node, info))
        if node.meta.get(tags.UNORDERED) and launch.may_unorder:
            # a raised graph's mark (`unorder-reduce-scatters` ran on it before), where it may be
            # set; `_lower` notes a tag it ignores
            launch = attrs.evolve(launch, unordered=True)
        return launch

    def gather(self, node: fx.Node, target: str, role: Role, base: tuple) -> Launch:
        name, operands, phase, types = base
        info = self.target(node)
        if not self.waited(node):
            users = list(node.users)
            must = ("a getitem per result, each with one user, a wait_tensor" if info.coalesced
                    else "exactly one user, a wait_tensor")
            raise LoweringError(
                f"FSDP gather %{node.name} ({node.meta[tags.COMM_TYPE]}) must have {must}; "
                f"it has {[u.name for u in users]}")
        meta = node.meta
        hold = None
        bucket = meta.get(tags.BUCKET_ID)
        if bucket is not None:
            members = meta.get(tags.BUCKET_MEMBERS)
            if not isinstance(members, (list, tuple)) or not members or not all(isinstance(m, str) for m in members):
                self.notes.append(f"%{node.name}: bucket {bucket!r} has no valid fsdp_bucket_members ({members!r}): not moved")
                params, hold = (), BUCKET_WITHOUT_MEMBERS
            else:
                params = tuple(members)
            bucket = str(bucket)
        else:
            param = meta.get(tags.PARAM_NAME)
            if isinstance(param, str) and param:
                params = (param,)
            else:
                self.notes.append(f"%{node.name}: param_name={param!r} is not a name: not moved")
                params, hold = (), NO_PARAMETER_NAME
        self.launches.add(name)
        if info.coalesced:
            self.coalesced.add(name)
        # an `_out` gather (a bucket gathered into its packed buffer) writes its out buffer
        writes, alias, _ = self.writes(node, info)
        self.launch_writes[name] = writes
        return Launch.make(name, operands, phase, types, target=target, group=_group(node, info),
                           group_size=_group_size(node, info), role=role, nbytes=_nbytes(node, self.notes),
                           params=params, bucket=bucket, hold=hold,
                           prefetched=tags.PREFETCH_ANCHOR in meta,  # moved by an earlier run
                           writes=writes, alias=alias)

    def free(self, node: fx.Node, target: str, base: tuple) -> Op:
        name, operands, phase, types = base
        param = node.meta.get(tags.PARAM_NAME)
        members = node.meta.get(tags.BUCKET_MEMBERS)
        if isinstance(members, (list, tuple)) and members and all(isinstance(m, str) for m in members):
            params = tuple(members)
        elif isinstance(param, str) and param:
            params = (param,)
        else:
            self.notes.append(f"%{node.name}: storage free without param_name ({param!r}): kept as a barrier")
            return Barrier.make(name, operands, phase, types, target=target, reason="free without parameter name")
        if not node.all_input_nodes:
            self.notes.append(f"%{node.name}: storage free with no tensor operand: kept as a barrier")
            return Barrier.make(name, operands, phase, types, target=target, reason="free without operand")
        return Free.make(name, operands, phase, types, target=target, params=params)


def _group(node: fx.Node, info: _Target) -> str | None:
    """The `group_name` argument of a functional collective, as a string; None when absent."""
    if info.schema is None:
        return None
    if info.group_at is not None and info.group_at < len(node.args):
        return str(node.args[info.group_at])
    value = node.kwargs.get("group_name")
    return None if value is None else str(value)


def _reduce_op(node: fx.Node, info: _Target) -> str | None:
    """The `reduce_op` argument of a functional reduction (reduce_scatter_tensor, all_reduce), if a string."""
    at = info.reduce_op_at
    if at is None:
        return None
    value = node.args[at] if at < len(node.args) else node.kwargs.get("reduce_op")
    return value if isinstance(value, str) else None


def _group_size(node: fx.Node, info: _Target) -> int | None:
    """The `group_size` argument of a functional collective (all_gather_into_tensor,
    reduce_scatter_tensor, ...); None when the op has none or it is not a plain int."""
    if info.schema is None:
        return None
    value = node.kwargs.get("group_size")
    if info.group_size_at is not None and info.group_size_at < len(node.args):
        value = node.args[info.group_size_at]
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _rebind(ops: list[Op], rebinds: set[str], same: dict[str, str]) -> tuple[list[Op], list[tuple[str, str]]]:
    """`ops` with each use of a tensor after a `set_` of it reading the `set_` instead, and each
    use of a value in `same` reading the value it is.

    `x.set_(y)` makes the tensor object x view y's storage: its later uses (through x itself, or
    through the result of an in-place op on x, which is x) access y's storage, while views of x
    taken before keep x's. Storage roots are static per value, so such a use reads the `set_`
    (whose result aliases y) in the IR: raised, it reads the set_'s result, which is x.
    `same`: a getitem of a result -> the tensor the op was given and returns (an out= overload's,
    a c10d op's): raised, a use reads that tensor, the same object.
    Also returns (the FX input, the op) of each operand replaced: the op's FX node still reads
    that input, so a schedule relinked in place (`raise_in_place`) must keep it first (an
    explicit edge, added once the effects are derived).
    """
    identity: dict[str, str] = {}  # a value -> the tensor object it is (an in-place op's result is its operand)
    now: dict[str, str] = {}  # a tensor object -> the set_ that last rebound it
    result, replaced = [], []
    for op in ops:
        if now or same:
            def read(name: str) -> str:
                name = same.get(name, name)
                return now.get(identity.get(name, name), name)
            operands = tuple(map(read, op.operands))
            if operands != op.operands:
                replaced += [(before, op.name) for before, after in zip(op.operands, operands) if before != after]
                op = attrs.evolve(op, operands=operands, writes=tuple(dict.fromkeys(map(read, op.writes))),
                                  alias=None if op.alias is None else read(op.alias),
                                  may_alias=tuple(dict.fromkeys(map(read, op.may_alias))))
        if op.alias is not None and op.alias in op.writes:  # an in-place op returns the tensor it writes
            identity[op.name] = identity.get(op.alias, op.alias)
        if op.name in rebinds and op.operands:
            target = identity.get(op.operands[0], op.operands[0])
            identity[op.name] = target
            now[target] = op.name
        result.append(op)
    return result, replaced


def _module_state_barriers(ops: list[Op], lowering: _Lowering) -> None:
    """Make a barrier of each call_module whose module's state a get_attr of the graph writes
    (`self.lin(x)` and `self.lin.weight.add_(1)`), and of each higher-order op whose subgraph reads
    such a tensor of its own: no operand names what the call reads, so it was free to cross the
    write. Its result keeps what it aliases. In place in `ops`."""
    attribute = lowering.attribute_storage
    roots: dict[str, str] = {}
    written: set[int] = set()
    for op in ops:
        source = (op.operands[0] if op.operands else None) if isinstance(op, View) else op.alias
        if source is not None:
            roots[op.name] = roots.get(source, source)
        for name in op.writes:
            key = attribute.get(roots.get(name, name))
            if key is not None:
                written.add(key)
    calls = {name: state for name, state in lowering.module_calls if state & written}
    for at, op in enumerate(ops):
        if op.name in calls:
            lowering.notes.append(f"%{op.name}: the module it calls (or its subgraph) reads state a get_attr of the graph writes: "
                                  "kept as a barrier")
            ops[at] = Barrier.make(op.name, op.operands, op.phase, op.types, target=op.target, reason="module state",
                                   heavy=op.heavy, attention=op.attention, alias=op.alias, may_alias=op.may_alias)


def lower(gm: fx.GraphModule) -> Program:
    """Lower `gm` (left untouched) into a verified-ready Program with all effect edges."""
    with gc_paused():
        return _lower(gm)


def lower_in_order(gm: fx.GraphModule) -> tuple[Program, bool]:
    """`lower(gm)`, and whether each node's inputs are nodes of `gm`'s graph listed before it.
    Lowering finds that on its walk, numbering the nodes, and refuses a repeated name (the
    package face's lint need not test either again: `raising.lint.lint(..., lowered=True)`)."""
    with gc_paused():
        return _lower_in_order(gm)


def _lower(gm: fx.GraphModule) -> Program:
    return _lower_in_order(gm)[0]


def _lower_in_order(gm: fx.GraphModule) -> tuple[Program, bool]:
    lowering = _Lowering(gm)
    program = Program(origin=gm)
    nodes = list(gm.graph.nodes)
    # a fresh copy of each name, in one loop (`_Lowering.names`: one extra str, less a char)
    lowering.names = [(n.name + ".")[:-1] for n in nodes]
    ops = [lowering.lower(node) for node in nodes]
    replaced: list[tuple[str, str]] = []
    if lowering.rebinds or lowering.same:
        ops, replaced = _rebind(ops, set(lowering.rebinds), lowering.same)
    if lowering.module_calls:
        _module_state_barriers(ops, lowering)
    program.add_all(ops)
    # the names as add_all just entered them, in the graph's order: read off the node table's
    # own entries, not off the FX nodes again (each out of cache by now at 100k nodes)
    order = list(program.graph._node)
    program.payload.update(zip(order, nodes))
    if lowering.late_forward:
        program.notes.append(f"{lowering.late_forward} untagged nodes after the first backward node: "
                             "treated as backward")
    for node in lowering.unorder_tagged:
        op = program.op(node.name)
        if not getattr(op, "unordered", False):
            lowering.notes.append(f"%{node.name}: {tags.UNORDERED}={node.meta[tags.UNORDERED]!r} on a {op.KIND} that "
                                  "may not be unordered (only an FSDP gradient reduce-scatter of a known group, "
                                  "comm_type=fsdp_reduce_scatter, may): ignored, kept in order")
    program.notes[:0] = lowering.notes
    program.schedule = Schedule(order)
    try:
        # the ops in the schedule's (and the graph's) order, and their operands by position: no
        # lookup per name to find them again
        derive_effects(program, ops, lowering.positions(ops))
    except EffectError as exc:
        raise LoweringError(str(exc)) from exc
    for before, after in replaced:  # the FX node still reads what its op no longer names (`_rebind`)
        program.add_effect(before, after, EXPLICIT)
    # (`numbers` is None once a node read an input that is no node lowered before it)
    return program, lowering.numbers is not None
