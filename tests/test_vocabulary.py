"""One vocabulary: op classes, hold reasons, FX tag names and pass options are each declared
once, and every stage reads the same declaration."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import attrs
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxsched.cost.model import flops
from fxsched.ir import Launch, parse_program, print_program
from fxsched.ir.holds import HOLDS, explain_hold, held_by_lowering, register_hold
from fxsched.lowering import lower
from fxsched.passes import ModulePass, PassManager, PassResult, PipelineError, make_pass, register_pass
from fxsched.passes.base import PASSES, option

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_baddbmm_is_heavy_for_lowering_and_a_matmul_for_the_cost_model():
    gm = make_fx(lambda b, x, y: torch.baddbmm(b, x, y).relu())(torch.randn(2, 3, 5), torch.randn(2, 3, 4),
                                                                  torch.randn(2, 4, 5))
    program = lower(gm)
    (op,) = [op for op in program.ops() if getattr(op, "target", "").startswith("aten.baddbmm")]
    assert op.heavy
    assert flops(op, program) == 2 * 2 * 3 * 5 * 4
    relu = next(op for op in program.ops() if getattr(op, "target", "").startswith("aten.relu"))
    assert not relu.heavy and flops(relu, program) is None


GATHER = """\
%x = input
%w = input
%v = input
^entry
%m = compute "aten.mm"(%x, %x) {heavy}
%a = launch "ag"(%w) {role = fsdp_all_gather, nbytes = 4, params = ["w"]}
%t = wait(%a)
%n = compute "aten.mm"(%m, %t) {heavy}
%b = launch "ag"(%v) {role = fsdp_all_gather, nbytes = 4, params = ["v"], hold = "no parameter name"}
%u = wait(%b)
%k = compute "aten.mm"(%n, %u) {heavy}
%output = output(%k)
"""


@register_pass
@dataclasses.dataclass(frozen=True)
class HoldEverything(ModulePass):
    """test pass: holds every gather with `reason`."""

    name = "hold-everything"
    reorders_only = True
    reason: str = option("too cold", "the hold reason to record")

    def apply(self, ctx, program):
        for op in list(program.ops()):
            if isinstance(op, Launch) and op.is_gather:
                program.replace(attrs.evolve(op, hold=self.reason, anchor=None, prefetched=False))
        return PassResult(True)


register_hold("too cold", "the test says so")


@pytest.mark.parametrize("reason", ["too cold", "never registered"])
def test_a_new_passs_hold_is_never_taken_for_a_lowering_hold(reason):
    program = parse_program(GATHER)
    PassManager(f"hold-everything{{reason={reason}}}").run(program)
    assert not held_by_lowering(program.op("a").hold)
    # the anchor pass decides afresh where a pass held a gather (lowering's holds: next test)
    PassManager("anchor").run(program)
    assert program.op("a").hold == "first group"
    assert program.op("b").hold is None and program.op("b").anchor == "n"
    assert explain_hold("too cold") == "the test says so" and explain_hold("never registered") == "never registered"


def test_lowerings_holds_survive_every_pass():
    program = parse_program(GATHER)
    PassManager("default").run(program)
    assert program.op("b").hold == "no parameter name" and held_by_lowering("no parameter name")
    assert HOLDS["no parameter name"].by_lowering and not HOLDS["first group"].by_lowering


def test_a_hold_reason_cannot_change_meaning():
    with pytest.raises(ValueError, match="already registered"):
        register_hold("first group", "something else")


@register_pass
@dataclasses.dataclass(frozen=True)
class Scaled(ModulePass):
    """test pass with a float option whose default is written as an int."""

    name = "scaled-test"
    factor: float = option(1, "a float, though its default is written 1")

    def apply(self, ctx, program):
        return PassResult(False, {"factor": self.factor})


def test_option_types_come_from_annotations_and_help_from_the_declaration():
    assert make_pass("scaled-test", "factor=1.5").factor == 1.5  # type(default) would have said int
    with pytest.raises(PipelineError, match="option 'factor' wants a float, got 'x'"):
        make_pass("scaled-test", "factor=x")
    assert Scaled.option_type("factor") is float and Scaled.option_help("factor").startswith("a float")
    for name, cls in PASSES.items():
        for text_name in cls.options():
            assert cls.option_type(text_name) in (bool, int, float, str), (name, text_name)
            if cls.__module__.startswith("fxsched."):
                assert cls.option_help(text_name), f"{name}: option {text_name} has no help"


def test_fxsched_passes_prints_each_options_type_default_and_help():
    done = subprocess.run([sys.executable, "-m", "fxsched", "passes"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "    max-in-flight-gb: float = 1.0\n        most unsharded GiB launched early and not yet consumed\n" in done.stdout
    assert "    forward-depth: int = 1\n" in done.stdout and "    hoist: bool = true\n" in done.stdout


def test_ir_imports_nothing_of_the_other_stages_nor_torch():
    for path in sorted((ROOT / "ir").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, f"{path.name} imports ..{node.module}"
                assert node.level == 1 or not (node.module or "").startswith(("torch", "fxsched")), path.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.split(".")[0] in ("torch", "fxsched") for a in node.names), path.name
    done = subprocess.run([sys.executable, "-c", "import sys, fxsched.ir, fxsched.ir.tags, fxsched.ir.opclass; "
                           "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_front_lowering_and_runtime_read_tag_names_from_one_module():
    """No FX tag name is spelled as a string outside ir/tags.py (tests and docs aside)."""
    from fxsched.ir import tags

    names = {v for k, v in vars(tags).items() if k.isupper() and isinstance(v, str)} - {"barrier"}
    for folder in ("front", "lowering", "runtime", "integrations", "ir", "passes"):
        for path in sorted((ROOT / folder).glob("*.py")):
            if path.name == "tags.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    raise AssertionError(f"{folder}/{path.name}:{node.lineno} spells the tag {node.value!r}")
    assert print_program(parse_program(GATHER)) == GATHER


def test_the_functional_collective_namespaces_are_spelled_once():
    """ir/opclass.py's `COLLECTIVE_NAMESPACES` is what lowering and runtime/agreement.py read as
    collectives, and what `op_name` and `is_point_to_point` read: it was lowering/targets.py's, and
    ir/opclass.py spelled the namespaces twice more (ir/ may not import lowering/)."""
    from fxsched.ir import opclass
    from fxsched.lowering import structural, targets
    from fxsched.runtime import agreement

    spelled = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
    assert opclass.COLLECTIVE_NAMESPACES == spelled
    assert targets.COLLECTIVE_NAMESPACES is structural.COLLECTIVE_NAMESPACES is opclass.COLLECTIVE_NAMESPACES
    assert agreement._NAMESPACES == (*spelled, "c10d")
    paths = [*sorted((ROOT / "ir").glob("*.py")), *sorted((ROOT / "lowering").glob("*.py")),
             ROOT / "runtime" / "agreement.py"]
    found = [f"{path.parent.name}/{path.name}:{node.lineno}" for path in paths
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and node.value in spelled]
    assert len(found) == len(spelled) and {place.split(":")[0] for place in found} == {"ir/opclass.py"}, found
