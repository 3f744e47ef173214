"""In-place writes end to end (issue 12): graphs built as users build them, scheduled by the
reference and default pipelines, run on 2 gloo ranks, bitwise equal to the unscheduled graph.

Each graph is one the old effect model scheduled wrongly or over-cautiously: a shard written by
an in-place all-reduce, `torch.relu_`, `F.relu(inplace=True)` or `nn.ReLU(inplace=True)` before
its gather; a `to.dtype` (may alias) of a gathered buffer before an in-place write of it; a Llama
whose RMSNorm adds eps in place. Every rank holds different data, so a gather launched before
the write of its shard gathers other numbers, and the comparison fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import fxsched
from fxsched.front import fsdp_joint_graph
from fxsched.front.fsdp import fsdp_free_storage
from fxsched.ir import Barrier, verify
from fxsched.models import build_model
from fxsched.models import llama as llama_module
from fxsched.passes import DEFAULT_PIPELINE, REFERENCE_PIPELINE
from fxsched.runtime import run_ranks

from ranks import WORLD, run_all

pytestmark = pytest.mark.multirank
PIPELINES = {"reference": REFERENCE_PIPELINE, "default": DEFAULT_PIPELINE}
aten = torch.ops.aten
c10d = torch.ops._c10d_functional
AG = c10d.all_gather_into_tensor.default
WAIT = c10d.wait_tensor.default


def _tag(ag, param, nbytes=64):
    ag.meta.update(comm_type="fsdp_all_gather", param_name=param, fsdp_unsharded_nbytes=nbytes)


class _Writes(nn.Module):
    """Holds an nn.ReLU(inplace=True) for call_module graphs."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)


def shard_written_then_gathered(write: str) -> fx.GraphModule:
    """Layer 0 gathers s0 and computes; then s1 is written in place (`write`); then layer 1
    gathers s1. A prefetch of the second gather above the write gathers the old shard."""
    root = _Writes()
    g = fx.Graph()
    x, s0, s1 = g.placeholder("x"), g.placeholder("s0"), g.placeholder("s1")
    ag0 = g.call_function(AG, (s0, WORLD, "0"))
    _tag(ag0, "p0")
    h = g.call_function(aten.mm.default, (x, g.call_function(aten.view.default, (g.call_function(WAIT, (ag0,)), [4, 4]))))
    h = g.call_function(aten.mm.default, (h, h))
    if write == "all_reduce_":
        g.call_function(WAIT, (g.call_function(c10d.all_reduce_.default, (s1, "sum", "0")),))
    elif write == "torch.relu_":
        g.call_function(torch.relu_, (s1,))
    elif write == "F.relu(inplace=True)":
        g.call_function(F.relu, (s1,), {"inplace": True})
    elif write == "nn.ReLU(inplace=True)":
        g.call_module("act", (s1,))
    elif write == "x.add_":
        g.call_method("add_", (s1, s0))
    h = g.call_function(aten.mm.default, (h, h))
    ag1 = g.call_function(AG, (s1, WORLD, "0"))
    _tag(ag1, "p1")
    w1 = g.call_function(aten.view.default, (g.call_function(WAIT, (ag1,)), [4, 4]))
    g.output((g.call_function(aten.mm.default, (h, w1)),))
    return fx.GraphModule(root, g)


def maybe_view_then_write() -> fx.GraphModule:
    """`to.dtype` of a gathered buffer (no meta val: may alias), then an in-place write of the
    buffer, then a use of the `to` result: sinking the `to` below the write reads the written data."""
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    ag = g.call_function(AG, (s, WORLD, "0"))
    _tag(ag, "p")
    wt = g.call_function(WAIT, (ag,))
    cast = g.call_function(aten.to.dtype, (wt, torch.float32))
    h = g.call_function(aten.mm.default, (x, x))
    g.call_function(aten.mul_.Tensor, (wt, 3.0))
    h = g.call_function(aten.mm.default, (h, g.call_function(aten.view.default, (cast, [4, 4]))))
    g.output((h, wt))
    return fx.GraphModule(nn.Module(), g)


def _graph_feeds(rank):
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 4, generator=gen), torch.randn(8, generator=gen), torch.randn(8, generator=gen)]


class _InplaceRMSNorm(llama_module.RMSNorm):
    def forward(self, x):
        x32 = x.float()
        var = x32.pow(2).mean(-1, keepdim=True)
        var.add_(self.eps)  # in place, on a temporary
        return (x32 * torch.rsqrt(var)).type_as(x) * self.weight


def _llama(inplace: bool):
    module, inputs, model_loss = build_model("llama", layers=2, width=32, seed=5)
    if inplace:
        for name, child in list(module.named_modules()):
            for attr, sub in list(child.named_children()):
                if type(sub) is llama_module.RMSNorm:
                    new = _InplaceRMSNorm(sub.weight.numel(), sub.eps)
                    new.load_state_dict(sub.state_dict())
                    setattr(child, attr, new)
    front = fsdp_joint_graph(module, inputs, lambda m, *xs: model_loss(m(*xs), *xs), WORLD)
    data = [tuple((x + r) % 97 if not x.is_floating_point() else x + r for x in inputs) for r in range(WORLD)]
    feeds = [front.shard_inputs(module, r, data[r]) for r in range(WORLD)]
    return front, feeds


WRITES = ["all_reduce_", "torch.relu_", "F.relu(inplace=True)", "nn.ReLU(inplace=True)", "x.add_"]


@pytest.fixture(scope="module")
def cases():
    cases = {}
    feeds = [_graph_feeds(r) for r in range(WORLD)]
    for write in WRITES:
        cases[write] = (shard_written_then_gathered(write), feeds)
    cases["to.dtype then mul_"] = (maybe_view_then_write(), [f[:2] for f in feeds])
    front, llama_feeds = _llama(inplace=True)
    cases["llama, RMSNorm add_"] = (front.gm, llama_feeds)
    return cases


def test_llama_with_an_inplace_rmsnorm_gets_no_barrier_and_moves_as_out_of_place():
    inplace, _ = _llama(inplace=True)
    plain, _ = _llama(inplace=False)
    assert any(n.target is aten.add_.Tensor for n in inplace.gm.graph.nodes)
    for label, pipeline in PIPELINES.items():
        done = {k: fxsched.schedule(f.gm, pipeline) for k, f in (("inplace", inplace), ("plain", plain))}
        assert not any(isinstance(op, Barrier) for op in done["inplace"].program.ops())
        # nodes named by their place in the traced graph (`add_` there is `add` here)
        at = {k: {n.name: i for i, n in enumerate(f.gm.graph.nodes)} for k, f in (("inplace", inplace), ("plain", plain))}
        rows = {k: [(at[k][g["launch"]], g["moved"], at[k].get(g["anchor"], g["anchor"]), g["reason"])
                    for g in d.report["gathers"]] for k, d in done.items()}
        assert rows["inplace"] == rows["plain"], label  # the same gathers move, to the same anchors
        stats = {k: d.result.stats().get("overlap-reduce-scatter") for k, d in done.items()}
        assert stats["inplace"] == stats["plain"], label  # and the reduce-scatters likewise


def test_scheduled_inplace_graphs_are_bitwise_equal_on_two_ranks(cases):
    jobs, labels = [], []
    for name, (gm, feeds) in cases.items():
        jobs.append((gm, feeds))
        labels.append((name, "unscheduled"))
        for label, pipeline in PIPELINES.items():
            done = fxsched.schedule(gm, pipeline)
            verify(done.program)
            jobs.append((done.graph_module, feeds))
            labels.append((name, label))
    # the comparison can fail: the relu_ graph with its second gather above the write (what the
    # old effect model's prefetch did) gathers the unwritten shards. (Its wait goes up too: gloo
    # reads the shard when its thread runs the gather, which with the wait after the write may
    # still be after it; what the old model allowed the sink pass would not force.)
    wrong, feeds = shard_written_then_gathered("torch.relu_"), cases["torch.relu_"][1]
    write = next(n for n in wrong.graph.nodes if n.target is torch.relu_)
    gather = [n for n in wrong.graph.nodes if n.target is AG][1]
    write.prepend(gather)
    write.prepend(next(iter(gather.users)))
    wrong.recompile()
    jobs.append((wrong, feeds))
    labels.append(("torch.relu_", "gather above the write"))
    results = run_ranks(run_all, WORLD, args=(jobs,), timeout=600)
    for rank in range(WORLD):
        expected = {}
        for (name, label), out in zip(labels, results[rank]):
            if label == "unscheduled":
                expected[name] = out
                continue
            if label == "gather above the write":
                assert not torch.equal(out[0], expected[name][0])
                continue
            assert len(out) == len(expected[name])
            for a, b in zip(out, expected[name]):
                assert torch.equal(a, b), f"{name}, {label}, rank {rank}: differs from the unscheduled graph"




# --------------------------------------------------------------------------- the front: a parameter written in the forward


class _WritesItsWeight(nn.Module):
    """Three layers; the forward writes l2's weight in place (`write`) between l1 and l2, so the
    backward (l1's gradients) reads the written l2 weight."""

    def __init__(self, write: str):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.write = write

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.write == "mul_ (grad mode)":  # eager refuses it on a leaf; the front's gathered copy is not one
            self.l2.weight.mul_(0.5)
        else:
            with torch.no_grad():
                if self.write == "clamp_":
                    self.l2.weight.clamp_(-0.2, 0.2)
                elif self.write == "mul_":
                    self.l2.weight.mul_(0.5)
                elif self.write == "row zero_":  # through a view: later uses read the weight itself
                    self.l2.weight[0].zero_()
        return self.l3(torch.tanh(self.l2(h)))


_PARAM_WRITES = ["clamp_", "mul_", "row zero_", "mul_ (grad mode)"]
_FRONT_PIPELINES = {"reference": REFERENCE_PIPELINE, "default": DEFAULT_PIPELINE, "rewrite": "default,unshard,bucket",
                    "default,unshard": "default,unshard", "default,bucket": "default,bucket"}


def _param_write_case(write: str, **options):
    torch.manual_seed(7)
    module = _WritesItsWeight(write)
    inputs = (torch.randn(5, 4),)
    front = fsdp_joint_graph(module, inputs, lambda m, x: m(x).square().sum(), WORLD, **options)
    return module, inputs, front


def _eager(module, data):
    """Eager torch on one process, each rank's data on its own copy of the module (the write
    changes the parameter): each rank's loss, and the gradients summed over ranks."""
    import copy

    losses, grads = [], {}
    for rank_inputs in data:
        m = copy.deepcopy(module)
        loss = m(*rank_inputs).square().sum()
        loss.backward()
        losses.append(loss.detach())
        for name, p in m.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad.clone()
    return losses, grads


def test_a_parameter_written_in_place_in_the_forward_traces_schedules_and_matches_eager_on_two_ranks():
    """fsdp_joint_graph of a model that writes a parameter in place in its forward (`clamp_` or
    `mul_` under no_grad, a write through a view of it, `mul_` in grad mode): the free of the
    gathered buffer follows every use through the in-place results (it preceded the use of
    `clamp_`'s result: lowering refused the graph, use after free), and the backward re-gather
    replays the forward's writes, so the resharded graph computes what the unresharded one does
    (without the replay of `row zero_`, which no later use reads through, l1's gradients differ).
    Every pipeline, with and without per-module buckets, is bitwise the unscheduled graph on 2
    gloo ranks; the loss and gradients are eager torch's, bitwise (the gradient of a parameter
    written under no_grad is the gradient at the written value, as eager's; without the front's
    gather under enable_grad, a parameter first read under no_grad got a zero gradient)."""
    from ranks import rank_data, rank_feeds

    jobs, labels, eager = [], [], {}
    for write in _PARAM_WRITES:
        for options in ({}, {"buckets": "per-module"}, {"reshard_after_forward": False}):
            module, inputs, front = _param_write_case(write, **options)
            key = (write, tuple(options.items()))
            feeds = rank_feeds(front, module, inputs)
            jobs.append((front.gm, feeds))
            labels.append((key, "unscheduled"))
            if "reshard_after_forward" in options:
                continue
            assert any(n.target is fsdp_free_storage for n in front.gm.graph.nodes)
            for label, pipeline in _FRONT_PIPELINES.items():
                done = fxsched.schedule(front.gm, pipeline)
                verify(done.program)
                jobs.append((done.graph_module, feeds))
                labels.append((key, label))
        if write != "mul_ (grad mode)":
            eager[write] = (front, _eager(module, rank_data(inputs, WORLD)))
    results = run_ranks(run_all, WORLD, args=(jobs,), timeout=600)
    for rank in range(WORLD):
        unscheduled = {}
        for (key, label), out in zip(labels, results[rank]):
            if label == "unscheduled":
                unscheduled[key] = out
                continue
            for i, (a, b) in enumerate(zip(out, unscheduled[key], strict=True)):
                assert torch.equal(a, b), f"{key}, {label}, rank {rank}: output {i} differs from the unscheduled graph"
        for write in _PARAM_WRITES:
            # resharding (re-gather, replayed writes) and buckets compute what keeping the buffer does
            kept = unscheduled[(write, (("reshard_after_forward", False),))]
            for options in ((), (("buckets", "per-module"),)):
                for i, (a, b) in enumerate(zip(unscheduled[(write, options)], kept, strict=True)):
                    assert torch.equal(a, b), f"{write} {options}, rank {rank}: output {i} differs without the reshard"
    for write, (front, (losses, grads)) in eager.items():
        at = labels.index(((write, ()), "unscheduled"))
        outs = [results[r][at] for r in range(WORLD)]
        for rank in range(WORLD):
            assert torch.equal(outs[rank][0], losses[rank]), f"{write}, rank {rank}: the loss is not eager's"
        for name, grad in front.unshard_grads(outs).items():
            assert grad.abs().sum() > 0, f"{write}: {name} gets no gradient"
            assert torch.equal(grad, grads[name]), f"{write}: {name}'s gradient is not eager's"
    assert not torch.equal(results[0][0][0], results[1][0][0])  # the ranks saw different data


def test_a_forward_write_of_a_parameter_that_cannot_be_replayed_is_refused_by_the_front():
    """A random in-place write of a parameter in the forward (`uniform_`), or one reading another
    parameter's gathered buffer (`l2.weight[:3].add_(l3.weight)`), read by the backward: a replay
    after the re-gather would draw other numbers, or read a freed buffer, so the front names the
    op and the way out (reshard_after_forward=False, which traces)."""
    class Redraws(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(self.l1(x))
            with torch.no_grad():
                self.l2.weight.uniform_(-0.1, 0.1)
            return self.l2(h)

    loss = lambda m, x: m(x).square().sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"%uniform_ \(aten.uniform_.default\) writes the gathered storage of "
                                         r"parameter 'l2.weight' .* it is random .*reshard_after_forward=False"):
        fsdp_joint_graph(Redraws(), (torch.randn(5, 4),), loss, WORLD)
    fsdp_joint_graph(Redraws(), (torch.randn(5, 4),), loss, WORLD, reshard_after_forward=False)

    class AddsAnother(Redraws):  # l2's weight += l3's: l3's gathered buffer is freed when l2's write is replayed
        def __init__(self):
            super().__init__()
            self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            h = torch.tanh(self.l1(x))
            with torch.no_grad():
                self.l2.weight[:3].add_(self.l3.weight)
            return self.l3(torch.tanh(self.l2(h)))

    with pytest.raises(ValueError, match=r"%add_ \(aten.add_.Tensor\) writes the gathered storage of parameter "
                                         r"'l2.weight' .* it reads \['%?view_\d+'\], another parameter's gathered"):
        fsdp_joint_graph(AddsAnother(), (torch.randn(5, 4),), loss, WORLD)
