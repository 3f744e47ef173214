"""The cost model: FLOPs, bytes and times by hand on hand-written IR; collectives; overrides."""

from __future__ import annotations

import math
import textwrap

import attrs
import pytest

from fxsched.cost import (ASCEND_910B, H100, H200, PROFILES, Callback, CostAnalysis, CostModel, Hardware,
                          Measured, Roofline, as_cost_model, attention_flops, bytes_moved, collective_bytes,
                          flops, hardware, op_costs)
from fxsched.ir import parse_program

# Round numbers so every expected time is checkable by hand.
TOY = Hardware(name="toy", peak_tflops={"f32": 1.0, "bf16": 2.0}, hbm_gbps=1000.0, coll_gbps=1.0,
               coll_latency_us=10.0, launch_us=1.0)


def ir(text: str):
    return parse_program(textwrap.dedent(text).lstrip("\n"))


MM = """
    %a = input : f32[128,64]
    %b = input : f32[64,256]
    ^entry
    %mm = compute "aten.mm.default"(%a, %b) {heavy} : f32[128,256]
    %bias = input : f32[256]
    %am = compute "aten.addmm.default"(%bias, %a, %b) {heavy} : f32[128,256]
    %x = input : bf16[4,8,32]
    %y = input : bf16[4,32,16]
    %bm = compute "aten.bmm.default"(%x, %y) {heavy} : bf16[4,8,16]
    %add = compute "aten.add.Tensor"(%mm, %am) : f32[128,256]
    %v = view "aten.view.default"(%add) : f32[256,128]
    %output = output(%v, %bm)
"""


def test_matmul_flops_by_hand():
    p = ir(MM)
    assert flops(p.op("mm"), p) == 2 * 128 * 256 * 64
    assert flops(p.op("am"), p) == 2 * 128 * 256 * 64        # k read from operand 1, not the bias
    assert flops(p.op("bm"), p) == 2 * 4 * 8 * 16 * 32
    assert flops(p.op("add"), p) is None and flops(p.op("v"), p) is None


def test_roofline_times_by_hand():
    p = ir(MM)
    model = Roofline(TOY)
    # mm: 4,194,304 FLOPs at 1 TFLOP/s = 4.194304e-3 ms; bytes (8192 + 16384 + 32768) * 4 = 229,376
    # at 1000 GB/s = 2.29376e-4 ms: compute bound; + 1 us launch
    assert bytes_moved(p.op("mm"), p) == 229_376
    assert model.op_ms(p.op("mm"), p) == pytest.approx(4.194304e-3 + 1e-3)
    # bmm in bf16 runs at the bf16 peak (2 TFLOP/s): 32,768 FLOPs -> 1.6384e-5 ms; bytes
    # (4*8*32 + 4*32*16 + 4*8*16) * 2 = 7,168 -> 7.168e-6 ms: compute bound
    assert model.op_ms(p.op("bm"), p) == pytest.approx(32_768 / 2e9 + 1e-3)
    # add: memory bound, 3 * 32768 * 4 bytes = 393,216 B at 1000 GB/s = 3.93216e-4 ms
    assert model.op_ms(p.op("add"), p) == pytest.approx(393_216 / 1e9 + 1e-3)
    # views, inputs, markers and the output cost nothing
    for name in ("v", "a", "^entry", "output"):
        assert model.op_ms(p.op(name), p) == 0.0


def test_h100_numbers_by_hand():
    p = ir("""
        %a = input : bf16[4096,4096]
        %b = input : bf16[4096,4096]
        ^entry
        %mm = compute "aten.mm.default"(%a, %b) {heavy} : bf16[4096,4096]
        %output = output(%mm)
    """)
    # 2 * 4096^3 FLOPs at 989.5 dense bf16 TFLOP/s (NVIDIA H100 SXM datasheet) + 3 us launch
    expected = 2 * 4096**3 / 989.5e12 * 1e3 + 3e-3
    assert Roofline(H100).op_ms(p.op("mm"), p) == pytest.approx(expected)
    assert Roofline(H200).op_ms(p.op("mm"), p) == pytest.approx(expected)  # same compute, more HBM


ATTENTION = """
    %q = input : f32[2,4,16,8]
    %k = input : f32[2,4,32,8]
    %v = input : f32[2,4,32,8]
    ^entry
    %att = compute "aten._scaled_dot_product_flash_attention_for_cpu.default"(%q, %k, %v) {heavy, attention} : (f32[2,4,16,8], f32[2,4,16])
    %o = view "_operator.getitem"(%att) : f32[2,4,16,8]
    %lse = view "_operator.getitem"(%att) : f32[2,4,16]
    ^backward
    %g = input : f32[2,4,16,8]
    %bw = compute "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"(%g, %q, %k, %v, %o, %lse) {heavy, attention} : (f32[2,4,16,8], f32[2,4,32,8], f32[2,4,32,8])
    %bsh_q = input : bf16[2,16,32]
    %bsh_k = input : bf16[2,32,32]
    %npu = compute "npu.npu_fusion_attention.default"(%bsh_q, %bsh_k, %bsh_k) {heavy, attention} : bf16[2,16,32]
    %npu_grad = compute "npu.npu_fusion_attention_grad.default"(%bsh_q, %bsh_k, %bsh_k, %npu) {heavy, attention} : (bf16[2,16,32], bf16[2,32,32], bf16[2,32,32])
    %output = output(%bw, %npu_grad)
"""


def test_attention_flops_match_torch_flop_counter():
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    p = ir(ATTENTION)
    q, k, v = (2, 4, 16, 8), (2, 4, 32, 8), (2, 4, 32, 8)
    # forward: q.k^T and p.v, 2 * 2*4*16*32*8 each
    assert attention_flops(p.op("att"), p) == 4 * (2 * 4 * 16 * 8) * 32 == sdpa_flop_count(q, k, v)
    # backward: 2.5x the forward
    assert attention_flops(p.op("bw"), p) == sdpa_backward_flop_count(q, q, k, v) == 10 * (2 * 4 * 16 * 8) * 32
    # npu_fusion_attention, BSH layout: S_kv = dim 1 of the key; its _grad is the backward
    assert flops(p.op("npu"), p) == 4 * (2 * 16 * 32) * 32
    assert flops(p.op("npu_grad"), p) == 10 * (2 * 16 * 32) * 32


def test_attention_time_is_the_roofline_max():
    p = ir(ATTENTION)
    model = Roofline(TOY)
    op = p.op("att")
    compute = 4 * (2 * 4 * 16 * 8) * 32 / 1e9      # 131,072 FLOPs at 1 TFLOP/s, in ms
    memory = bytes_moved(op, p) / 1e9             # 1000 GB/s, in ms
    assert model.op_ms(op, p) == pytest.approx(max(compute, memory) + 1e-3)


COLLECTIVES = """
    %w = input : f32[512]
    %x = input : f32[2048]
    ^entry
    %ag = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {group = "0", group_size = 4, role = fsdp_all_gather, nbytes = 4096, params = ["w"]} : f32[2048]
    %agw = wait "_c10d_functional.wait_tensor.default"(%ag) : f32[2048]
    %rs = launch "_c10d_functional.reduce_scatter_tensor.default"(%x) {group = "0", group_size = 2} : f32[1024]
    %rsw = wait(%rs) : f32[1024]
    %ar = launch "_c10d_functional.all_reduce.default"(%x) {group = "1", group_size = 4} : f32[2048]
    %arw = wait(%ar) : f32[2048]
    %unknown = launch "_c10d_functional.all_gather_into_tensor.default"(%w) {nbytes = 4096}
    %unknown_w = wait(%unknown)
    %y = input
    %rs2 = launch "_c10d_functional.reduce_scatter_tensor.default"(%y) {group = "0", group_size = 2} : f32[1024]
    %rs2w = wait(%rs2) : f32[1024]
    %output = output(%agw, %rsw, %arw, %unknown_w, %rs2w)
"""


def test_collective_formula():
    p = ir(COLLECTIVES)
    model = Roofline(TOY)   # 10 us latency, 1 GB/s
    # all-gather: gathered output 8192 B, n = 4: 10 us + 8192 * 3/4 B / 1 GB/s
    assert collective_bytes(p.op("ag"), p) == 8192
    assert model.op_ms(p.op("ag"), p) == pytest.approx(0.01 + 6144 / 1e6)
    # reduce-scatter: input 8192 B, n = 2
    assert collective_bytes(p.op("rs"), p) == 8192
    assert model.op_ms(p.op("rs"), p) == pytest.approx(0.01 + 4096 / 1e6)
    # all-reduce moves 2 (n - 1) / n of its input
    assert model.op_ms(p.op("ar"), p) == pytest.approx(0.01 + 2 * 8192 * 3 / 4 / 1e6)
    # no type: the tagged nbytes; no group size: the model's default group size
    assert collective_bytes(p.op("unknown"), p) == 4096
    assert Roofline(TOY, default_group_size=8).op_ms(p.op("unknown"), p) == pytest.approx(0.01 + 4096 * 7 / 8 / 1e6)
    # a reduce-scatter whose input type is unknown: its output times the group size
    assert collective_bytes(p.op("rs2"), p) == 8192
    # a wait costs nothing on the compute stream
    assert model.op_ms(p.op("agw"), p) == 0.0
    # the same formula, from kind, bytes and group size (for peers that resize collectives)
    assert model.collective_ms("all_gather", 8192, 4) == pytest.approx(model.op_ms(p.op("ag"), p))
    assert model.collective_ms("all_gather", 8192, 1) == 0.0


def test_callback_override_with_fallback():
    p = ir(MM)
    seen = []

    def measured(op):
        seen.append(op.name)
        return 2.5 if op.KIND == "compute" else None

    model = as_cost_model(measured)
    assert isinstance(model, Callback)
    costs = op_costs(p, model)
    assert costs["mm"] == costs["add"] == costs["bm"] == 2.5
    assert costs["v"] == 0.0 and "v" in seen    # None: the fallback (roofline) prices it
    assert Callback(measured, fallback=Roofline(TOY)).op_ms(p.op("v"), p) == 0.0


def test_measured_table_override():
    p = ir(MM)
    table = {"aten.mm.default": 0.5, "aten.add": 0.25, "a": 99.0}
    model = as_cost_model(table)
    assert isinstance(model, Measured)
    costs = op_costs(p, model)
    assert costs["mm"] == 0.5            # exact target
    assert costs["add"] == 0.25          # packet name (aten.add.Tensor -> aten.add)
    assert costs["a"] == 0.0             # inputs are never looked up (their target is a placeholder name)
    assert costs["am"] == pytest.approx(Roofline().op_ms(p.op("am"), p))   # not in the table: fallback
    assert Measured(table, fallback=Roofline(TOY)).op_ms(p.op("am"), p) == pytest.approx(Roofline(TOY).op_ms(p.op("am"), p))


def test_as_cost_model_and_profiles():
    assert as_cost_model(None) == Roofline(H100)
    assert as_cost_model("H200").hw is H200
    assert as_cost_model("ascend-910b").hw is ASCEND_910B
    assert as_cost_model(TOY).hw is TOY
    model = Roofline(TOY)
    assert as_cost_model(model) is model
    with pytest.raises(ValueError, match="unknown hardware profile"):
        hardware("tpu")
    with pytest.raises(TypeError):
        as_cost_model(42)
    for hw in PROFILES.values():   # every profile has its numbers and where they come from
        assert hw.peak_tflops["bf16"] > hw.peak_tflops["f32"] > 0
        assert hw.hbm_gbps > 0 and hw.coll_gbps > 0 and hw.coll_latency_us > 0
        assert hw.sources and all(s.startswith("https://") for s in hw.sources)
    assert H200.hbm_gbps > H100.hbm_gbps and H200.peak_tflops == H100.peak_tflops
    assert H100.tflops("f8e4m3") == 1979.0 and H100.tflops(None) == 67.0 and TOY.tflops("f64") == 0.5


def test_cost_analysis_through_pass_context():
    from fxsched.passes import PassContext

    p = ir(MM)
    analysis = PassContext(cost_model="h200").get(CostAnalysis, p)
    assert analysis.model == Roofline(H200)
    assert analysis.ms == op_costs(p, Roofline(H200))
    assert PassContext().get(CostAnalysis, p).model == Roofline(H100)
    custom = PassContext(cost_model={"aten.mm.default": 7.0}).get(CostAnalysis, p)
    assert custom.ms["mm"] == 7.0


def test_cost_package_imports_only_ir():
    import ast
    import pathlib

    import fxsched.cost as cost

    for path in pathlib.Path(cost.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                assert node.module.split(".")[0] == "ir", f"{path.name} imports ..{node.module}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith(("torch", "fxsched.passes", "fxsched.lowering")) for n in names), path.name


def test_derating_and_launch_override():
    p = ir(MM)
    half = Roofline(TOY, flops_efficiency=0.5, launch_us=0.0)
    assert half.op_ms(p.op("mm"), p) == pytest.approx(2 * 4.194304e-3)
    assert isinstance(half, CostModel) and math.isclose(half.overhead_ms, 0.0)
    assert attrs.evolve(TOY, launch_us=2.0).launch_us == 2.0


def test_roofline_prices_alike_ops_once_and_only_alike_ones():
    """op_costs prices ops alike for the roofline (kind, target, group size, nbytes, own and
    operand type tuples) once: each cost is what the op's own op_ms says, also where two ops
    share their result's type tuple (as lowering makes them) but read operands of other types."""
    program = ir("""
        %a = input : f32[128,64]
        %b = input : f32[64,256]
        %c = input : f32[128,32]
        %d = input : f32[32,256]
        ^entry
        %m1 = compute "aten.mm.default"(%a, %b) {heavy} : f32[128,256]
        %m2 = compute "aten.mm.default"(%c, %d) {heavy} : f32[128,256]
        %m3 = compute "aten.mm.default"(%a, %b) {heavy} : f32[128,256]
        %ag = launch "all_gather_into_tensor"(%a) {group = "0", group_size = 2} : f32[256,64]
        %ag2 = launch "all_gather_into_tensor"(%a) {group = "0", group_size = 4} : f32[256,64]
        %w = wait "wait_tensor"(%ag) : f32[256,64]
        %w2 = wait "wait_tensor"(%ag2) : f32[256,64]
        %output = output(%m1, %m2, %m3, %w, %w2)
    """)
    m1, ag = program.op("m1"), program.op("ag")
    for name in ("m2", "m3"):  # one result type tuple, as lowering makes one per dtype and shape
        program.replace(attrs.evolve(program.op(name), types=m1.types))
    program.replace(attrs.evolve(program.op("ag2"), types=ag.types))
    model = Roofline(TOY)
    costs = op_costs(program, model)
    assert costs == {op.name: model.op_ms(op, program) if op.KIND in ("compute", "launch") else 0.0
                     for op in program.ops()}
    assert costs["m2"] != costs["m1"] == costs["m3"] and costs["ag2"] != costs["ag"]
