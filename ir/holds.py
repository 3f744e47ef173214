"""Hold reasons: why a gather stays where it is, each with its explanation, in one registry.

A pass that keeps a gather in place records a reason on its launch (`Launch.hold`); `explain`
and the report print the reason's text from here. Lowering's holds mark malformed tags and
survive every pass; every other hold is a pass's, which a later run may set afresh. A new pass
registers its reasons next to its code:

    TOO_COLD = register_hold("too cold", "the gather's consumer runs too rarely to be worth it")

and never needs to be listed anywhere else: a reason not registered as lowering's is a pass's.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Hold:
    reason: str        # the short text recorded on the launch and counted in statistics
    explanation: str   # what it means, for `fxsched explain`
    by_lowering: bool  # set by lowering for malformed tags: no pass may clear it


HOLDS: dict[str, Hold] = {}


def register_hold(reason: str, explanation: str, *, by_lowering: bool = False) -> str:
    """Add a hold reason; returns `reason`, so a module keeps it as a named constant."""
    known = HOLDS.get(reason)
    if known is not None and known != Hold(reason, explanation, by_lowering):
        raise ValueError(f"hold reason {reason!r} is already registered with another meaning")
    HOLDS[reason] = Hold(reason, explanation, by_lowering)
    return reason


def explain_hold(reason: str) -> str:
    """The explanation of `reason` (the reason itself if nobody registered it)."""
    hold = HOLDS.get(reason)
    return hold.explanation if hold else reason


def held_by_lowering(reason: str | None) -> bool:
    hold = HOLDS.get(reason) if reason is not None else None
    return hold is not None and hold.by_lowering


# ---- lowering: malformed tags ---------------------------------------------------------
NO_PARAMETER_NAME = register_hold("no parameter name", "its tags name no parameter (param_name): left alone",
                                  by_lowering=True)
BUCKET_WITHOUT_MEMBERS = register_hold("bucket without members",
                                       "its bucket lists no members (fsdp_bucket_members): left alone",
                                       by_lowering=True)

# ---- the scheduling passes ------------------------------------------------------------
FIRST_GROUP = register_hold("first group",
                            "its consumer is the first of its phase: no earlier compute to hide it behind")
DEPTH_0 = register_hold("depth 0", "prefetch depth is 0 in its phase")
NO_CONSUMER = register_hold("no consumer", "nothing reads what it gathers")
NO_EARLIER_SLOT = register_hold("no earlier legal slot",
                                "an input, a barrier, a free or the start of its phase keeps it where it is")
OVER_BUDGET = register_hold("over budget", "launching it early would put more unsharded bytes in flight than "
                                           "max-in-flight-gb allows")
UNKNOWN_SIZE = register_hold("unknown size", "its unsharded size is unknown (fsdp_unsharded_nbytes), so the "
                                             "budget cannot admit it")
HIDDEN = register_hold("hidden where it is",
                       "the cost model says its communication already ends before its consumer needs it")
NOT_HIDDEN = register_hold("cannot be hidden", "even its earliest legal launch leaves some communication exposed "
                                               "(the cost model says so)")

# ---- the joint peak-memory cap (passes/memory_cap.py): any pass that raises memory ------
OVER_PEAK_CAP = register_hold("over peak cap", "moving or rewriting it (bucketing it, keeping its replica unsharded) "
                                               "would raise the simulated peak memory over the cap (memory-cap, "
                                               "--max-peak-gb / --max-peak-increase-gb, or bucket's or unshard's own "
                                               "max-peak-gb / max-peak-increase-gb)")

# ---- the rewriting passes (bucket, unshard) ----------------------------------------------
SAVES_TOO_LITTLE = register_hold("saves too little", "rewriting it (joining a bucket, or reading the forward "
                                                     "replica instead of re-gathering it) would not shorten the "
                                                     "simulated step enough: by more than bucket's min-saved-ms "
                                                     "(so at all, when it is 0), by at least unshard's (at all, "
                                                     "when it is 0)")
