"""Runners that execute fxsched graphs on local gloo process groups."""

from .gloo import RankFailure, graph_group_names, init_gloo, run_graph, run_graph_single, run_ranks

__all__ = ["RankFailure", "graph_group_names", "init_gloo", "run_graph", "run_graph_single", "run_ranks"]
