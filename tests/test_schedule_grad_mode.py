"""The overlap schedule never moves a node across a grad-mode switch (issue 27).

Dynamo keeps ``with torch.no_grad()`` blocks as ``torch._C._set_grad_enabled`` calls in the
graph, so a node's grad mode is its position. PhiMoE's sparse mixer computes a mask under
``no_grad`` and then, with grad enabled again, the softmax whose result tspc all-gathers; the
schedule hoisted that softmax (an exclusive producer of the gather) above the switch back on,
into the ``no_grad`` stretch: same values, no gradient recorded (layer 0's router gradient lost
its second choices at D = 2). Graph-only: the schedule runs on a hand-built graph, the check
is each node's grad mode read off the graph order.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tspc.passes.schedule import schedule_overlap


def _grad_modes(g: fx.Graph) -> dict[str, bool]:
    """Node name -> whether grad is enabled where it runs (by the switches before it)."""
    on, out = True, {}
    for n in g.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            on = n.args[0]
        out[n.name] = on
    return out


def _sparse_mixer_like() -> fx.GraphModule:
    g = fx.Graph()
    scores = g.placeholder("scores")
    g.call_function(torch._C._set_grad_enabled, (False,))
    top = g.call_function(torch.amax, (scores, -1, True))
    mask = g.call_function(torch.gt, (g.call_function(torch.sub, (top, scores)), 0.02))
    g.call_function(torch._C._set_grad_enabled, (True,))
    gates = g.call_function(torch.masked_fill, (scores, mask, float("-inf")))
    probs = g.call_function(torch.softmax, (gates, -1))
    gather = (probs, 0, 2, 1, True, "0", 2, "mlp.router")
    start = g.call_function(torch.ops.tspc.all_gather_start.default, gather)
    wait = g.call_function(torch.ops.tspc.all_gather_wait.default, (start, *gather))
    g.output(g.call_function(torch.mul, (wait, 2.0)))
    return fx.GraphModule(torch.nn.Module(), g)


def test_schedule_keeps_every_node_in_its_grad_mode():
    gm = _sparse_mixer_like()
    before = _grad_modes(gm.graph)
    assert not before["amax"] and before["softmax"]  # the graph is what the test says
    schedule_overlap(gm)
    after = _grad_modes(gm.graph)
    moved = {n: (before[n], after[n]) for n in before if before[n] != after[n]}
    assert not moved, f"nodes that changed grad mode (traced, scheduled): {moved}"
