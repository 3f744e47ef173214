"""ir/sizes.py: a program's structure apart from its sizes, and giving it other sizes — what
`runtime.agreement.agree_sizes` exchanges so that ranks that traced their own sizes (expert
parallelism's split sizes as numbers) schedule one program. The exchange itself runs on 2 gloo
ranks in tests/test_fronts_attack4.py."""

from __future__ import annotations

import pytest

from fxsched.cost.model import op_costs
from fxsched.ir import parse_program, print_program
from fxsched.ir.sizes import UNKNOWN_BYTES, sizes, structure, structure_digest, with_sizes


def _text(tokens: int, dp: str = "dp", ep: str = "ep", nbytes: str = "nbytes = 32, ", mul: str = "aten.mul.Tensor"):
    return f"""
%x = input : f32[600,8]
%w = input : f32[4]
^entry
%g = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {{group = "{dp}", role = fsdp_all_gather, {nbytes}params = ["w"]}} : f32[8]
%gw = wait(%g) : f32[8]
%a = launch "_c10d_functional.all_to_all_single.default"(%x) {{group = "{ep}"}} : f32[{tokens},8]
%aw = wait(%a) : f32[{tokens},8]
%m = compute "{mul}"(%aw, %gw) : f32[{tokens},8]
%s = compute "aten.sum.default"(%m) : f32[]
%output = output(%s)
"""


def test_programs_equal_but_for_sizes_and_group_names_have_one_structure():
    """Rank 0 receives 650 tokens, rank 1 550, and rank 1's groups have other names (a 2-D mesh):
    one structure. Another op is another structure; a launch whose size one rank does not know is
    not (its size is one of `sizes`)."""
    a, b = parse_program(_text(650)), parse_program(_text(550, dp="d1", ep="e1"))
    assert structure(a) == structure(b) and structure_digest(a) == structure_digest(b)
    assert sizes(a) != sizes(b)
    div = parse_program(_text(550, mul="aten.div.Tensor"))
    differ = [(x, y) for x, y in zip(structure(a), structure(div)) if x != y]
    assert len(differ) == 1 and "aten.mul.Tensor" in differ[0][0] and "aten.div.Tensor" in differ[0][1]
    assert structure_digest(div) != structure_digest(a)
    swapped = parse_program(_text(650, dp="ep", ep="dp"))  # named otherwise, still two groups in one order
    assert structure_digest(swapped) == structure_digest(a)
    one = parse_program(_text(650, dp="g", ep="g"))  # one group where there were two: other structure
    assert structure(one) != structure(a) and structure_digest(one) != structure_digest(a)
    unknown = parse_program(_text(650, nbytes=""))
    assert structure(unknown) == structure(a) and structure_digest(unknown) == structure_digest(a)


def test_with_sizes_gives_each_rank_the_largest_and_one_price_per_op():
    """The element-wise largest sizes, given to each rank's program, make the two programs print
    alike and the cost model price every op alike; an unknown extent (-1) takes a known one, an
    unknown launch size (`UNKNOWN_BYTES`) stays unknown."""
    a, b = parse_program(_text(650)), parse_program(_text(550, nbytes=""))
    assert op_costs(a) != op_costs(b)
    largest = [max(x, y) for x, y in zip(sizes(a), sizes(b))]
    assert UNKNOWN_BYTES in largest
    assert with_sizes(a, largest) == ["g"]  # only its size was unknown elsewhere
    assert with_sizes(b, largest) == ["a", "aw", "m"]
    assert print_program(a) == print_program(b) and a.op("g").nbytes is None
    assert op_costs(a) == op_costs(b)
    assert with_sizes(a, largest) == []  # already so
    with pytest.raises(ValueError, match="sizes"):
        with_sizes(a, largest[:-1])
