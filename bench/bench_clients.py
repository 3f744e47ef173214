"""Benchmark: schedules of real clients' graphs, scored by fxsched's simulator with the same costs.

    .venv/bin/python bench/bench_clients.py                      # everything below (~15 min on 2 CPUs)
    .venv/bin/python bench/bench_clients.py --no-compile --titan-layers 2
    .venv/bin/python bench/bench_clients.py --no-compile --llama3-8b      # + Llama-3-8B shapes

Writes bench/out/clients.{md,json}. Workloads:

- **torch.compile** (`compile ...`): SimpleFSDP-style GPT and Llama (`bench/simple_fsdp.py`;
  width 1024, seq 256, batch 2, world size 2; fp32, and bf16 parameters with fp32 gradients),
  compiled by Inductor; the forward and the backward graph exactly as its post-grad custom pass
  (fxsched's hook) sees them. Each graph is scheduled on its own and the step is the sum of the two.
- **torchtitan** (`titan ...`): graph_trainer's joint graph of llama3's debug model (2 and 4
  layers) and of its 1B shape cut to 2 layers, under
  SimpleFSDP (bf16 parameters, fp32 reduction, world size 2, batch 2, seq 2048), traced by its
  make_fx tracer on a fake process group and rematerialised by its default passes (`bench/titan.py`).
- **torchtitan under torch.compile** (`titan-compile ...`): the same llama3 (debug model, 2 and 4
  layers) compiled by torch.compile: the forward and backward graphs AOTAutograd's partitioner gives
  Inductor's post-grad pass (`bench/titan.py` `compile_step`; graph_trainer's "jit" mode), each
  scheduled on its own, the step their sum; every peer, the bucketing ones included, runs on them.
- **Llama-3-8B shapes** (`llama3-8B ...`, with `--llama3-8b`): dim 4096, FFN 14336, 32 heads, 8 KV
  heads, vocab 128256, batch 1, world size 8 (`bench/llama3_8b.py`), traced with fake tensors
  through fxsched's front (a meta-device module: no parameter or activation memory): 4 and 32
  layers, bf16 and fp32 parameters at sequence 8192, and bf16 at sequence 512 (communication-bound).

Schedules: `emitted` (as traced); `fxsched-gathers` (the default pipeline with only the gathers
recognised: what fxsched did before it recognised gradient reductions); `fxsched` (the default
pipeline, gathers and gradient reductions recognised); `inductor` (Inductor's
`schedule_overlap_bucketing`, reorder only, on the same graph with our per-node costs, as in
bench_schedules.py); on the torchtitan graphs `torchtitan` (graph_trainer's own FSDP
scheduling pass, `joint_transformer_block_bucketing_reordering_pass`, which buckets: its graph is
lowered and scored on its own, the node set changed), `torchtitan+fxsched` (that pass, then
fxsched's default on its buckets) and `torchtitan-buckets+fxsched` (only its bucketing step, fxsched
orders the buckets); on joint graphs (torchtitan's, the Llama-3-8B ones) and on torchtitan's
partitioned ones (`titan-compile`) also `inductor-bucketing`
(Inductor's scheduler with its FSDP pre-bucketing, its default) and `torchtitan-autobucketing`
(torchtitan's `autobucketing_reordering_pass`: `schedule_overlap_bucketing(gm, collective_bucketing=True)`),
both with our costs. Every order is checked against the
original program's rules (ILLEGAL with the broken rules counted, as in bench_schedules.py).
Costs: H100 roofline. Columns: step, exposed communication, step / lower bound, peak memory.

Then the peer-cap table (`cap_table`, bench/peer_cap.py): fxsched under a hard cap at each peer's
simulated peak, the pipelines of `peer_cap.CAP_PIPELINES`, the best within it; bench/out/clients_cap.{md,json}.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxsched  # noqa: E402
from fxsched.cost import Roofline, collective_kind, format_bytes, hardware, op_costs, simulate  # noqa: E402
from fxsched.ir import Launch, Role, VerifyError, verify  # noqa: E402
from fxsched.lowering import lower  # noqa: E402
from fxsched.lowering.structural import tag_fsdp_collectives, untag_fsdp_gathers  # noqa: E402

from bench_schedules import broken_rules, check_order, rules, run_peer_forked  # noqa: E402
from peers import copy_module, setup_inductor  # noqa: E402
import peer_cap  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
WORLD = 2
LLAMA3_WORLD = 8


@contextmanager
def uniform_phase(gm: fx.GraphModule, phase: str | None):
    """Every call of `gm` reads as `phase` (Inductor's forward and backward graphs come apart)."""
    from fxsched.integrations.inductor import _uniform_phase

    with _uniform_phase(gm.graph, phase):
        yield


def _fake_group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)


def _counts(gm: fx.GraphModule) -> dict[str, int]:
    return dict(collections.Counter(collective_kind(str(n.target)) for n in gm.graph.nodes
                                    if n.op == "call_function" and "_c10d_functional" in str(n.target)
                                    and "wait_tensor" not in str(n.target)))


def _score(program, costs) -> dict[str, Any]:
    sim = simulate(program, costs=costs)
    return {"step_ms": sim.step_ms, "exposed_ms": sim.exposed_ms, "bound_ms": sim.lower_bound_ms,
            "peak_bytes": sim.peak_bytes}


def schedule_graph(gm: fx.GraphModule, phase: str | None, model, args, *, joint: bool = False,
                   variants=(("fxsched-gathers", False), ("fxsched", True))) -> dict[str, dict[str, Any]]:
    """Every schedule of one graph: {name: score + legality}. `joint`: a joint forward+backward
    graph (the joint-graph peers run on it too)."""
    out: dict[str, dict[str, Any]] = {}
    with uniform_phase(gm, phase):
        untag_fsdp_gathers(gm)
        found = tag_fsdp_collectives(gm, phase=phase)
        program = lower(gm)
        verify(program)
        costs = op_costs(program, model)
        # what lowering takes for FSDP collectives (structurally recognised, or tagged by the front)
        roles = collections.Counter(op.role for op in program.ops() if isinstance(op, Launch) and op.role is not None)
        info = {"nodes": len(gm.graph.nodes), "collectives": _counts(gm),
                "gathers_recognised": roles[Role.GATHER] + roles[Role.REGATHER],
                "reductions_recognised": roles[Role.REDUCE_SCATTER], "structural": len(found.tagged) + len(found.reductions)}
        out["emitted"] = {**_score(program, costs), "legal": True}
        for name, reductions in variants:
            untag_fsdp_gathers(gm)
            tag_fsdp_collectives(gm, phase=phase, reductions=reductions)
            t = time.perf_counter()
            done = fxsched.schedule(gm, fxsched.DEFAULT_PIPELINE, cost_model=model)
            seconds = time.perf_counter() - t
            order = done.program.schedule.names()
            scheduled, problems = check_order(program, order)
            out[name] = {**_score(scheduled, costs), "legal": not problems,
                         "problems": rules(program, order, problems), "compile_s": seconds}
        untag_fsdp_gathers(gm)
        tag_fsdp_collectives(gm, phase=phase)
        for peer in args.peers:
            if peer in JOINT_PEERS and not joint:
                continue  # a joint-graph peer: not run on Inductor's partitioned graphs
            out[peer] = _run_peer(gm, program, costs, model, PEER_OPTIONS[peer], args.peer_timeout)
    out["_info"] = info
    return out


#: the peers, with the options each runs with (anything not listed is Inductor's default); our
#: costs are their `custom_runtime_estimation`, `compute_estimator="analytical"` (bench/peers.py)
PEER_OPTIONS = {
    # Inductor's overlap scheduler, reorder only, our in-flight budget
    "inductor": {"max_in_flight_gb": 1.0, "pre_bucketing_fsdp_collectives": False},
    # the same with its FSDP pre-bucketing (its default)
    "inductor-bucketing": {"max_in_flight_gb": 1.0},
    # torchtitan's `autobucketing_reordering_pass`: `schedule_overlap_bucketing(gm, collective_bucketing=True)`
    "torchtitan-autobucketing": {"collective_bucketing": True},
}
#: peers that are meant for a joint forward+backward graph (torchtitan's, or Inductor's scheduler on it)
JOINT_PEERS = ("inductor-bucketing", "torchtitan-autobucketing")


def _run_peer(gm, program, costs, model, options, timeout) -> dict[str, Any]:
    """One Inductor-based peer on a copy of `gm`, scored like ours; a peer that changed the node set
    (bucketing) is scored on its own lowering and checked on the nodes it kept."""
    result = run_peer_forked(gm, costs, model, options, timeout)
    if "skipped" in result:
        return {"skipped": result["skipped"]}
    if "program" in result:
        own = result["program"]
        problems = broken_rules(program, result["names"])
        if result.get("own_problems"):
            problems["own lowering"] = len(result["own_problems"])
        return {**_score(own, op_costs(own, model)), "legal": not problems, "problems": problems,
                "compile_s": result["seconds"], "collectives": dict(result["collectives"]),
                "node_set": "changed (bucketing)"}
    scheduled, problems = check_order(program, result["names"])
    return {**_score(scheduled, costs), "legal": not problems, "problems": rules(program, result["names"], problems),
            "compile_s": result["seconds"]}


def _sum(parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """A step made of several graphs run one after the other: times add, peak is the larger."""
    names = [n for n in parts[0] if n != "_info"]
    total: dict[str, dict[str, Any]] = {}
    for name in names:
        entries = [p.get(name, {"skipped": "missing"}) for p in parts]
        skipped = [e["skipped"] for e in entries if "skipped" in e]
        if skipped:
            total[name] = {"skipped": skipped[0]}
            continue
        problems: collections.Counter = collections.Counter()
        for e in entries:
            problems.update(e.get("problems") or {})
        total[name] = {"step_ms": sum(e["step_ms"] for e in entries), "exposed_ms": sum(e["exposed_ms"] for e in entries),
                       "bound_ms": sum(e["bound_ms"] for e in entries),
                       "peak_bytes": max(e["peak_bytes"] for e in entries),
                       "legal": all(e["legal"] for e in entries), "problems": dict(problems)}
        if any(e.get("node_set") for e in entries):  # a bucketing peer changed some graph's node set
            collectives: collections.Counter = collections.Counter()
            for e in entries:
                collectives.update(e.get("collectives") or {})
            total[name].update(node_set="changed (bucketing)", collectives=dict(collectives))
    return total


# ---- workloads -------------------------------------------------------------------------------

def compile_workloads(args, model) -> list[dict[str, Any]]:
    from simple_fsdp import post_grad_graphs, simple_fsdp

    from fxsched.models import build_model

    rows = []
    for name in args.compile_models:
        for layers in args.layers:
            for dtype in args.dtypes:
                label = f"compile {name} L{layers} {dtype}"
                print(label, "...", flush=True)
                t = time.perf_counter()
                module, inputs, loss = build_model(name, layers=layers, width=args.width, seed=0, seq=args.seq,
                                                   batch=args.batch)
                simple_fsdp(module, WORLD, 0, param_dtype=torch.bfloat16 if dtype == "bf16" else None)
                graphs = post_grad_graphs(module, inputs, loss)
                build = time.perf_counter() - t
                parts = {phase: schedule_graph(gm, phase, model, args) for phase, gm in graphs.items()}
                rows.append({"workload": label, "build_s": build,
                             "graphs": {p: v.pop("_info") for p, v in parts.items()},
                             "per_graph": parts, "schedules": _sum(list(parts.values()))})
                _print(rows[-1])
                cap_table(rows[-1], [(gm, phase) for phase, gm in graphs.items()], model, args)
    return rows


def titan_workloads(args, model) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from titan import build_llama3, joint_bucketing, rematerialise, trace_step

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    rows = []
    shapes = [("debugmodel", layers) for layers in args.titan_layers] + [("1B", layers) for layers in args.titan_1b_layers]
    for flavor, layers in shapes:
        label = f"titan llama3-{'debug' if flavor == 'debugmodel' else flavor} L{layers}"
        print(label, "...", flush=True)
        t = time.perf_counter()
        module, inputs = build_llama3(mesh, flavor=flavor, layers=layers, batch=args.titan_batch, seq=args.titan_seq)
        traced = rematerialise(trace_step(module, inputs))
        build = time.perf_counter() - t
        gm = traced.gm
        copies = [copy_module(gm) for _ in range(2)]
        scheds = schedule_graph(gm, None, model, args, joint=True)
        info = scheds.pop("_info")
        setup_inductor(model.hw.hbm_gbps, model.hw.tflops("f32"))  # torchtitan's pass asks triton's GPU driver otherwise
        # torchtitan's own FSDP scheduling pass, on a copy (it buckets: a new node set, scored on its own
        # lowering); then fxsched's default on its buckets, after the whole pass and after its bucketing step alone
        for name, reorder, ours in (("torchtitan", True, False), ("torchtitan+fxsched", True, True),
                                    ("torchtitan-buckets+fxsched", False, True)):
            try:
                traced.gm = copy_module(copies[0] if reorder else copies[1])
                t = time.perf_counter()
                joint_bucketing(traced, layers, reorder=reorder)
                if ours:
                    tag_fsdp_collectives(traced.gm)
                    traced.gm = fxsched.schedule(traced.gm, fxsched.DEFAULT_PIPELINE, cost_model=model).graph_module
                scheds[name] = _own(traced.gm, model, time.perf_counter() - t)
            except Exception as exc:  # noqa: BLE001 — recorded, the rest of the row stands
                scheds[name] = {"skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        rows.append({"workload": label, "build_s": build, "graphs": {"joint": info}, "schedules": scheds})
        _print(rows[-1])
        cap_table(rows[-1], [(gm, None)], model, args)
    return rows


def titan_compile_workloads(args, model) -> list[dict[str, Any]]:
    """torchtitan's llama3 (graph_trainer's SimpleFSDP, as titan_workloads builds it) under
    torch.compile: the forward and backward graphs AOTAutograd's partitioner gives Inductor's
    post-grad pass (bench/titan.py `compile_step`), each scheduled on its own, the step their sum.
    Every peer runs on them, the bucketing ones too: graph_trainer's "jit" mode runs its
    `auto_bucketing` pass (our `torchtitan-autobucketing`) on exactly these graphs."""
    from torch.distributed.device_mesh import init_device_mesh
    from titan import build_llama3, compile_step

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    rows = []
    shapes = [("debugmodel", layers) for layers in args.titan_compile_layers]
    shapes += [("1B", layers) for layers in args.titan_compile_1b_layers]
    for flavor, layers in shapes:
        label = f"titan-compile llama3-{'debug' if flavor == 'debugmodel' else flavor} L{layers}"
        print(label, "...", flush=True)
        t = time.perf_counter()
        module, inputs = build_llama3(mesh, flavor=flavor, layers=layers, batch=args.titan_batch, seq=args.titan_seq)
        graphs = compile_step(module, inputs)
        build = time.perf_counter() - t
        # joint=True: the joint-graph peers (Inductor's pre-bucketing, torchtitan's autobucketing) run here too
        parts = {phase: schedule_graph(gm, phase, model, args, joint=True) for phase, gm in graphs.items()}
        infos = {p: v.pop("_info") for p, v in parts.items()}
        for phase, part in parts.items():  # a peer that left a graph's node set: its collectives are the graph's
            for entry in part.values():
                if "node_set" not in entry and "skipped" not in entry:
                    entry.setdefault("collectives", infos[phase]["collectives"])
        rows.append({"workload": label, "build_s": build, "graphs": infos, "per_graph": parts,
                     "schedules": _sum(list(parts.values()))})
        _print(rows[-1])
        cap_table(rows[-1], [(gm, phase) for phase, gm in graphs.items()], model, args)
    return rows


def _own(gm: fx.GraphModule, model, seconds: float) -> dict[str, Any]:
    """A schedule with its own node set (bucketing), scored on its own lowering; legal when that verifies."""
    own = lower(gm)
    try:
        verify(own)
        own_problems = []
    except VerifyError as error:
        own_problems = error.problems
    return {**_score(own, op_costs(own, model)), "legal": not own_problems,
            "problems": {"own lowering": len(own_problems)} if own_problems else {},
            "compile_s": seconds, "collectives": _counts(gm), "node_set": "changed (bucketing)"}


def llama3_8b_workloads(args, model) -> list[dict[str, Any]]:
    """Llama-3-8B's layer shapes (bench/llama3_8b.py), traced with fake tensors through fxsched's
    front for world size 8: bf16 and fp32 parameters at sequence 8192 (compute-bound), and bf16 at
    a short sequence (communication-bound). Joint graphs: the joint-graph peers run on them."""
    from llama3_8b import llama3_8b_graph

    rows = []
    shapes = [(layers, dtype, args.llama3_seq) for layers in args.llama3_layers for dtype in args.llama3_dtypes]
    shapes += [(layers, "bf16", args.llama3_comm_seq) for layers in args.llama3_comm_layers]
    for layers, dtype, seq in shapes:
        label = f"llama3-8B L{layers} {dtype} seq{seq}{' (comm-bound)' if seq == args.llama3_comm_seq else ''}"
        print(label, "...", flush=True)
        t = time.perf_counter()
        gm = llama3_8b_graph(layers, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32, seq=seq,
                             world_size=LLAMA3_WORLD)
        build = time.perf_counter() - t
        # the front tags its gathers and reduce-scatters itself: one fxsched variant
        scheds = schedule_graph(gm, None, model, args, joint=True, variants=(("fxsched", True),))
        info = scheds.pop("_info")
        rows.append({"workload": label, "build_s": build, "graphs": {"joint": info}, "schedules": scheds})
        print(f"  ({len(gm.graph.nodes)} nodes, traced in {build:.1f} s)", flush=True)
        _print(rows[-1])
        cap_table(rows[-1], [(gm, None)], model, args)
    return rows


# ---- the peer-cap table (issue 17): fxsched capped at each peer's peak (bench/peer_cap.py) ------

def cap_table(row, graphs: list[tuple[fx.GraphModule, str | None]], model, args) -> None:
    """row["capped"]: one row per peer that ran, with fxsched's best pipeline under a hard cap at
    that peer's simulated peak; every graph of the workload scheduled as `schedule_graph` does."""
    if args.no_cap_table:
        return
    caps = peer_cap.peer_caps(row["schedules"])
    if not caps:
        return

    def prepared(gm, phase):
        untag_fsdp_gathers(gm)
        tag_fsdp_collectives(gm, phase=phase)

    originals, runs = [], []
    for gm, phase in graphs:
        with uniform_phase(gm, phase):
            prepared(gm, phase)
            originals.append(lower(gm))

        def run(pipeline, gb, gm=gm, phase=phase):
            with uniform_phase(gm, phase):
                prepared(gm, phase)
                return peer_cap.timed(lambda: fxsched.schedule(gm, pipeline, cost_model=model, max_peak_gb=gb))
        runs.append(run)
    print(f"  capped at the peers' peaks ({', '.join(f'{p} {format_bytes(c)}' for p, c in caps.items())}):", flush=True)
    capped = peer_cap.capped_runs(runs, originals, caps.values(), model, broken_rules, args.cap_pipelines)
    row["capped"] = peer_cap.peer_rows(row["workload"], row["schedules"], capped, uncapped="fxsched")


# ---- report ------------------------------------------------------------------------------------

def _print(row):
    for name, s in row["schedules"].items():
        if "skipped" in s:
            print(f"  {name:16s} skipped ({s['skipped']})", flush=True)
        else:
            print(f"  {name:16s} legal={s['legal']!s:5s} step={s['step_ms']:8.3f}ms exposed={s['exposed_ms']:7.3f}ms "
                  f"ratio={s['step_ms'] / s['bound_ms']:.3f} peak={format_bytes(s['peak_bytes'])}", flush=True)


def markdown(rows) -> str:
    lines = ["| workload | collectives (recognised) | schedule | legal | step ms | exposed ms | step / bound | "
             "peak memory |", "|---|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        graphs = row["graphs"]
        counts = collections.Counter()
        for g in graphs.values():
            counts.update(g["collectives"])
        recognised = sum(g["gathers_recognised"] + g["reductions_recognised"] for g in graphs.values())
        what = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) + f" ({recognised} FSDP)"
        for name, s in row["schedules"].items():
            head = f"| {row['workload']} | {what} | {name} |"
            if "skipped" in s:
                lines.append(f"{head} skipped ({s['skipped']}) | | | | |")
                continue
            legal = "yes" if s["legal"] else "ILLEGAL: " + ", ".join(f"{k} ×{v}" for k, v in s["problems"].items())
            if s.get("node_set"):
                legal += f"; node set changed ({', '.join(f'{v} {k}' for k, v in sorted(s['collectives'].items()))})"
            lines.append(f"{head} {legal} | {s['step_ms']:.3f} | {s['exposed_ms']:.3f} | "
                         f"{s['step_ms'] / s['bound_ms']:.3f} | {format_bytes(s['peak_bytes'])} |")
    return "\n".join(lines) + "\n"


def goals(rows) -> list[str]:
    out = []
    for row in rows:
        s = row["schedules"]
        ours = s.get("fxsched")
        for peer in ("inductor", *JOINT_PEERS, "torchtitan", "torchtitan+fxsched", "torchtitan-buckets+fxsched"):
            other = s.get(peer)
            if not ours or not other or "skipped" in other:
                continue
            step = ours["step_ms"] / other["step_ms"]
            peak = ours["peak_bytes"] / other["peak_bytes"]
            out.append(f"- {row['workload']}: fxsched / {peer}: step {step:.3f}x "
                       f"({'MET' if step <= 1 + 1e-9 else 'MISSED'}), peak memory {peak:.3f}x"
                       f"{'' if other['legal'] else f' ({peer} order breaks fxsched rules)'}")
        before = s.get("fxsched-gathers")
        if ours and before:
            out.append(f"- {row['workload']}: recognising gradient reductions: step {before['step_ms']:.3f} -> "
                       f"{ours['step_ms']:.3f} ms ({ours['step_ms'] / before['step_ms']:.3f}x)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile workloads")
    parser.add_argument("--no-titan", action="store_true", help="skip the torchtitan workloads")
    parser.add_argument("--compile-models", nargs="*", default=["gpt", "llama"])
    parser.add_argument("--layers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--titan-layers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--titan-1b-layers", type=int, nargs="*", default=[2],
                        help="llama3 1B's shape (dim 2048, vocab 128256) cut to these many layers")
    parser.add_argument("--titan-seq", type=int, default=2048)
    parser.add_argument("--no-titan-compile", action="store_true",
                        help="skip torchtitan's llama3 under torch.compile (AOT-partitioned forward and backward graphs)")
    parser.add_argument("--titan-compile-layers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--titan-compile-1b-layers", type=int, nargs="*", default=[],
                        help="llama3 1B's shape under torch.compile (the step runs for real on the CPU: "
                             "memory and minutes grow with its vocabulary)")
    parser.add_argument("--titan-batch", type=int, default=2)
    parser.add_argument("--llama3-8b", action="store_true",
                        help="add Llama-3-8B layer shapes traced with fake tensors through fxsched's front (world size 8)")
    parser.add_argument("--llama3-layers", type=int, nargs="*", default=[4, 32])
    parser.add_argument("--llama3-dtypes", nargs="*", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--llama3-seq", type=int, default=8192)
    parser.add_argument("--llama3-comm-layers", type=int, nargs="*", default=[4])
    parser.add_argument("--llama3-comm-seq", type=int, default=512, help="a short sequence: communication-bound")
    parser.add_argument("--peers", nargs="*", default=list(PEER_OPTIONS), choices=list(PEER_OPTIONS),
                        help="Inductor-based peers (the joint-graph ones run on joint graphs only)")
    parser.add_argument("--peer-timeout", type=float, default=600.0)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--out", default=OUT)
    peer_cap.add_arguments(parser)
    args = parser.parse_args()

    torch.set_num_threads(1)
    _fake_group()
    model = Roofline(hardware(args.hardware))
    rows = []
    if not args.no_compile:
        rows += compile_workloads(args, model)
    if not args.no_titan:
        rows += titan_workloads(args, model)
    if not args.no_titan_compile:
        rows += titan_compile_workloads(args, model)
    if args.llama3_8b:
        rows += llama3_8b_workloads(args, model)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}, "
                         f"torch {torch.__version__}", "hardware": model.hw.name, "world_size": WORLD,
              "pipeline": fxsched.DEFAULT_PIPELINE, "args": vars(args), "rows": rows, "goals": goals(rows)}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "clients.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    table = markdown(rows)
    with open(os.path.join(args.out, "clients.md"), "w") as f:
        f.write(f"Simulated on {model.hw.name} (roofline), world size {WORLD} (Llama-3-8B rows: {LLAMA3_WORLD}); fxsched = `{fxsched.DEFAULT_PIPELINE}`; "
                f"{result['machine']}.\n\n" + table + "\n" + "\n".join(result["goals"]) + "\n")
    print(table)
    print("\n".join(result["goals"]))
    peer_cap.write(rows, args.out, "clients", result["machine"], model.hw.name)


if __name__ == "__main__":
    main()
