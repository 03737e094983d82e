"""What the time model knows about a machine: compute, memory and links, as an editable JSON.

A :class:`Hardware` holds the peak dense FLOP/s per dtype and the fraction of it each op class
reaches (GEMMs, attention kernels), the memory bandwidth and the fraction streaming ops reach,
a fixed cost per op (kernel launch or, on a CPU, dispatch), and an α–β description of each link
kind (``intra``: inside a node; ``inter``: between nodes). Measured curves may replace the flat
efficiencies: ``gemm_curve`` (FLOPs of one call -> FLOP/s reached) and ``memory_curve`` (bytes of
one call -> bytes/s), and ``collectives`` gives measured α and bandwidth per collective kind
(what ``tspc plan --calibrate`` writes for this machine's gloo).

The GPU presets (``hardware_presets.json``) are datasheet peaks times efficiencies that are
*assumptions*, each preset's ``notes`` giving the source of its numbers; copy one into a JSON file
of your own (``save_hardware``, then ``tspc plan --hardware x.json``) when you know better. None
of them was fitted to a step time.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINK_KINDS = ("intra", "inter")


@dataclass(frozen=True)
class Link:
    """α–β: a transfer of n bytes over one hop takes ``alpha + n / bandwidth`` seconds."""

    alpha: float  # seconds per message (per algorithm step)
    bandwidth: float  # bytes/s per direction per GPU reached in practice


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s
    memory_bandwidth: float  # bytes/s (HBM, or DRAM for a CPU)
    links: dict[str, Link]
    devices_per_node: int = 8
    gemm_efficiency: float = 0.7
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    op_overhead: float = 5e-6  # seconds per op (launch/dispatch), added to every compute op
    view_overhead: float = 0.0  # seconds per view op (no kernel on a GPU; dispatch on a CPU)
    # measured curves (optional): [[x, rate], ...] sorted by x; log-log interpolation
    gemm_curve: dict[str, list[list[float]]] = field(default_factory=dict)  # dtype -> curve
    memory_curve: list[list[float]] = field(default_factory=list)
    # attention kernels by head size: [[head_dim, forward FLOP/s, backward FLOP/s], ...]
    # (FLOPs as the trace counts them: causal halved, backward 2.5x the forward's)
    attention_curve: list[list[float]] = field(default_factory=list)
    collectives: dict[str, Link] = field(default_factory=dict)  # kind -> measured α, bandwidth
    # fraction of a transfer's time during which compute still runs at full speed (1 on GPUs:
    # copy engines / a few SMs; on a CPU, gloo's threads take cores from the compute)
    overlap: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        if not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(f"hardware {self.name!r}: peak_flops must be positive per dtype")
        if self.memory_bandwidth <= 0:
            raise ValueError(f"hardware {self.name!r}: memory_bandwidth must be positive")
        if "intra" not in self.links:
            raise ValueError(f"hardware {self.name!r}: links need an 'intra' entry")
        for key in ("gemm_efficiency", "attention_efficiency", "memory_efficiency", "overlap"):
            if not 0 < getattr(self, key) <= 1:
                raise ValueError(f"hardware {self.name!r}: {key} must be in (0, 1]")

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (fp32 falls back to the bf16 figure / 2 when not given)."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp16" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"]
        base = self.peak_flops.get("bf16") or next(iter(self.peak_flops.values()))
        return base / 2

    def link(self, devices: int) -> Link:
        """The link a group of ``devices`` crosses: inside a node, or between nodes."""
        if devices <= self.devices_per_node or "inter" not in self.links:
            return self.links["intra"]
        return self.links["inter"]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Hardware:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"hardware JSON: unknown keys {unknown}; known: {sorted(known)}")
        data = dict(data)
        try:
            data["links"] = {k: Link(**v) for k, v in data["links"].items()}
            data["collectives"] = {k: Link(**v) for k, v in data.get("collectives", {}).items()}
            return cls(**data)
        except (KeyError, TypeError) as err:
            raise ValueError(f"hardware JSON is incomplete or malformed: {err}") from None


def interpolate(curve: list[list[float]], x: float) -> float:
    """The rate at ``x`` on a measured [[x, rate], ...] curve: log-log between points, the end
    values outside them."""
    import math

    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, r0), (x1, r1) in zip(curve, curve[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return curve[-1][1]


# The presets live in a JSON file next to this module (shipped as package data), in the format
# of ``--hardware FILE.json`` plus two keys of their own: ``notes``, where each number comes from
# (JSON has no comments), and ``based_on``, a preset whose fields this one keeps unless it gives
# them (the H200 is an H100 with more memory bandwidth).
PRESETS_FILE = Path(__file__).with_name("hardware_presets.json")


def _load_presets(path: Path) -> dict[str, Hardware]:
    entries = json.loads(path.read_text())
    presets: dict[str, Hardware] = {}
    for key, entry in entries.items():
        fields = {k: v for k, v in entry.items() if k not in ("notes", "based_on")}
        if "based_on" in entry:
            fields = presets[entry["based_on"]].to_json() | fields
        presets[key] = Hardware.from_json(fields)
    return presets


PRESETS: dict[str, Hardware] = _load_presets(PRESETS_FILE)


def load_hardware(spec: str | Path | Hardware) -> Hardware:
    """A preset name (mi300x, h100, h200) or the path of a hardware JSON file."""
    if isinstance(spec, Hardware):
        return spec
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]
    path = Path(spec)
    if not path.exists():
        raise ValueError(
            f"hardware {str(spec)!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor "
            "a JSON file (write one with `tspc plan --calibrate --save FILE.json`)"
        )
    try:
        return Hardware.from_json(json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ValueError(f"hardware file {path} is not valid JSON: {err}") from None


def save_hardware(hw: Hardware, path: str | Path) -> None:
    Path(path).write_text(json.dumps(hw.to_json(), indent=2) + "\n")
