"""α–β times of the collectives, per algorithm (what NCCL/RCCL and gloo run for each).

``n`` is the collective's payload in bytes as torch names it: the *output* of an all-gather
(the whole gathered tensor), the *input* of a reduce-scatter, the tensor of an all-reduce,
broadcast or reduce, everything a rank holds for an all-to-all, and the tensor sent (and, the
same size, received) by a point-to-point hop. With D ranks, link latency α and bandwidth b
(bytes/s per direction per rank):

* ring all-gather / reduce-scatter: D - 1 steps of n/D bytes: ``(D-1)·(α + n/(D·b))``
* ring all-reduce (reduce-scatter then all-gather): ``2·(D-1)·(α + n/(D·b))``
* pipelined broadcast / reduce (a chain cut into chunks): ``(D-1)·α + n/b``
* all-to-all (each rank sends (D-1)/D of its data, links in parallel): ``(D-1)·α + (D-1)/D·n/b``
* point-to-point (one ring hop, send and receive at once): ``α + n/b``

With D = 1 nothing moves and every time is 0.
"""

from __future__ import annotations

from tspc.tools.timemodel.hardware import Hardware, Link

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "all_to_all", "p2p")


def alpha_beta_time(kind: str, nbytes: float, devices: int, link: Link) -> float:
    """Seconds for one collective of ``kind`` moving ``nbytes`` over ``devices`` ranks."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; known: {KINDS}")
    d = devices
    if d <= 1:
        return 0.0
    a, b = link.alpha, link.bandwidth
    if kind in ("all_gather", "reduce_scatter"):
        return (d - 1) * (a + nbytes / (d * b))
    if kind == "all_reduce":
        return 2 * (d - 1) * (a + nbytes / (d * b))
    if kind in ("broadcast", "reduce"):
        return (d - 1) * a + nbytes / b
    if kind == "all_to_all":
        return (d - 1) * a + (d - 1) / d * nbytes / b
    return a + nbytes / b  # p2p


def collective_time(hw: Hardware, kind: str, nbytes: float, devices: int) -> float:
    """The α–β time on ``hw``: a measured α/bandwidth for this kind when the hardware has one
    (calibrated), else the link the group crosses."""
    link = hw.collectives.get(kind) or hw.link(devices)
    return alpha_beta_time(kind, nbytes, devices, link)


def fit_link(kind: str, devices: int, points: list[tuple[float, float]]) -> Link:
    """The α and bandwidth that make :func:`alpha_beta_time` fit measured (bytes, seconds)
    points of one collective at ``devices`` ranks (least squares on t = c0 + c1·n; when noise
    gives no positive slope, the largest message's time is taken as all transfer)."""
    if devices < 2 or len(points) < 2:
        raise ValueError("fitting a link needs >= 2 ranks and >= 2 message sizes")
    xs = [n for n, _ in points]
    ys = [t for _, t in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    if slope <= 0:  # noise swamped the size dependence: all of the largest one is transfer
        big = max(points)
        slope = big[1] / big[0]
    intercept = max(my - slope * mx, 0.0)
    d = devices
    steps, per_byte = {
        "all_gather": (d - 1, (d - 1) / d),
        "reduce_scatter": (d - 1, (d - 1) / d),
        "all_reduce": (2 * (d - 1), 2 * (d - 1) / d),
        "broadcast": (d - 1, 1.0),
        "reduce": (d - 1, 1.0),
        "all_to_all": (d - 1, (d - 1) / d),
        "p2p": (1, 1.0),
    }[kind]
    return Link(alpha=intercept / steps, bandwidth=per_byte / slope)
