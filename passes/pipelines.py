"""Named pipelines: `reference` keeps HyperParallel's behaviour exactly; `default` is the one
the schedule benchmark (bench/bench_schedules.py) found best."""

REFERENCE_PIPELINE = "anchor,budget,prefetch,sink"
DEFAULT_PIPELINE = "hide,budget,prefetch,sink,overlap-reduce-scatter,order-gathers"

PIPELINES = {"reference": REFERENCE_PIPELINE, "default": DEFAULT_PIPELINE}
