"""The IR: op kinds, programs (graph + schedule), effect rules, verifier and text form."""

from .effects import BACKWARD, ENTRY, derive_effects
from .ops import (OP_KINDS, Barrier, Cast, Compute, Constant, CopyOut, Free, Input,
                  Launch, Marker, Op, Opaque, Output, Phase, Role, TensorType, View, Wait, irop)
from .ops import DTYPE_BYTES
from .program import DATA, EFFECT, Program, Schedule
from .storage import EffectError, maybe_storages, storage_candidates, storage_readers, storage_root
from .text import ParseError, parse_program, print_op, print_program
from .verify import VerifyError, verify, verify_moves
from .waits import result_views, waits_of

__all__ = [
    "BACKWARD", "DATA", "EffectError", "EFFECT", "ENTRY", "OP_KINDS", "Barrier", "Cast",
    "Compute", "Constant", "CopyOut", "Free", "Input", "Launch", "Marker", "Op", "Opaque", "Output", "ParseError",
    "Phase", "Program", "Role", "Schedule", "TensorType", "DTYPE_BYTES", "VerifyError", "View", "Wait", "derive_effects",
    "irop", "maybe_storages", "parse_program", "print_op", "print_program", "storage_candidates", "storage_readers",
    "storage_root",
    "verify", "verify_moves", "result_views", "waits_of",
]
