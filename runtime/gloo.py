"""Run a function or an fx GraphModule on N spawned local gloo ranks, or in-process on one rank.

Results come back through files (never a queue), so a rank that dies cannot hang the caller."""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import fx

__all__ = ["RankFailure", "graph_group_names", "init_gloo", "run_graph", "run_graph_single", "run_ranks"]

_COLLECTIVE_NAMESPACE = "_c10d_functional"
# Seconds allowed for spawning ranks and forming the group (importing torch on a busy
# 2-core machine takes several seconds per process).
STARTUP_TIMEOUT = 120.0


# torch 2.13's gloo backend corrupts the heap (glibc "malloc(): unaligned tcache chunk", or a
# SIGSEGV) when functional all-gathers (``_c10d_functional.all_gather_into_tensor``) run on
# its two worker threads at once: two back-to-back launches before their waits crash most
# runs of a few thousand rounds; with one worker thread, or ``dist.all_gather_into_tensor``'s
# path, none did. Scheduled graphs keep several gathers in flight, so our groups get one
# worker thread: collectives then run one at a time in issue order, which is also the
# IR's model of a group (one communication stream).
GLOO_BACKEND = "fxsched_gloo"


def _one_thread_gloo(common: Any, _options: Any) -> Any:
    options = dist.ProcessGroupGloo._Options()
    options._threads = 1
    options._timeout = common.timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    return dist.ProcessGroupGloo(common.store, common.group_rank, common.group_size, options)


def init_gloo(store: dist.Store, rank: int, world_size: int) -> None:
    """``dist.init_process_group`` on gloo with one worker thread (see ``GLOO_BACKEND``)."""
    if not hasattr(dist.Backend, GLOO_BACKEND.upper()):
        dist.Backend.register_backend(GLOO_BACKEND, _one_thread_gloo, extended_api=True, devices=["cpu"])
    dist.init_process_group(GLOO_BACKEND, store=store, rank=rank, world_size=world_size)


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; ``rank`` is the first to fail, ``details`` its traceback text."""

    def __init__(self, rank: int, details: str, *, exitcode: int | None = None):
        self.rank = rank
        self.details = details
        self.exitcode = exitcode
        super().__init__(f"rank {rank} failed (exit code {exitcode}):\n{details}")


def _use_group_name(group_name: str | None) -> None:
    """Make the default group resolvable under ``group_name`` too (the name a graph's collectives use)."""
    if group_name and dist.group.WORLD.group_name != group_name:
        torch._C._distributed_c10d._register_process_group(group_name, dist.group.WORLD)


def _worker(rank: int, world_size: int, port: int, group_name: str | None, out_dir: str) -> None:
    # a crash in native code (SIGSEGV) leaves no Python traceback: have faulthandler write
    # every thread's Python stack to a file the parent reads into its RankFailure
    fault = open(os.path.join(out_dir, f"rank{rank}.fault"), "w")
    faulthandler.enable(file=fault, all_threads=True)
    try:
        # Ranks share few cores; more intra-op threads only contend.
        torch.set_num_threads(1)
        # A graph's code may call the triton kernel wrappers, registered by this module (torch
        # imports it lazily).
        importlib.import_module("torch._higher_order_ops.triton_kernel_wrap")

        # The payload is loaded here, not by multiprocessing, so its errors are reported.
        with open(os.path.join(out_dir, "payload.pkl"), "rb") as f:
            fn, args = pickle.load(f)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=60))
        init_gloo(store, rank, world_size)
        _use_group_name(group_name)
        open(os.path.join(out_dir, f"rank{rank}.ready"), "w").close()
        result = fn(rank, world_size, *args)
        dist.destroy_process_group()
        tmp = os.path.join(out_dir, f"rank{rank}.pt.tmp")
        torch.save(result, tmp)
        # Rename last, so a present result file is always complete.
        os.replace(tmp, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException as exc:
        # Record before any teardown: closing our connections makes the peers fail too.
        record = {"time": time.time(), "traceback": traceback.format_exc(), "peer": _is_peer_failure(exc)}
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            json.dump(record, f)
        os._exit(1)
    # The result is on disk: leave without interpreter teardown (torch's and gloo's exit
    # handlers cannot spoil a finished rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Messages of collectives that failed because a peer went away (gloo raises plain RuntimeErrors).
_PEER_FAILURE_MARKERS = ("Connection reset by peer", "Connection closed by peer", "gloo/transport/")


def _is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like the consequence of another rank failing."""
    text = str(exc)
    return isinstance(exc, dist.DistNetworkError) or any(m in text for m in _PEER_FAILURE_MARKERS)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


@contextlib.contextmanager
def _quiet_numpy_warning():
    """Spawned ranks inherit the environment: keep torch's import-time "Failed to initialize
    NumPy" warning (numpy is not a dependency) out of every rank's stderr."""
    old = os.environ.get("PYTHONWARNINGS")
    quiet = "ignore:Failed to initialize NumPy"
    os.environ["PYTHONWARNINGS"] = f"{old},{quiet}" if old else quiet
    try:
        yield
    finally:
        if old is None:
            del os.environ["PYTHONWARNINGS"]
        else:
            os.environ["PYTHONWARNINGS"] = old


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    *,
    group_name: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks; results in rank order.

    ``fn`` and ``args`` must pickle (``fn`` a module-level function); results travel by
    ``torch.save``. The default gloo group is initialised before ``fn`` runs, resolvable
    also as ``group_name`` when given. ``timeout`` counts from when every rank has joined
    the group (start-up, slow on a loaded machine, gets ``max(timeout, STARTUP_TIMEOUT)``).
    If a rank raises, dies or times out, the other ranks are killed and ``RankFailure``
    names the first rank to fail.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    ctx = multiprocessing.get_context("spawn")
    # The parent hosts the store on a port the OS picks, so ranks never race for a port.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    out_dir = tempfile.mkdtemp(prefix="fxsched-ranks-")
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, group_name, out_dir),
            name=f"fxsched-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        with open(os.path.join(out_dir, "payload.pkl"), "wb") as f:
            _Payload(f).dump((fn, tuple(args)))
        with _quiet_numpy_warning():
            for p in procs:
                p.start()
        startup_deadline = time.monotonic() + max(timeout, STARTUP_TIMEOUT)
        deadline = None  # set once every rank is in the group
        running = set(range(world_size))
        while running:
            now = time.monotonic()
            if deadline is None and all(
                r not in running or os.path.exists(os.path.join(out_dir, f"rank{r}.ready"))
                for r in range(world_size)
            ):
                deadline = now + timeout
            if now >= (deadline or startup_deadline):
                if deadline is None:
                    ready = os.path.join(out_dir, "rank{}.ready")
                    waiting = [r for r in sorted(running) if not os.path.exists(ready.format(r))]
                    raise RankFailure(waiting[0], f"did not join the process group; ranks not ready: {waiting}")
                raise RankFailure(
                    min(running), f"timed out after {timeout:g} s; ranks still running: {sorted(running)}"
                )
            # Until all ranks are ready, poll for their ready files.
            left = (deadline or startup_deadline) - now
            multiprocessing.connection.wait(
                [procs[r].sentinel for r in running], timeout=left if deadline else min(left, 0.05)
            )
            for r in sorted(running):
                if procs[r].exitcode is not None:
                    running.discard(r)
                    if procs[r].exitcode != 0:
                        # Give the peers a moment to finish failing, so the cause can be told
                        # from its consequences.
                        _settle(procs, 2.0)
                        raise _first_failure(out_dir, procs)
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RankFailure(rank, "exited without writing a result", exitcode=procs[rank].exitcode)
            results.append(torch.load(path, weights_only=False))
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=10)
        shutil.rmtree(out_dir, ignore_errors=True)
        del store


def _settle(procs, seconds: float) -> None:
    """Wait up to ``seconds`` for the running processes to exit on their own."""
    alive = [p.sentinel for p in procs if p.exitcode is None]
    deadline = time.monotonic() + seconds
    while alive and time.monotonic() < deadline:
        multiprocessing.connection.wait(alive, timeout=deadline - time.monotonic())
        alive = [p.sentinel for p in procs if p.exitcode is None]


def _first_failure(out_dir: str, procs) -> RankFailure:
    """The failure most likely to be the cause; the others usually fail in its wake.

    In order: the earliest rank whose own code raised, then a rank that died without a
    Python traceback (signal, os._exit), then the earliest rank that lost a peer.
    """
    records = {}
    for rank in range(len(procs)):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                records[rank] = json.load(f)
    own = sorted((r["time"], rank) for rank, r in records.items() if not r["peer"])
    if own:
        rank = own[0][1]
        return RankFailure(rank, records[rank]["traceback"], exitcode=procs[rank].exitcode)
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0) and rank not in records:
            stack = _read(os.path.join(out_dir, f"rank{rank}.fault")).strip()
            detail = f"process died; faulthandler:\n{stack}" if stack else "process died without a Python traceback"
            return RankFailure(rank, detail, exitcode=p.exitcode)
    rank = min((r["time"], rank) for rank, r in records.items())[1]
    return RankFailure(rank, records[rank]["traceback"], exitcode=procs[rank].exitcode)


# --------------------------------------------------------------------------- graphs


def graph_group_names(gm: fx.GraphModule) -> dict[str, int]:
    """``{group name: group size}`` over the functional collectives in ``gm``."""
    groups: dict[str, int] = {}
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverloadPacket) and target.overloads() == ["default"]:
            target = target.default  # dynamo calls a functional collective by its packet
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != _COLLECTIVE_NAMESPACE or "wait" in target.__name__:
            continue
        schema = target._schema
        values = {a.name: (node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
                  for i, a in enumerate(schema.arguments)}
        name, size = values.get("group_name"), values.get("group_size")
        if isinstance(name, str):
            known = groups.get(name, -1)  # -1: no collective of it has said its size yet (all_reduce does not)
            if isinstance(size, int) and known not in (-1, size):
                raise ValueError(f"group {name!r} used with sizes {known} and {size}")
            groups[name] = size if isinstance(size, int) else known
    return groups


def _single_group(gm: fx.GraphModule, world_size: int) -> str | None:
    groups = graph_group_names(gm)
    if len(groups) > 1:
        raise ValueError(f"graph uses several process groups {sorted(groups)}; only one is supported")
    for name, size in groups.items():
        if size not in (-1, world_size):
            raise ValueError(f"graph was traced for group {name!r} of size {size}, run on {world_size} ranks")
        return name
    return None


class _Payload(pickle.Pickler):
    """Pickles a GraphModule as the code it runs, loaded as a module that runs that code.

    torch pickles a GraphModule as its code and, loading it, traces the code again to rebuild the
    graph; a call on no traced value then runs once, at load, and becomes a constant:
    `aten.rand([n])` would draw at load (each module its own numbers, not per call), an
    `aten.empty` buffer would be one tensor shared by every call. A rank runs the code as the
    caller's module does; it needs no graph."""

    def reducer_override(self, obj):
        if isinstance(obj, fx.GraphModule):
            _, (body, import_block) = obj.__reduce__()  # its __dict__ less the graph, and its imports
            return _code_module, (body, import_block)
        return NotImplemented


def _code_module(body: dict, import_block: str) -> torch.nn.Module:
    """A module with a pickled GraphModule's attributes whose forward is its code (`_Payload`)."""
    from torch.fx.graph_module import _CodeOnlyModule, _forward_from_src

    forward = _forward_from_src(import_block + (body.get("_code") or body["code"]), {})
    return type(body.get("_graphmodule_cls_name", "GraphModule"), (_CodeOnlyModule,), {"forward": forward})(body)


def _call_graph(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = gm(*inputs)
    if isinstance(out, torch.Tensor):
        out = [out]
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in out]


def _graph_worker(rank: int, world_size: int, gm: fx.GraphModule, inputs_per_rank) -> list[torch.Tensor]:
    return _call_graph(gm, inputs_per_rank[rank])


def run_graph(
    gm: fx.GraphModule, inputs_per_rank: Sequence[Sequence[torch.Tensor]], timeout: float = 120.0
) -> list[list[torch.Tensor]]:
    """Execute ``gm`` on ``len(inputs_per_rank)`` gloo ranks; each rank's outputs, in rank order.

    The graph's (single) collective group name resolves to the default group.
    ``gm`` travels as the code it runs (`_Payload`): the ranks run exactly that code.
    """
    world_size = len(inputs_per_rank)
    group = _single_group(gm, world_size)
    return run_ranks(
        _graph_worker, world_size, args=(gm, [list(x) for x in inputs_per_rank]), timeout=timeout, group_name=group
    )


def run_graph_single(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Execute a world-size-1 ``gm`` in this process.

    Initialises a 1-rank gloo default group if none exists (destroyed afterwards, so other
    code may init its own); an existing default group must have size 1. The graph's
    collective group name is made to resolve to the default group.
    """
    group = _single_group(gm, 1)
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"a process group of size {dist.get_world_size()} is already initialised")
        _use_group_name(group)
        return _call_graph(gm, inputs)
    init_gloo(dist.HashStore(), 0, 1)
    try:
        _use_group_name(group)
        return _call_graph(gm, inputs)
    finally:
        dist.destroy_process_group()
