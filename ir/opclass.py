"""Op classes by target name — matmuls, attention, heavy, point-to-point — and the functional
collectives' namespaces, in one place.

Lowering marks ops `heavy` / `attention` with these (the anchor pass prefetches behind heavy
ops and spreads over attention intervals), and the cost model prices the same ops as matmuls
or attention: a target is heavy for both or for neither.
"""

from __future__ import annotations

#: matmul-like ops by their short name (`aten.baddbmm.default` -> `baddbmm`)
MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"})
#: a target whose name holds one of these is attention (forward or backward)
ATTENTION_NAMES = ("scaled_dot_product", "flash_attention", "npu_fusion_attention")
#: the functional collectives' op namespaces (lowering's collectives, runtime/agreement's).
#: `_c10d_functional_autograd` holds the autograd forms of all_to_all_single, all_gather_into_tensor
#: and reduce_scatter_tensor (funcol's `*_autograd`, kept by make_fx with `pre_dispatch=True` and
#: torch.export): the same async collectives, completed by a `wait_tensor` (read as compute, a
#: write of the input could go between it and its wait)
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd")
_NAMESPACES = ("aten", "prims", *COLLECTIVE_NAMESPACES, "npu")
#: point-to-point collectives (a send or a receive, matched by one peer's), by their short name
POINT_TO_POINT = frozenset({"isend", "irecv"})


def op_name(target: str) -> str:
    """`aten.mm.default` -> `mm`; `aten::addmm` -> `addmm`; `torch._C._nn.linear` -> `linear`."""
    parts = target.replace("::", ".").split(".")
    if len(parts) >= 2 and parts[0] in _NAMESPACES:
        return parts[1]
    return parts[-1]


def is_matmul(target: str) -> bool:
    return op_name(target) in MATMULS


def is_attention(target: str) -> bool:
    return any(a in target for a in ATTENTION_NAMES)


def is_attention_backward(target: str) -> bool:
    """Backward attention: the target says `backward` (aten) or ends in `_grad` (npu_fusion_attention_grad)."""
    return "backward" in target or op_name(target).endswith("_grad")


def is_heavy(target: str) -> bool:
    """Compute worth hiding a gather behind: a matmul or attention."""
    return is_matmul(target) or is_attention(target)


def is_point_to_point(target: str) -> bool:
    """A send or a receive (`_c10d_functional.isend` / `irecv`): its wait blocks until one peer
    posts the matching receive or send (ir/effects.py's `p2p-order`)."""
    return target.startswith(COLLECTIVE_NAMESPACES) and op_name(target) in POINT_TO_POINT
