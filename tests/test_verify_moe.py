"""The MoE matcher proves each grouped-experts match by running it (``passes/verify_moe.py``).

Graph-only (Dynamo's graph of small transformers MoE models, no process group):

* every family's block (top-2, and top-1 where the scaled pairs are already ``[N, h]``) runs on
  random values and equals its collapse's dense definition — the check runs, it is not skipped;
* the reading that was once wrong (top-1: the first ``[N, h]`` node taken for the combined
  output, leaving the model's un-permutation after tspc's) is caught: with the old rule put
  back, the block is skipped with the check's reason instead of matched;
* a block above the budget is not run, and says so.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import HF_SMALL, capture

FAMILIES = {
    "mixtral": {"num_local_experts": 4, "intermediate_size": 32},
    "qwen2_moe": {
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "olmoe": {"num_experts": 4, "intermediate_size": 32},
    "granitemoe": {"num_local_experts": 4, "intermediate_size": 32},
}


def _graph(family: str, top_k: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tspc.passes.analyse import analyse

    cfg = AutoConfig.for_model(
        family,
        **{**HF_SMALL, **FAMILIES[family], "num_hidden_layers": 1, "num_experts_per_tok": top_k},
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    gm, inputs = capture(model, input_ids=torch.randint(1, 128, (2, 16)))
    return gm, analyse(gm, inputs)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_match_equals_its_collapse_on_random_values(family, top_k):
    from tspc.passes.match_moe import match_moe, moe_chain_module
    from tspc.passes.verify_moe import check_collapse

    gm, info = _graph(family, top_k)
    matches, skips = match_moe(gm, info, 2)
    assert len(matches) == 1 and not skips, skips
    assert check_collapse(matches[0], moe_chain_module(matches[0])) is None  # it ran


def test_the_old_top_1_reading_is_caught(monkeypatch):
    """Put back the rule that took the first [N, h] node after the experts for the output."""
    import tspc.passes.match_moe as match_moe_mod
    from tspc.passes.graph_utils import first_reached, shape

    def first_node(mm2, n_tok, hidden):
        return first_reached(mm2, match_moe_mod._COMBINE, lambda u: shape(u) == (n_tok, hidden))

    monkeypatch.setattr(match_moe_mod, "_combined_output", first_node)
    gm, info = _graph("olmoe", 1)
    matches, skips = match_moe_mod.match_moe(gm, info, 2)
    assert not matches
    assert "the block and its collapse onto the expert-parallel op differ" in skips[0].reason
    # top-2 reads the same with either rule, and still matches
    gm, info = _graph("olmoe", 2)
    assert len(match_moe_mod.match_moe(gm, info, 2)[0]) == 1


def test_a_block_above_the_budget_is_not_run(monkeypatch):
    import tspc.passes.verify_moe as verify
    from tspc.passes.match_moe import match_moe, moe_chain_module

    gm, info = _graph("mixtral", 2)
    (m,), _ = match_moe(gm, info, 2)
    monkeypatch.setattr(verify, "BUDGET", 10)
    assert "not run: stacked weights above 10 elements" in verify.check_collapse(
        m, moe_chain_module(m)
    )


def test_a_convolution_weight_is_no_stack_of_experts():
    """A depthwise ``Conv1d`` weight is 3-D (``[C, 1, K]``) but no matmul applies it: no MoE
    block (Mamba's and linear attention's short convolutions were listed as "mixture of
    experts: 1 stacked parameters")."""
    from tspc.passes.analyse import analyse
    from tspc.passes.match_moe import match_moe

    class ShortConv(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = torch.nn.Conv1d(16, 16, 4, groups=16, padding=3)
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x):
            return self.proj(self.conv1d(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2))

    gm, inputs = capture(ShortConv(), torch.randn(2, 8, 16))
    assert match_moe(gm, analyse(gm, inputs), 2) == ([], [])
