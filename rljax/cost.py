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


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s([\w\-]+)\((.*)$")
_PARAM = re.compile(r"([\w.\-]+):\s*(\([^)]*\)|[a-z]+\d*\[[\d,]*\])")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_NO_TRAFFIC = ("parameter", "get-tuple-element", "tuple", "constant", "bitcast", "while",
               "call", "conditional")


def _dims(text: str) -> list[int]:
    found = _SHAPE.search(text)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _loop_parts(hlo_text: str) -> dict:
    """Per computation of an HLO module: its own matmul FLOPs (``dot``: 2 x output elements x
    the contracted size), the bytes its instructions read and write, and the computations it
    runs, each with how often: a fusion's or call's once, a while body its known trip count."""
    comps, current, shapes = {}, None, {}
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = comps.setdefault(header.group(1), {"dot": 0.0, "bytes": 0.0,
                                                         "calls": []})
            shapes = dict(_PARAM.findall(header.group(2)))
            continue
        ins = _INSTRUCTION.match(line) if current is not None else None
        if not ins:
            continue
        name, out_type, op, rest = ins.groups()
        shapes[name] = out_type
        operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0])
        if op == "dot":
            lhs = _dims(shapes.get(operands[0], "")) if operands else []
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            k = 1
            for d in (contracting.group(1).split(",") if contracting else []):
                if d and int(d) < len(lhs):
                    k *= lhs[int(d)]
            out = 1
            for d in _dims(out_type):
                out *= d
            current["dot"] += 2.0 * out * k
        if op not in _NO_TRAFFIC:
            sizes = [_shape_bytes(shapes.get(o, "")) for o in operands]
            out_bytes = _shape_bytes(out_type)
            if "dynamic-update-slice" in name or op == "dynamic-update-slice":
                # (XLA names a fusion after its root) reads and writes the update only
                current["bytes"] += 2 * (sum(sizes) - max(sizes, default=0))
            elif "dynamic-slice" in name or op == "dynamic-slice":
                current["bytes"] += 2 * out_bytes   # reads the slice it returns
            else:
                current["bytes"] += out_bytes + sum(sizes)
        for key, trips in (("calls", 1), ("to_apply", 1), ("body", None)):
            if op == "while" and key != "body" or op not in ("fusion", "call", "while"):
                continue
            callee = re.search(key + r"=%([\w.\-]+)", rest)
            if callee:
                count = trips
                if count is None:
                    found = _TRIPS.search(rest)
                    count = int(found.group(1)) if found else 1
                current["calls"].append((callee.group(1), count, op == "fusion"))
    return comps


def loop_corrections(hlo_text: str) -> tuple[float, float]:
    """``(FLOPs, bytes)`` XLA's cost analysis leaves out of a module with loops: it counts a
    while loop's body once, whatever its trip count (a scan over the layers: one layer). The
    missing trips' matmul FLOPs and bytes (each body instruction's operands and result, as XLA
    counts a fusion's) are added back; other loops' costs and unknown trip counts stay once."""
    comps = _loop_parts(hlo_text)
    memo: dict = {}

    def totals(name: str, stack=()) -> tuple:
        """(dot FLOPs with trips, dot FLOPs once, bytes with trips, bytes once)."""
        if name in memo:
            return memo[name]
        c = comps.get(name)
        if c is None or name in stack:
            return (0.0, 0.0, 0.0, 0.0)
        dot_t = dot_1 = c["dot"]
        bytes_t = bytes_1 = c["bytes"]
        for callee, trips, fused in c["calls"]:
            d_t, d_1, b_t, b_1 = totals(callee, stack + (name,))
            dot_t += trips * d_t
            dot_1 += d_1
            if not fused:   # a fusion's traffic is its own operands and result
                bytes_t += trips * b_t
                bytes_1 += b_1
        memo[name] = (dot_t, dot_1, bytes_t, bytes_1)
        return memo[name]

    entry = next((m.group(1) for m in (_COMPUTATION.match(line) for line in
                                       hlo_text.splitlines() if line.startswith("ENTRY"))
                  if m), None)
    if entry is None:
        return 0.0, 0.0
    dot_t, dot_1, bytes_t, bytes_1 = totals(entry)
    return dot_t - dot_1, bytes_t - bytes_1


def program_cost(compiled) -> ProgramCost:
    """``ProgramCost`` of a ``jax.stages.Compiled`` program (per device, one call): XLA's
    cost analysis plus what it leaves out of loops with known trip counts
    (``loop_corrections``)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):   # older jax: one dict per program
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    text = compiled.as_text()
    flops, accessed = loop_corrections(text)
    return ProgramCost(flops=float(analysis.get("flops", 0.0)) + flops,
                       bytes_accessed=float(analysis.get("bytes accessed", 0.0)) + accessed,
                       collective_bytes=collective_bytes(text))


def roofline_times(cost: ProgramCost, chip: str) -> dict:
    """Seconds of one call on ``chip`` at each peak alone: ``compute``, ``memory``,
    ``communication``."""
    if chip not in CHIPS:
        raise ValueError(f"unknown chip {chip!r}; one of {', '.join(CHIPS)}")
    peaks = CHIPS[chip]
    return {"compute": cost.flops / peaks["flops"],
            "memory": cost.bytes_accessed / peaks["hbm"],
            "communication": cost.collective_bytes / peaks["link"]}


def roofline(cost: ProgramCost, chip: str) -> tuple[float, str]:
    """``(seconds, bound)``: the roofline time of one call on ``chip`` and what decides it,
    ``"compute"``, ``"memory"`` or ``"communication"``."""
    times = roofline_times(cost, chip)
    bound = max(times, key=times.get)
    return times[bound], bound


def mfu_at_bound(cost: ProgramCost, chip: str) -> float:
    """The model FLOPs utilisation the roofline implies: the time of the FLOPs alone at the
    chip's peak over the roofline time (1.0 when compute decides the bound)."""
    t = roofline_times(cost, chip)
    return t["compute"] / max(max(t.values()), 1e-30)


def format_costs(rows: list[tuple[str, ProgramCost]], chip: str) -> str:
    """A table of each program's per-device cost and roofline time on ``chip``."""
    lines = [f"per-device cost of one call, roofline on {chip} "
             f"({CHIPS[chip]['flops'] / 1e12:.0f} TFLOP/s bf16, "
             f"{CHIPS[chip]['hbm'] / 1e9:.0f} GB/s HBM, {CHIPS[chip]['link'] / 1e9:.0f} GB/s "
             "interconnect):",
             f"  {'program':<15}{'GFLOP':>11}{'HBM MB':>11}{'coll. MB':>10}{'compute':>9}"
             f"{'memory':>9}{'comm.':>9}  bound (ms), MFU at the bound"]
    for name, cost in rows:
        t = roofline_times(cost, chip)
        lines.append(f"  {name:<15}{cost.flops / 1e9:>11.3f}{cost.bytes_accessed / 1e6:>11.2f}"
                     f"{cost.collective_bytes / 1e6:>10.3f}{t['compute'] * 1e3:>9.3f}"
                     f"{t['memory'] * 1e3:>9.3f}{t['communication'] * 1e3:>9.3f}  "
                     f"{roofline(cost, chip)[1]}, {mfu_at_bound(cost, chip):.0%}")
    lines.append("  (from XLA's cost analysis of the programs as compiled here; bytes from a CPU "
                 "build overstate an accelerator's HBM traffic, which fuses more: see "
                 "docs/scaling.md)")
    return "\n".join(lines)
