"""Every MLP form the math allows runs the ring: plain and gated, any elementwise activation
chain, Linear or Conv1D (``addmm``) projections, biases, fused gate/up in either order. Forms it
must not run are reported as skipped with the reason. Graph-only tests for the matcher; real
gloo runs (D = 2, 4) for outputs and gradients against one process, placements and bytes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import D4_EXTENDED, capture, grad_error
from tests.mlp_forms import FF, FORMS, SKIPPED, model_with
from tspc.launch import spawn


def match(form: str, world: int = 2, attention: bool = True):
    from tspc.passes.analyse import analyse
    from tspc.passes.match_attention import match_attention
    from tspc.passes.match_mlp import match_mlp

    gm, inputs = capture(model_with(form), torch.randint(0, 256, (2, 16)))
    info = analyse(gm, inputs)
    attention = match_attention(gm, info, world)[0] if attention else []
    claimed = {p.linear for m in attention for p in m.projections()}
    claimed |= {m.o_linear for m in attention}
    return match_mlp(gm, info, world, claimed)


EXPECTED = {
    # form: (projections into F, their F-ranges, activation as reported)
    "plain_gelu": (1, [(0, FF)], "gelu(up)"),
    "plain_gelu_tanh": (1, [(0, FF)], "gelu(up, approximate='tanh')"),
    "relu2": (1, [(0, FF)], "pow(relu(up), 2)"),
    "square_relu": (1, [(0, FF)], "square(relu(up))"),
    "new_gelu": (1, [(0, FF)], "mul(mul(0.5, up), add(1.0, tanh("),
    "scaled_silu": (1, [(0, FF)], "dropout(mul(silu(up), 0.5), 0.1, training=False)"),
    "conv1d": (1, [(0, FF)], "mul(mul(0.5, c_fc), add(1.0, tanh("),
    "gated": (2, [(0, FF), (0, FF)], "mul(silu(gate), up)"),
    "gated_swapped": (2, [(0, FF), (0, FF)], "mul(up, silu(gate))"),
    "fused_gate_up": (2, [(0, FF), (FF, 2 * FF)], "mul(silu(gate_up[0:128]), gate_up[128:256])"),
    "fused_up_gate_swapped": (2, [(0, FF), (FF, 2 * FF)], "mul(gate_up[0:128], silu(gate_up"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_form_is_matched(form):
    matches, skips = match(form)
    assert not skips, skips
    assert [m.module for m in matches] == ["layers.0.mlp", "layers.1.mlp"]
    n, ranges, activation = EXPECTED[form]
    for m in matches:
        assert len(m.ups) == n and m.gated == (n == 2)
        assert [(u.start, u.stop) for u in m.ups] == ranges
        assert m.activation.startswith(activation), m.activation
        assert m.intermediate == FF
        assert m.down.transposed == (form == "conv1d")
        assert all(u.proj.transposed == (form == "conv1d") for u in m.ups)


@pytest.mark.parametrize("form", list(SKIPPED))
def test_forms_the_ring_cannot_run_are_skipped_with_the_reason(form):
    matches, skips = match(form)
    assert not matches
    assert [s.module for s in skips] == ["layers.0.mlp", "layers.1.mlp"], skips
    assert SKIPPED[form][1] in skips[0].reason, skips[0].reason


def test_the_chain_applied_to_f_slices_is_the_chain():
    """The extracted chain, called on two halves of F, gives the two halves of the model's
    activation (leading-dims reshapes dropped: the ring works on [tokens, F])."""
    from tests.mlp_forms import new_gelu
    from tspc.passes.match_mlp import chain_module

    (m, _), _ = match("conv1d")
    chain = chain_module(m)
    a = torch.randn(10, FF)
    halves = [chain(a[:, : FF // 2]), chain(a[:, FF // 2 :])]
    torch.testing.assert_close(torch.cat(halves, -1), new_gelu(a))


def test_more_ranks_than_the_intermediate_size_is_an_error():
    from tspc.runtime.errors import TSPConfigError

    with pytest.raises(TSPConfigError, match="more than its intermediate size"):
        match("plain_gelu", world=2 * FF, attention=False)


def test_an_intermediate_size_not_divisible_by_d_is_skipped():
    _, skips = match("plain_gelu", world=3)
    assert skips and "not divisible by D=3" in skips[0].reason


# ------------------------------------------------------------------------- real processes

RUN_FORMS = ["plain_gelu", "relu2", "conv1d", "gated_swapped", "fused_up_gate_swapped"]


def forms_worker(rank: int, world: int, forms: list[str]) -> list[dict]:
    import tspc
    from tspc.runtime.counters import COUNTER
    from tspc.runtime.tsp_params import tsp_param_of

    out = []
    for form in forms:
        torch.compiler.reset()
        ref, model = model_with(form), model_with(form)
        ids = torch.randint(0, 256, (2, 4 * world), generator=torch.Generator().manual_seed(3))
        probe = torch.randn(2, 4 * world, 256, generator=torch.Generator().manual_seed(4))
        expected = ref(ids)
        (expected * probe).sum().backward()
        COUNTER.reset()
        compiled = torch.compile(model, backend="tsp")  # kept: its TSP parameters live with it
        got = compiled(ids)
        measured = {
            t: sum(k["recv_bytes"] for k in v.values())
            for t, v in COUNTER.snapshot()["by_tag"].items()
        }
        (got * probe).sum().backward()
        rep = tspc.last_report()
        err, owned = grad_error(ref, model)
        placements = {
            n: str(p.placements[0])
            for n, p in model.named_parameters()
            if ".mlp." in n and (tp := tsp_param_of(p)) is not None and tp.sharded
        }
        mlp = [e for e in rep.entries if e.kind == "mlp"]
        out.append(
            {
                "form": form,
                "out_err": ((got - expected).abs().max() / expected.abs().max()).item(),
                "grad_err": err,
                "mlp": [(e.module, e.status, e.reason) for e in mlp],
                "predicted": {e.module: rep.predicted_recv_bytes[e.module] for e in mlp},
                "measured": {e.module: measured.get(e.module) for e in mlp},
                "placements": placements,
                "owned": {n: s for n, s in owned.items() if ".mlp." in n},
            }
        )
    return out


def _p_mlp(form: str) -> int:
    """Elements of one MLP's weights and up biases (the ring moves the up biases too)."""
    model = model_with(form, num_layers=1)
    mlp = model.layers[0].mlp
    total = sum(p.numel() for p in mlp.parameters())
    down_bias = [p for n, p in mlp.named_parameters() if n in ("down.bias", "c_proj.bias")]
    return total - sum(p.numel() for p in down_bias)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_forms_match_one_process(world):
    # D = 4 runs the two forms whose slices are laid out differently (Conv1D's transposed
    # weights, a fused up/gate in swapped order): the suite's time is bounded
    forms = RUN_FORMS if world == 2 else ["conv1d", "fused_up_gate_swapped"]
    for per_rank in spawn(forms_worker, world, forms, timeout=900):
        for r in per_rank:
            form = r["form"]
            assert all(s == "matched" for _, s, _ in r["mlp"]) and len(r["mlp"]) == 2, r
            assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r
            # forward bytes = (D-1)/D * beta * P_mlp, beta = 4 (fp32)
            p_mlp = _p_mlp(form)
            for module in ("layers.0.mlp", "layers.1.mlp"):
                assert r["predicted"][module] == (world - 1) * 4 * p_mlp // world, r
                assert r["measured"][module] == r["predicted"][module], r
            want = {
                "conv1d": {"c_fc.weight": "S(1)", "c_fc.bias": "S(0)", "c_proj.weight": "S(0)"},
                "plain_gelu": {"up.weight": "S(0)", "up.bias": "S(0)", "down.weight": "S(1)"},
                "fused_up_gate_swapped": {"gate_up.weight": "_S(0, 2)"},
            }.get(form, {})
            for name, placement in want.items():
                assert r["placements"][f"layers.0.mlp.{name}"] == placement, r["placements"]


def test_a_transformers_mixtral_block_goes_to_expert_parallelism_not_the_ring():
    """Experts stacked in 3-D parameters, applied by grouped matmuls over routed tokens, and a
    top-k router: the ring's matcher alone reports one MoE block (never a ring MLP, never a
    crash); ``match_moe`` matches its experts for expert parallelism, and then the ring's
    matcher leaves the block to it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tspc.passes.analyse import analyse
    from tspc.passes.match_mlp import match_mlp
    from tspc.passes.match_moe import match_moe

    cfg = AutoConfig.for_model(
        "mixtral", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    gm, inputs = capture(model, input_ids=torch.randint(1, 128, (2, 16)))
    info = analyse(gm, inputs)
    matches, skips = match_mlp(gm, info, 2)
    assert not matches
    assert [s.module for s in skips] == ["model.layers.0.mlp"], skips
    assert "mixture of experts" in skips[0].reason and "experts.gate_up_proj" in skips[0].reason
    assert "router model.layers.0.mlp.gate.weight" in skips[0].reason, skips[0].reason
    moe, moe_skips = match_moe(gm, info, 2)
    assert [m.module for m in moe] == ["model.layers.0.mlp"] and not moe_skips, moe_skips
    m = moe[0]
    assert (m.experts, m.top_k, m.hidden, m.intermediate, m.orient) == (4, 2, 64, 128, "tt")
    assert [info.params[p].fqn.rsplit(".", 1)[1] for p in (m.w1, m.w2)] == [
        "gate_up_proj",
        "down_proj",
    ]
    assert match_mlp(gm, info, 2, moe_blocks={m.module: None}) == ([], [])
    # 4 experts on 3 ranks in torch.chunk's chunks of 2: rank 2 would own none -> held whole,
    # with the D values that fit
    none3, skips3 = match_moe(gm, info, 3)
    assert not none3 and "a rank would own none" in skips3[0].reason, skips3
    assert "1, 2, 4" in skips3[0].fix, skips3[0].fix


def test_a_compiled_models_activation_chains_die_with_it():
    """The rings' activation chains are held by the compiled graph that calls them (its
    ``RuntimeContext``), not by the process: once the compiled model, Dynamo's cache of it and
    the backend's history of recent compiles are gone, no chain of it is registered."""
    import gc
    import weakref

    from tspc.backend import COMPILED
    from tspc.runtime import ring_mlp

    torch.compiler.reset()
    before = set(ring_mlp._CHAINS)
    ref, model = model_with("new_gelu"), model_with("new_gelu")
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(model, backend="tsp")
    torch.testing.assert_close(compiled(ids), ref(ids))  # the ring ran the chain, and right
    new = set(ring_mlp._CHAINS) - before
    assert new, "the compile registered no chain: nothing to check"
    chains = [weakref.ref(ring_mlp._CHAINS[k]) for k in new]
    del compiled, model
    torch.compiler.reset()
    COMPILED.clear()
    gc.collect()
    assert all(c() is None for c in chains)
    assert not set(ring_mlp._CHAINS) - before
