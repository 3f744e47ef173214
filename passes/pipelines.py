"""Named pipelines: `reference` keeps HyperParallel's behaviour exactly; `default` is the one
the schedule benchmark (bench/bench_schedules.py) found best."""

REFERENCE_PIPELINE = "anchor,budget,prefetch,sink"
# sink{order=wait}: order-gathers reorders launches after sink, so walking realizations in
# launch order would restack them on a second run; in wait order the output is a fixed point
DEFAULT_PIPELINE = "hide,budget,prefetch,sink{order=wait},overlap-reduce-scatter,order-gathers"

PIPELINES = {"reference": REFERENCE_PIPELINE, "default": DEFAULT_PIPELINE}
