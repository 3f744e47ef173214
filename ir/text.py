"""The IR's text form: `print_program` and `parse_program`, so tests can write programs by hand.

    %x = input
    ^entry
    %ag = launch "all_gather_into_tensor"(%w) {role = fsdp_all_gather, nbytes = 4096, params = ["w"]}
    %wt = wait(%ag)
    %mm = compute "aten.mm"(%x, %wt) {heavy} : f32[8,16]
    ^backward
    %output = output(%mm)

An in-place op says what it writes, and whose storage its result shares:

    %t2 = compute "aten.add_.Tensor"(%t, %eps) {writes = [%t], alias = %t}

and a call fxsched cannot see into, whose result may be one of its tensors (or a view of one),
says which storages its result may share:

    %r = compute "mystery"(%a, %b) {writes = [%a, %b], may_alias = [%a, %b]}

A coalesced launch has a result per operand; each is a view (getitem) waited by a wait that
names the launch:

    %ag = launch "_c10d_functional.all_gather_into_tensor_coalesced.default"(%a, %b) : (f32[8], f32[8])
    %r0 = view "getitem"(%ag) : f32[8]
    %w0 = wait(%r0) {launch = %ag} : f32[8]

One op per line in schedule order, with its result type(s) after `:` when known (`?` is an
unknown extent, `none` a non-tensor output); ops after `^backward` are backward (an op may say `fwd`
or `bwd` to differ). Effect edges are derived from the rules on parse; `effect %a -> %b`
lines add more. `//` starts a comment.
"""

from __future__ import annotations

import json
import re

import attrs

from .effects import BACKWARD, derive_effects
from .errors import InputError
from .ops import DTYPE_BYTES, OP_KINDS, Marker, Op, Phase, Role, TensorType
from .program import DATA, Program, Schedule
from .storage import EffectError


class ParseError(InputError):
    """Bad IR text; the message gives the line and column, with a caret under the spot."""

    def __init__(self, message: str, line: int, column: int, text: str = ""):
        self.message, self.line, self.column = message, line, column
        shown, caret = text, column - 1
        if len(text) > 100:  # a window around the spot, not a line of thousands of characters
            start = max(0, caret - 50)
            shown = ("..." if start else "") + text[start:start + 100] + ("..." if start + 100 < len(text) else "")
            caret = caret - start + (3 if start else 0)
        pointer = f"\n  {shown}\n  {' ' * caret}^" if text else ""
        super().__init__(f"line {line}, column {column}: {message}{pointer}")


# ---- printing -------------------------------------------------------------------------

def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum_types):
        return value.value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


enum_types = (Role, Phase)
EXPLICIT = "explicit"


def _ref(name: str) -> str:
    return name if name.startswith("^") else f"%{name}"


def print_op(op: Op, region: Phase = Phase.FORWARD, with_phase: bool = True) -> str:
    if isinstance(op, Marker):
        return op.name
    fields = op.fields()
    target = fields.pop("target", "")
    head = f"%{op.name} = {op.KIND}"
    if target:
        head += f" {json.dumps(target)}"
    if op.operands or op.KIND not in ("input", "constant"):
        head += "(" + ", ".join(f"%{o}" for o in op.operands) + ")"
    attrs_out = []
    defaults = {f.name: f.default for f in attrs.fields(type(op))}
    if with_phase and op.phase is not region and op.KIND not in ("input", "output"):
        attrs_out.append(op.phase.value)
    for key, value in fields.items():
        if value == defaults.get(key):
            continue
        if value is True:
            attrs_out.append(key)
        elif key in ("anchor", "alias", "launch"):  # references to nodes
            attrs_out.append(f"{key} = {_ref(value)}")
        elif key in ("writes", "may_alias"):  # lists of references to nodes
            attrs_out.append(f"{key} = [" + ", ".join(map(_ref, value)) + "]")
        else:
            attrs_out.append(f"{key} = {_value(value)}")
    if attrs_out:
        head += " {" + ", ".join(attrs_out) + "}"
    if op.types:
        types = ", ".join(str(t) for t in op.types)
        head += f" : {types}" if len(op.types) == 1 else f" : ({types})"
    return head


def print_program(program: Program, effects: bool = False) -> str:
    """Ops in schedule order, then `effect` lines for explicit edges (the derived ones are
    derived again on parse); with `effects`, the derived effect edges follow as comments."""
    lines = []
    region = Phase.FORWARD
    for name in program.schedule:
        op = program.op(name)
        if name == BACKWARD:
            region = Phase.BACKWARD
        lines.append(print_op(op, region))
    edges = sorted(program.effect_edges(), key=lambda e: (program.schedule.index(e[1]), e[0]))
    lines.extend(f"effect {_ref(u)} -> {_ref(v)}" for u, v, why in edges if why == EXPLICIT)
    if effects:
        for u, v, why in edges:
            if why != EXPLICIT:
                lines.append(f"// effect {_ref(u)} -> {_ref(v)} ({why})")
    return "\n".join(lines) + "\n"


# ---- parsing --------------------------------------------------------------------------

_TOKEN = re.compile(r"""
    (?P<space>\s+) | (?P<comment>//.*) |
    (?P<ref>%[A-Za-z_][\w.\-]*) | (?P<marker>\^[A-Za-z_]\w*) |
    (?P<string>"(?:[^"\\]|\\.)*") | (?P<number>-?\d+) |
    (?P<arrow>->) | (?P<ident>[A-Za-z_][\w.]*) | (?P<punct>[=(){}\[\],:?])
""", re.VERBOSE)


class _Line:
    def __init__(self, text: str, number: int):
        self.text, self.number = text, number
        self.tokens: list[tuple[str, str, int]] = []
        at = 0
        while at < len(text):
            m = _TOKEN.match(text, at)
            if not m:
                raise ParseError(f"unexpected character {text[at]!r}", number, at + 1, text)
            if m.lastgroup not in ("space", "comment"):
                self.tokens.append((m.lastgroup, m.group(), at + 1))
            at = m.end()
        self.i = 0

    def error(self, message: str):
        column = self.tokens[self.i][2] if self.i < len(self.tokens) else len(self.text) + 1
        raise ParseError(message, self.number, column, self.text)

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i][:2] if self.i < len(self.tokens) else ("end", "")

    def take(self, kind: str, value: str | None = None) -> str:
        got_kind, got = self.peek()
        if got_kind != kind or (value is not None and got != value):
            want = repr(value) if value is not None else kind
            self.error(f"expected {want}, found {got!r}" if got else f"expected {want}, found end of line")
        self.i += 1
        return got

    def accept(self, kind: str, value: str | None = None) -> bool:
        got_kind, got = self.peek()
        if got_kind == kind and (value is None or got == value):
            self.i += 1
            return True
        return False


#: the largest integer IR text may write: sizes and extents are int64 where they are used
MAX_INT = 2**63 - 1
#: how deep `[...]` lists may nest (attribute values are flat lists; this bounds the recursion)
MAX_NESTING = 16


def _number(line: _Line) -> int:
    """The number token at the cursor as an int, or a ParseError if it does not fit int64."""
    value = line.peek()[1]
    digits = value.lstrip("-")
    if len(digits) > 19 or int(digits) > MAX_INT:  # int() of thousands of digits is refused, or slow
        line.error(f"number {value[:24]}{'...' if len(value) > 24 else ''} is out of range "
                   f"(at most {MAX_INT} in magnitude)")
    line.i += 1
    return int(value)


def _string(line: _Line) -> str:
    """The string token at the cursor, decoded as JSON does (the printer writes it so)."""
    value = line.peek()[1]
    try:
        decoded = json.loads(value)
    except ValueError as exc:  # a bad escape, a raw control character (a tab, ...)
        reason = getattr(exc, "msg", str(exc))
        if "control character" in reason:
            reason = "a raw control character (a tab, a newline, ...) in a string"
        at = getattr(exc, "pos", 0)
        column = line.tokens[line.i][2] + at
        raise ParseError(f"bad string: {reason} (write a tab as \\t, a backslash as \\\\)",
                         line.number, column, line.text) from None
    line.i += 1
    return decoded


def _parse_value(line: _Line, depth: int = 0):
    kind, value = line.peek()
    if kind == "string":
        return _string(line)
    if kind == "number":
        return _number(line)
    if kind == "ref":
        line.i += 1
        return value[1:]
    if kind == "marker":
        line.i += 1
        return value
    if kind == "ident":
        line.i += 1
        return {"true": True, "false": False}.get(value, value)
    if line.accept("punct", "["):
        if depth >= MAX_NESTING:
            line.i -= 1
            line.error(f"lists nest more than {MAX_NESTING} deep")
        items = []
        while not line.accept("punct", "]"):
            if items:
                line.take("punct", ",")
            items.append(_parse_value(line, depth + 1))
        return tuple(items)
    line.error(f"expected a value, found {value!r}")


def _convert(cls: type[Op], key: str, value, line: _Line, column_at: int):
    if key == "role":
        try:
            return Role(value)
        except ValueError:
            line.i = column_at
            line.error(f"unknown role {value!r}; roles: {[r.value for r in Role]}")
    if key in ("bucket", "group") and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    declared = str(attrs.fields_dict(cls)[key].type)
    if not any(_is_a(value, part.strip()) for part in declared.split("|")):
        line.i = column_at
        line.error(f"{cls.KIND} attribute {key!r} takes {declared}, not {_value(value)}")
    return value


def _is_a(value, declared: str) -> bool:
    """Does a parsed value fit a field's declared type (as written in ir/ops.py)?"""
    if declared == "bool":
        return isinstance(value, bool)
    if declared == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if declared == "str":
        return isinstance(value, str)
    if declared == "tuple[str, ...]":
        return isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    return False


def _parse_types(line: _Line) -> tuple[TensorType, ...]:
    """`f32[3,4]`, `none`, or a parenthesised list of them."""
    if line.accept("punct", "("):
        types = [_parse_type(line)]
        while line.accept("punct", ","):
            types.append(_parse_type(line))
        line.take("punct", ")")
        return tuple(types)
    return (_parse_type(line),)


def _parse_type(line: _Line) -> TensorType:
    at = line.i
    dtype = line.take("ident")
    if dtype == "none":
        return TensorType("none")
    if dtype not in DTYPE_BYTES:
        line.i = at
        line.error(f"unknown dtype {dtype!r}; dtypes: {sorted(DTYPE_BYTES)}")
    line.take("punct", "[")
    dims: list[int] = []
    while not line.accept("punct", "]"):
        if dims:
            line.take("punct", ",")
        if line.accept("punct", "?"):
            dims.append(-1)
        elif line.peek()[0] == "number":
            dims.append(_number(line))
        else:
            line.take("number")  # the error: expected a number
    return TensorType(dtype, tuple(dims))


def _take_node(line: _Line) -> str:
    """A `%name` or `^marker` reference; returns the node name."""
    if line.peek()[0] == "marker":
        return line.take("marker")
    return line.take("ref")[1:]


def _parse_op(line: _Line, region: Phase) -> Op:
    name = line.take("ref")[1:]
    line.take("punct", "=")
    at = line.i
    keyword = line.take("ident")
    cls = OP_KINDS.get(keyword)
    if cls is None or cls is Marker:
        line.i = at
        line.error(f"unknown op kind {keyword!r}; kinds: {sorted(k for k in OP_KINDS if k != 'marker')}")
    # inputs and the output belong to no phase: they keep the default, as lowering gives them
    kwargs: dict = {"name": name, "phase": Phase.FORWARD if cls.KIND in ("input", "output") else region}
    if line.peek()[0] == "string":
        kwargs["target"] = _string(line)
    operands = []
    if line.accept("punct", "("):
        while not line.accept("punct", ")"):
            if operands:
                line.take("punct", ",")
            operands.append(line.take("ref")[1:])
    kwargs["operands"] = tuple(operands)
    known = {f.name for f in attrs.fields(cls)} - {"name", "operands", "phase", "types"}
    if line.accept("punct", "{"):
        first = True
        while not line.accept("punct", "}"):
            if not first:
                line.take("punct", ",")
            first = False
            at = line.i
            key = line.take("ident")
            if key in ("fwd", "bwd"):
                kwargs["phase"] = Phase(key)
                continue
            if key not in known:
                line.i = at
                line.error(f"{keyword} has no attribute {key!r}; it has {sorted(known)}")
            if line.accept("punct", "="):
                value_at = line.i
                kwargs[key] = _convert(cls, key, _parse_value(line), line, value_at)
            else:
                kwargs[key] = _convert(cls, key, True, line, at)
    if line.accept("punct", ":"):
        kwargs["types"] = _parse_types(line)
    if line.peek()[0] != "end":
        line.error(f"unexpected {line.peek()[1]!r} after the op")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        line.i = 0
        line.error(f"bad {keyword}: {exc}")


def parse_program(text: str) -> Program:
    """Parse the text form; effect edges are derived from the rules (see ir/effects.py)."""
    program = Program()
    order: list[str] = []
    defined: dict[str, int] = {}
    region = Phase.FORWARD
    explicit: list[tuple[str, str, _Line]] = []
    uses: list[tuple[Op, _Line]] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = _Line(raw, number)
        if not line.tokens:
            continue
        kind, value = line.peek()
        if kind == "marker":
            line.i += 1
            if line.peek()[0] != "end":
                line.error("a marker stands alone on its line")
            if value == BACKWARD:
                region = Phase.BACKWARD
            op: Op = Marker(name=value, phase=region)
        elif kind == "ident" and value == "effect":
            line.i += 1
            before = _take_node(line)
            line.take("arrow")
            after = _take_node(line)
            if line.peek()[0] != "end":
                line.error(f"unexpected {line.peek()[1]!r} after the effect")
            explicit.append((before, after, line))
            continue
        else:
            op = _parse_op(line, region)
        if op.name in defined:
            line.i = 0
            line.error(f"%{op.name} is already defined on line {defined[op.name]}")
        defined[op.name] = number
        program.graph.add_node(op.name, op=op)
        order.append(op.name)
        uses.append((op, line))
    for op, line in uses:
        for operand in op.operands:
            if operand not in defined:
                line.i = next(i for i, t in enumerate(line.tokens) if t[1] == f"%{operand}")
                line.error(f"%{operand} is not defined")
            program.graph.add_edge(operand, op.name, kind=DATA)
        refs = (*op.writes, *((op.alias,) if op.alias is not None else ()), *op.may_alias,
                *filter(None, (getattr(op, "launch", None),)))
        for ref in refs:
            if ref not in defined:  # the effects below look them up (verify says they must be operands)
                line.i = next(i for i, t in enumerate(line.tokens) if t[1] == f"%{ref}")
                line.error(f"%{ref} is not defined")
    program.schedule = Schedule(order)
    try:
        derive_effects(program)
    except EffectError as exc:  # the text's own order breaks a rule: point at the op it names
        line = _line_of(exc, uses)
        raise ParseError(str(exc), line.number if line else 1, 1, line.text if line else "") from None
    for before, after, line in explicit:
        for ref in (before, after):
            if ref not in program.graph:  # markers may be added by derive_effects
                line.i = next(i for i, t in enumerate(line.tokens) if t[1] in (ref, f"%{ref}"))
                line.error(f"{ref if ref.startswith('^') else '%' + ref} is not defined")
        program.add_effect(before, after, EXPLICIT)
    return program


def _line_of(exc: Exception, uses: list[tuple[Op, _Line]]) -> _Line | None:
    """The line of the first op an error message names (`%name`), if any."""
    lines = {op.name: line for op, line in uses}
    for ref in re.findall(r"%([A-Za-z_][\w.\-]*)", str(exc)):
        if ref in lines:
            return lines[ref]
    return None
