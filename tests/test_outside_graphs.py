"""Code Dynamo runs outside every graph (``tspc/outside_graphs.py``).

A module under ``torch.compiler.disable`` and transformers' gradient checkpointing (each
checkpointed layer runs eagerly: a graph break) leave parameters that no compiled graph
receives. Found by probing (stop 41): on a (dp = 2, tsp = 2) mesh their gradients were never
averaged over dp, so each replica stepped with its own half-batch's gradient — after two AdamW
steps every weight was off by ~0.04 against one process on the global batch, and the replicas
had drifted apart, with no error and no warning. Now their gradients are averaged like the
graphs' and the run equals one process; and at D > 1 the user is told, once, which parameters
ran outside the graphs (whole on every rank, that code not sharded), with the fix for
transformers' gradient checkpointing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests.helpers import HF_SMALL
from tspc.launch import spawn


def _models(kind: str):
    """(reference, copy) built identically on every rank: ``kind`` "disabled" is the reference
    model with its second block's MLP under ``torch.compiler.disable``; "checkpointed" a
    one-layer transformers Llama with gradient checkpointing on; "tied_eager_embedding" the
    reference model with tied embeddings whose lookup runs eagerly (the weight's gradient
    comes from the eager lookup and from the LM head in the graph)."""
    torch.manual_seed(0)
    if kind == "disabled":
        from samples.reference_model import build_reference_model

        ref = build_reference_model(seed=0, num_layers=2)
        model = copy.deepcopy(ref)
        for m in (ref, model):  # a bound method per copy: deepcopy would keep ref's
            m.layers[1].mlp.forward = torch.compiler.disable(m.layers[1].mlp.forward)
        return ref, model, lambda m, ids: m(ids)
    if kind == "tied_eager_embedding":
        from samples.reference_model import build_reference_model

        ref = build_reference_model(seed=0, num_layers=1, tie_embeddings=True)
        model = copy.deepcopy(ref)
        for m in (ref, model):
            m.embed.forward = torch.compiler.disable(m.embed.forward)
        return ref, model, lambda m, ids: m(ids)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **{**HF_SMALL, "num_hidden_layers": 1})
    cfg._attn_implementation = "sdpa"
    ref = AutoModelForCausalLM.from_config(cfg)
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.gradient_checkpointing_enable()
        m.train()
    return ref, model, lambda m, ids: m(input_ids=ids).logits


def outside_worker(rank: int, world: int, kinds: list[str]) -> dict:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import tspc

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tsp"))
    dp_rank = mesh.get_local_rank("dp")

    def loss(logits, ids):
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    out = {}
    for kind in kinds:
        torch.compiler.reset()
        ref, model, logits = _models(kind)
        run = torch.compile(model, backend="tsp", options={"group": mesh, "mesh_dim": "tsp"})
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
        opt = torch.optim.AdamW(run.parameters(), lr=1e-2, eps=1e-4)
        gen = torch.Generator().manual_seed(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                ids = torch.randint(0, 128, (4, 16), generator=gen)  # the global batch
                mine = ids[2 * dp_rank : 2 * dp_rank + 2]  # this replica's half
                opt_ref.zero_grad()
                loss(logits(ref, ids), ids).backward()
                opt_ref.step()
                opt.zero_grad()
                loss(logits(run, mine), mine).backward()
                opt.step()
        full = tspc.state_dict(run)
        out[kind] = {
            "errs": {k: (full[k] - v).abs().max().item() for k, v in ref.state_dict().items()},
            "outside": [
                str(w.message) for w in caught if "reached no compiled graph" in str(w.message)
            ],
        }
    return out


@pytest.mark.slow
def test_parameters_outside_the_graphs_train_like_one_process_on_a_dp_mesh():
    kinds = ["disabled", "checkpointed", "tied_eager_embedding"]
    results = spawn(outside_worker, 4, kinds, timeout=600)
    for kind in kinds:
        for r in results:
            errs = r[kind]["errs"]
            assert max(errs.values()) < 1e-5, (kind, sorted(errs.items(), key=lambda e: -e[1])[:3])
        # the replicas agree with each other too (each equals one process)
        assert results[0][kind]["errs"] == results[2][kind]["errs"], kind
        if kind == "tied_eager_embedding":  # the weight reaches a graph as the LM head
            assert results[0][kind]["outside"] == [], results[0][kind]["outside"]
            continue
        (message,) = results[0][kind]["outside"]  # said once, at the second call
        if kind == "disabled":
            assert "layers.1.mlp.gate_proj" in message and "whole on each of the 2" in message
            assert "TORCH_LOGS=graph_breaks" in message, message
        else:
            assert "model.layers.0.self_attn.q_proj" in message, message
            assert "gradient_checkpointing_disable()" in message, message
            assert "'recompute': 'full'" in message, message


def test_the_warning_names_what_no_graph_received_and_the_checkpointing_fix():
    import tspc
    from tspc.outside_graphs import _RECEIVED, outside_graphs, warn_outside_graphs

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.gradient_checkpointing = False

    model = torch.nn.Sequential(Layer(), Layer())
    setattr(model[0].proj.weight, _RECEIVED, True)  # as a graph's first call marks it
    setattr(model[0].proj.bias, _RECEIVED, True)
    model[1].proj.bias.requires_grad_(False)  # frozen: nothing to average, nothing to say
    assert [n for n, _ in outside_graphs(model)] == ["1.proj.weight"]
    with pytest.warns(tspc.TSPHeldWholeWarning) as record:
        message = warn_outside_graphs(model, 2)
    assert str(record[0].message) == message
    assert "1 parameters of Sequential (16 of its 40 values)" in message, message
    assert "(1.proj)" in message and "TORCH_LOGS=graph_breaks" in message, message
    model[1].gradient_checkpointing = True
    assert "gradient_checkpointing_disable()" in warn_outside_graphs(model, 2)
    setattr(model[1].proj.weight, _RECEIVED, True)
    assert warn_outside_graphs(model, 2) is None
