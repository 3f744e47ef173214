"""Built-in models: build, run forward/backward eagerly, and trace to one joint graph."""

from __future__ import annotations

import pytest
import torch
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch.func import functional_call

from fxsched.models import MODELS, build_model

NAMES = sorted(MODELS)
ATTENTION_MARKERS = ("scaled_dot_product", "flash_attention")


def test_registry_names():
    assert set(MODELS) == {"gpt", "llama", "encoder"}


@pytest.mark.parametrize("name", NAMES)
def test_eager_forward_backward(name):
    module, inputs, loss_fn = build_model(name, layers=2, width=32, seed=0)
    assert module.training
    loss = loss_fn(module(*inputs), *inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, param in module.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), pname


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_given_seed(name):
    def state(seed):
        module, inputs, _ = build_model(name, layers=1, width=16, seed=seed)
        return [p.detach().clone() for p in module.parameters()], inputs

    (a, ia), (b, ib), (c, _) = state(3), state(3), state(4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(ia, ib))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_seeding_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("gpt", layers=1, width=16, seed=7)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", NAMES)
def test_sizes_follow_arguments(name):
    small, _, _ = build_model(name, layers=1, width=16)
    large, _, _ = build_model(name, layers=3, width=16)
    wide, _, _ = build_model(name, layers=1, width=32)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(small) < count(large) and count(small) < count(wide)


@pytest.mark.parametrize("name", NAMES)
def test_traces_to_joint_graph(name):
    module, inputs, loss_fn = build_model(name, layers=2, width=32, seed=0)
    names = [n for n, _ in module.named_parameters()]
    params = [p.detach().requires_grad_(True) for p in module.parameters()]

    def joint(*args):
        values = dict(zip(names, args[: len(names)]))
        rest = args[len(names):]
        return (loss_fn(functional_call(module, values, rest), *rest),)

    gm = aot_export_joint_simple(joint, (*params, *inputs), trace_joint=True)
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function"]
    backward = [bool(n.meta.get("autograd_backward")) for n in calls]
    assert any(backward) and not all(backward)
    assert backward == sorted(backward), "every forward node precedes every backward node"
    attention = [n for n in calls if any(m in str(n.target) for m in ATTENTION_MARKERS)]
    assert {bool(n.meta.get("autograd_backward")) for n in attention} == {False, True}
    outputs = nodes[-1].args[0]
    # loss, then one gradient per parameter (then None for each non-differentiable input)
    assert len(outputs) == 1 + len(params) + len(inputs)
    assert all(o is not None for o in outputs[: 1 + len(params)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown model"):
        build_model("bert")
    with pytest.raises(ValueError, match="layers"):
        build_model("gpt", layers=0)
    with pytest.raises(ValueError, match="layers"):
        build_model("gpt", layers=True)
    with pytest.raises(ValueError, match="divisible"):
        build_model("encoder", width=30, heads=4)
    with pytest.raises(ValueError, match="even head dim"):
        build_model("llama", width=24, heads=8)
    with pytest.raises(ValueError, match="seed"):
        build_model("gpt", seed=1.5)


def test_model_kwargs_pass_through():
    module, (tokens,), loss_fn = build_model("gpt", layers=1, width=16, vocab=50, seq=8, batch=3, heads=2)
    assert tokens.shape == (3, 8) and int(tokens.max()) < 50
    assert module(tokens).shape == (3, 8, 50)
    module, (x,), _ = build_model("encoder", layers=1, width=16, seq=5, batch=4)
    assert x.shape == (4, 5, 16) and module(x).shape == (4, 5, 16)
