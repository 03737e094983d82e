"""Inductor's own scheduler sees every tspc transfer as one of its collectives.

tspc issues its transfers from its own start ops (``runtime/comm.py``: a per-graph timeout,
the layer named in a failure, fp32 on the wire for 16-bit sums, one buffer of the source's
size on a rank that receives a broadcast) and completes them with torch's
``_c10d_functional.wait_tensor``. What matters to Inductor is what its IR makes of them: each
start must be a ``_CollectiveKernel`` (``torch._inductor.utils.is_collective``) and each wait a
``_WaitKernel`` (``is_wait``), the classes its scheduling, memory planning and comm-overlap
passes look for; anything else would be an opaque fallback kernel that those passes reorder
freely, or not at all. Checked here on Inductor's scheduler nodes, with its comm-overlap
reordering switched on, on the fake process group (rank 0 of 2: no data is looked at).
"""

from __future__ import annotations

import pytest
import torch


@pytest.mark.slow
def test_inductor_lowers_every_tspc_start_as_a_collective_and_its_wait_as_a_wait(
    fake_group, monkeypatch
):
    from torch._inductor import comms
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import is_collective, is_wait

    from tspc.runtime import comm

    group = fake_group(0, 2)
    name, world = group.name, group.size

    def step(x, w):
        # every kind of transfer, each with compute around it
        a = comm.all_gather(x @ w, 0, 1, 1, True, name, world, "t.all_gather")
        b = comm.broadcast(w, 0, w.numel(), name, world, "t.broadcast").view_as(w)
        c = comm.all_reduce(a @ b, "sum", name, world, "t.all_reduce")
        d = comm.reduce(c, 0, name, world, "t.reduce")
        e = comm.ring_hop(d, 1, name, world, "t.ring")
        f = torch.ops.tspc.ring_chunk_wait(
            torch.ops.tspc.ring_chunk_start(e, -1, name, world, "t.ring_chunk"),
            e,
            -1,
            name,
            world,
            "t.ring_chunk",
        )
        p = comm.reduce_scatter_parts(f.reshape(world, -1), name, world, "t.reduce_scatter")
        return p.sum() + f.sum()

    scheduled: list[tuple[object, bool, bool]] = []

    def record(snodes):
        for s in snodes:
            scheduled.append(
                (getattr(s.node, "op_overload", None), is_collective(s.node), is_wait(s.node))
            )
        return snodes

    seen_by_overlap_pass: list[int] = []
    reorder = comms.reorder_compute_and_comm_for_overlap

    def counting_reorder(snodes, *args, **kwargs):
        seen_by_overlap_pass.append(sum(is_collective(s.node) for s in snodes))
        return reorder(snodes, *args, **kwargs)

    monkeypatch.setattr(comms, "reorder_compute_and_comm_for_overlap", counting_reorder)
    with (
        inductor_config.patch(
            _pre_fusion_custom_pass=record,
            fx_graph_cache=False,
            reorder_for_compute_comm_overlap=True,
        ),
        comm.lowered_for_inductor(),  # what tspc/inner.py opens while Inductor compiles
        comm.collectives_kept(),
    ):
        torch.compile(step, backend="inductor", fullgraph=True)(
            torch.randn(4, 8), torch.randn(8, 8)
        )

    starts = set(comm.START_KIND)  # the seven start ops, ring chunks included
    collectives = [op for op, coll, _ in scheduled if coll]
    # each start is one collective kernel, and nothing else is
    assert sorted(map(str, collectives)) == sorted(map(str, starts)), scheduled
    assert all(op in starts for op in collectives), scheduled
    # each transfer is completed by one of Inductor's wait kernels: torch's wait_tensor
    waits = [op for op, _, w in scheduled if w]
    assert waits == [torch.ops._c10d_functional.wait_tensor.default] * len(starts), scheduled
    # Inductor's comm-overlap pass ran over the scheduler nodes and found every transfer there
    assert seen_by_overlap_pass == [len(starts)], seen_by_overlap_pass
