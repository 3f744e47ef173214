"""Hardware profiles for the roofline cost model: peak compute, memory and collective numbers.

Every number is a vendor peak ("up to") figure unless marked as an assumption; the source is
written beside it. Dense (non-sparse) tensor-core figures are used: NVIDIA's datasheets quote
"with sparsity" numbers, which are twice the dense ones. Collective latency is not a datasheet
figure anywhere: it is an assumption of the order NCCL/HCCL reach for small intra-node
messages, and can be overridden (`attrs.evolve(H100, coll_latency_us=...)`).

Units: TFLOP/s (1e12), GB/s (1e9 bytes/s), microseconds, GiB.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

#: IR dtype (ir.ops.DTYPE_BYTES keys) -> the peak-throughput class it runs at
DTYPE_CLASS = {"bf16": "bf16", "f16": "f16", "f32": "f32", "f64": "f64", "f8e4m3": "f8", "f8e5m2": "f8",
               "c64": "f32", "c128": "f64"}


@attrs.frozen(kw_only=True)
class Hardware:
    """One accelerator, as the cost model sees it.

    `peak_tflops` maps a dtype class (bf16, f16, f32, f8, f64) to dense peak TFLOP/s;
    `hbm_gbps` is device-memory bandwidth; `coll_gbps` is the per-device, per-direction
    intra-node collective bandwidth used as NCCL's "bus bandwidth" (time = bytes·(n−1)/n ÷ it);
    `coll_latency_us` the fixed cost of one collective; `launch_us` the fixed cost of one
    kernel on the compute stream.
    """

    name: str
    peak_tflops: Mapping[str, float] = attrs.field(converter=lambda m: dict(m))
    hbm_gbps: float
    coll_gbps: float
    coll_latency_us: float
    launch_us: float = 3.0
    memory_gib: float = 0.0
    sources: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def tflops(self, dtype: str | None) -> float:
        """Peak TFLOP/s for results of IR dtype `dtype` (f32 when unknown or not listed)."""
        cls = DTYPE_CLASS.get(dtype or "f32", "f32")
        if cls in self.peak_tflops:
            return self.peak_tflops[cls]
        if cls == "f64" and "f32" in self.peak_tflops:
            return self.peak_tflops["f32"] / 2
        return self.peak_tflops.get("f32") or max(self.peak_tflops.values())


# NVIDIA H100 SXM5 80 GB.
#   https://www.nvidia.com/en-us/data-center/h100/  (product page, "Technical Specifications", SXM column)
#   https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet  (H100 datasheet)
#   BF16/FP16 tensor core 1,979 TFLOPS with sparsity -> 989.5 dense; FP8 3,958 sparse -> 1,979 dense;
#   FP32 (non-tensor) 67 TFLOPS; FP64 34 TFLOPS; HBM3 80 GB at 3.35 TB/s;
#   NVLink 900 GB/s total bidirectional -> 450 GB/s per direction.
H100 = Hardware(
    name="H100-SXM",
    peak_tflops={"bf16": 989.5, "f16": 989.5, "f8": 1979.0, "f32": 67.0, "f64": 34.0},
    hbm_gbps=3350.0,
    coll_gbps=450.0,
    coll_latency_us=10.0,   # assumption: NCCL intra-node small-message latency (not a datasheet figure)
    launch_us=3.0,          # assumption: kernel launch + scheduling gap
    memory_gib=80 * 1e9 / 2**30,
    sources=("https://www.nvidia.com/en-us/data-center/h100/",
             "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
)

# NVIDIA H200 SXM 141 GB: the H100's compute with HBM3e.
#   https://www.nvidia.com/en-us/data-center/h200/  (product page, "Technical Specifications", SXM column)
#   BF16/FP16 1,979 TFLOPS sparse -> 989.5 dense; FP8 3,958 sparse -> 1,979 dense; FP32 67 TFLOPS;
#   FP64 34 TFLOPS; HBM3e 141 GB at 4.8 TB/s; NVLink 900 GB/s bidirectional -> 450 GB/s per direction.
H200 = Hardware(
    name="H200-SXM",
    peak_tflops={"bf16": 989.5, "f16": 989.5, "f8": 1979.0, "f32": 67.0, "f64": 34.0},
    hbm_gbps=4800.0,
    coll_gbps=450.0,
    coll_latency_us=10.0,   # assumption, as for H100
    launch_us=3.0,          # assumption, as for H100
    memory_gib=141 * 1e9 / 2**30,
    sources=("https://www.nvidia.com/en-us/data-center/h200/",),
)

# Huawei Ascend 910B (Atlas 800T A2 training server, 8 NPUs, HCCS full mesh).
#   Huawei publishes no per-chip 910B datasheet; these are the figures commonly cited from Huawei
#   product material and press, and they vary by SKU (910B1..B4): check yours.
#   https://e.huawei.com/en/products/computing/ascend/atlas-800t-a2  (server: 8x 910B, HCCS)
#   https://www.hiascend.com/hardware/product  (Ascend hardware overview)
#   FP16/BF16 ~320 TFLOPS (cube units); 64 GB HBM2e at ~1.6 TB/s; HCCS 7 links x 56 GB/s = 392 GB/s
#   per NPU (both directions) -> 196 GB/s per direction.
#   FP32 is not published: assumption = 1/4 of FP16.
ASCEND_910B = Hardware(
    name="Ascend-910B",
    peak_tflops={"bf16": 320.0, "f16": 320.0, "f32": 80.0},
    hbm_gbps=1600.0,
    coll_gbps=196.0,
    coll_latency_us=15.0,   # assumption: HCCL intra-node small-message latency
    launch_us=5.0,          # assumption: task launch on the NPU stream
    memory_gib=64 * 1e9 / 2**30,
    sources=("https://e.huawei.com/en/products/computing/ascend/atlas-800t-a2",
             "https://www.hiascend.com/hardware/product"),
)

PROFILES: dict[str, Hardware] = {"h100": H100, "h200": H200, "910b": ASCEND_910B}
_ALIASES = {"h100-sxm": "h100", "h200-sxm": "h200", "ascend-910b": "910b", "ascend910b": "910b", "ascend": "910b"}


def hardware(name: str) -> Hardware:
    """A profile by name: `h100`, `h200` or `910b` (case-insensitive; `ascend-910b` works too)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PROFILES:
        raise ValueError(f"unknown hardware profile {name!r}; profiles: {sorted(PROFILES)}")
    return PROFILES[key]
