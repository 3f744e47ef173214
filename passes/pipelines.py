"""Named pipelines: `reference` keeps HyperParallel's behaviour exactly; `default` is the one
the schedule benchmark (bench/bench_schedules.py) found best; `rewrite` adds the rewriting
passes, best or tied on every workload of bench/bench_default.py but too slow for `default` on
large graphs (bucket is ~10x the default pipeline's CPU at 10k generated nodes, ~80x at 100k:
bench/bench_rewrite.py)."""

REFERENCE_PIPELINE = "anchor,budget,prefetch,sink"
# after hide, sink stacks realizations in hide's plan whatever its order option says (a fixed
# point: passes/sink.py); {order=wait} is kept so that the benchmarked text stays as measured
DEFAULT_PIPELINE = "hide,budget,prefetch,sink{order=wait},order-gathers,overlap-reduce-scatter"

# unshard first: the re-gathers it removes free the slots bucket then packs
REWRITE_PIPELINE = "default,unshard,bucket"

PIPELINES = {"reference": REFERENCE_PIPELINE, "default": DEFAULT_PIPELINE, "rewrite": REWRITE_PIPELINE}
