"""What a compiled program costs per device, and a roofline time on a named chip.

``program_cost(compiled)`` reads XLA's own cost analysis of a compiled program (FLOPs and bytes
accessed per device, as XLA counts them for the program it built) and adds the bytes its
collectives produce (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute,
read from the compiled HLO). ``roofline(cost, chip)`` turns them into a lower bound on the time
of one call from the chip's published peaks, and names the bound that decides it:

    time = max(FLOPs / peak bf16 FLOP/s, bytes accessed / HBM bytes/s,
               collective bytes / interconnect bytes/s)

This is a prediction from the programs, not a measurement: it ignores launch overhead, the
overlap XLA may not achieve, attention kernels that a backend runs differently, and the fact
that a program compiled for fake CPU devices is fused as XLA:CPU fuses it (bytes accessed
can be higher than on a TPU or GPU). ``rljax plan --cost CHIP`` prints it per program.
"""
from __future__ import annotations

import dataclasses
import re

# Published per-chip peaks: dense bf16 FLOP/s, HBM bytes/s, and the chip's interconnect
# bytes/s (TPU ICI, bidirectional per chip; GPU NVLink, total per GPU). Sources: the Cloud
# TPU system-architecture pages for v4, v5e, v5p and v6e; NVIDIA's H100 SXM and H200 SXM
# data sheets (dense, i.e. without structured sparsity).
CHIPS = {
    "v4": dict(flops=275e12, hbm=1200e9, link=300e9, memory=32 * 2**30),
    "v5e": dict(flops=197e12, hbm=819e9, link=400e9, memory=16 * 2**30),
    "v5p": dict(flops=459e12, hbm=2765e9, link=1200e9, memory=95 * 2**30),
    "v6e": dict(flops=918e12, hbm=1638e9, link=800e9, memory=32 * 2**30),
    "h100": dict(flops=989e12, hbm=3350e9, link=900e9, memory=80 * 10**9),
    "h200": dict(flops=989e12, hbm=4800e9, link=900e9, memory=141 * 10**9),
}

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute", "ragged-all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5,
          "u4": 0.5}
_SHAPE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
# `%name = TYPE op(` where op is a collective or its async start (the -done half is not
# counted again).
_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """Per-device cost of one call of a compiled program."""
    flops: float
    bytes_accessed: float
    collective_bytes: float

    def __add__(self, other: "ProgramCost") -> "ProgramCost":
        return ProgramCost(self.flops + other.flops, self.bytes_accessed + other.bytes_accessed,
                           self.collective_bytes + other.collective_bytes)


def _shape_bytes(text: str) -> float:
    """Bytes of every ``dtype[dims]`` array in an HLO result type (a tuple sums its parts)."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        size = 1
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size * _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
    return total


def collective_bytes(hlo_text: str) -> float:
    """Bytes the collectives of an HLO module produce per device (their result arrays)."""
    total = 0.0
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m:
            total += _shape_bytes(m.group(1))
    return total


def program_cost(compiled) -> ProgramCost:
    """``ProgramCost`` of a ``jax.stages.Compiled`` program (per device, one call)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):   # older jax: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    return ProgramCost(flops=float(analysis.get("flops", 0.0)),
                       bytes_accessed=float(analysis.get("bytes accessed", 0.0)),
                       collective_bytes=collective_bytes(compiled.as_text()))


def roofline(cost: ProgramCost, chip: str) -> tuple[float, str]:
    """``(seconds, bound)``: the roofline time of one call on ``chip`` and what decides it,
    ``"compute"``, ``"memory"`` or ``"communication"``."""
    if chip not in CHIPS:
        raise ValueError(f"unknown chip {chip!r}; one of {', '.join(CHIPS)}")
    peaks = CHIPS[chip]
    times = {"compute": cost.flops / peaks["flops"],
             "memory": cost.bytes_accessed / peaks["hbm"],
             "communication": cost.collective_bytes / peaks["link"]}
    bound = max(times, key=times.get)
    return times[bound], bound


def format_costs(rows: list[tuple[str, ProgramCost]], chip: str) -> str:
    """A table of each program's per-device cost and roofline time on ``chip``."""
    lines = [f"per-device cost of one call, roofline on {chip} "
             f"({CHIPS[chip]['flops'] / 1e12:.0f} TFLOP/s bf16, "
             f"{CHIPS[chip]['hbm'] / 1e9:.0f} GB/s HBM, {CHIPS[chip]['link'] / 1e9:.0f} GB/s "
             "interconnect):",
             f"  {'program':<15}{'GFLOP':>12}{'HBM MB':>12}{'coll. MB':>11}{'time ms':>10}"
             "  bound"]
    for name, cost in rows:
        seconds, bound = roofline(cost, chip)
        lines.append(f"  {name:<15}{cost.flops / 1e9:>12.3f}{cost.bytes_accessed / 1e6:>12.2f}"
                     f"{cost.collective_bytes / 1e6:>11.3f}{seconds * 1e3:>10.3f}  {bound}")
    lines.append("  (a lower bound from XLA's cost analysis of the compiled programs: no launch "
                 "overhead, perfect overlap)")
    return "\n".join(lines)
