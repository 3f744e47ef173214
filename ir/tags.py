"""The FX tag vocabulary: the `node.meta` keys and values an FSDP graph pass leaves, and the
ones fxsched writes back, in one place for front/, lowering/, runtime/ and integrations/.

Only lowering interprets them (docs/design.md, "The input fxsched expects"); the others write
them (front/, structural tagging) or read them to check ranks agree (runtime/). Plain strings:
nothing here imports torch.
"""

# ---- keys of node.meta ------------------------------------------------------------------
COMM_TYPE = "comm_type"                      # what a collective or free is for (values below)
PARAM_NAME = "param_name"                    # the parameter a gather, free or reduce-scatter is for
UNSHARDED_NBYTES = "fsdp_unsharded_nbytes"   # a gather's unsharded size (int >= 0; else unknown)
BUCKET_ID = "fsdp_bucket_id"                 # a bucketed gather's bucket
BUCKET_MEMBERS = "fsdp_bucket_members"       # ... and the parameters in it
BUCKET_COPY_OUT = "fsdp_bucket_copy_out"     # on an aten.clone: copies a member out of bucket <id>
AUTOGRAD_BACKWARD = "autograd_backward"      # true: the node is in the backward phase
BARRIER = "barrier"                          # true: nothing moves across this node
PREFETCH_ANCHOR = "fsdp_prefetch_anchor"     # written on a moved gather: the node it launches before
UNORDERED = "fsdp_unordered"                 # written true on a reduce-scatter marked unordered (Launch.unordered)
STRUCTURAL = "fsdp_structural"               # written by structural tagging on what it tagged
GRADIENT_REDUCTION = "fsdp_gradient_reduction"  # ... and the kind of a gradient reduction it found

# ---- keys of GraphModule.meta -----------------------------------------------------------
PREFETCH_COUNTS = "fsdp_prefetch"            # {"forward", "backward", "sunk"} after the drop-in ran

# ---- values of COMM_TYPE ----------------------------------------------------------------
ALL_GATHER = "fsdp_all_gather"
ALL_GATHER_BACKWARD = "fsdp_all_gather_backward"   # a re-gather in the backward
RESHARD_FREE = "fsdp_reshard_free"
RESHARD_FREE_BACKWARD = "fsdp_reshard_free_backward"
REDUCE_SCATTER = "fsdp_reduce_scatter"

GATHERS = (ALL_GATHER, ALL_GATHER_BACKWARD)
FREES = (RESHARD_FREE, RESHARD_FREE_BACKWARD)
