"""`storage_candidates` over a chain of calls that may return their operand (`may_alias`): the
union over many names (`storage_candidates_of`, as `unshard` asks for every written storage) and
the rewriter's `_maybe_set` expand each storage once (`may_be`, one step each), where a query per
name walked the whole chain again: at 500 links unshard's candidate search took 0.98 s CPU and
`_maybe_set` 2.6 s, now 0.002 s and 0.004 s (report-alias.md)."""

from __future__ import annotations

from fxsched.ir import parse_program, storage_candidates
from fxsched.ir import storage as storage_module
from fxsched.ir.rewriter import Rewriter
from fxsched.ir.storage import storage_candidates_of
from fxsched.passes import unshard as unshard_module


def _chain(n: int):
    """h_i = f(h_{i-1}, w_i): each result may be either operand, and writes both."""
    lines = ["%x = input"] + [f"%w{i} = input" for i in range(n)] + ["^entry"]
    h = "x"
    for i in range(n):
        lines.append(f'%h{i} = compute "f"(%{h}, %w{i}) {{writes = [%{h}, %w{i}], may_alias = [%{h}, %w{i}]}}')
        h = f"h{i}"
    lines.append(f'%v = view "aten.view"(%{h})\n%output = output(%v)')
    return parse_program("\n".join(lines) + "\n")


def test_the_union_is_each_names_candidates_and_the_order_is_the_walks():
    program = _chain(6)
    names = ["w2", "h1", "v"]
    assert storage_candidates_of(program, names) == {c for n in names for c in storage_candidates(program, n)}
    # the walk's order (as before: the root first, then each storage as the walk finds it)
    assert storage_candidates(program, "v") == ("h5", "h4", "w5", "h3", "w4", "h2", "w3", "h1", "w2", "h0", "w1",
                                                "x", "w0")
    assert storage_candidates(program, "w3") == ("w3",)


def _count_steps(monkeypatch, module):
    calls = []
    real = storage_module.may_be
    monkeypatch.setattr(module, "may_be", lambda *a: calls.append(a[1]) or real(*a))
    return calls


def test_unshards_written_storages_expand_each_storage_once(monkeypatch):
    program = _chain(200)
    calls = _count_steps(monkeypatch, storage_module)
    candidates, _ = unshard_module.find_candidates(program)
    assert len(calls) == len(set(calls)) == 400  # each written storage once (a walk per write: 40k steps)


def test_the_rewriters_maybe_set_expands_each_storage_once(monkeypatch):
    program = _chain(200)
    calls = _count_steps(monkeypatch, __import__("fxsched.ir.rewriter", fromlist=["may_be"]))
    found = Rewriter(program)._maybe_set("h199")
    assert len(found) == 401 and len(calls) == len(set(calls)) == 401
