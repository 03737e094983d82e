"""MLP forms for the tests: the reference model with each layer's MLP replaced by one of these."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

H, FF = 64, 128  # hidden size (the reference model's) and intermediate size


def new_gelu(a: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written out as elementwise ops (as transformers' NewGELU does)."""
    return (
        0.5 * a * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (a + 0.044715 * torch.pow(a, 3.0))))
    )


ACTS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "relu2": lambda a: F.relu(a) ** 2,
    "square_relu": lambda a: torch.square(F.relu(a)),
    "new_gelu": new_gelu,
    # several elementwise ops: an activation, a scale and dropout in eval (the identity)
    "scaled_silu": lambda a: F.dropout(F.silu(a) * 0.5, 0.1, training=False),
}


class PlainMLP(nn.Module):
    """``down(act(up(x)))``, GPT-NeoX style."""

    def __init__(self, act: str = "gelu", bias: bool = True):
        super().__init__()
        self.act = act
        self.up = nn.Linear(H, FF, bias=bias)
        self.down = nn.Linear(FF, H, bias=bias)

    def forward(self, x):
        return self.down(ACTS[self.act](self.up(x)))


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a weight stored ``[in, out]``, applied as ``addmm`` on 2-D tokens."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class Conv1DMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = Conv1D(FF, H)
        self.c_proj = Conv1D(H, FF)

    def forward(self, x):
        return self.c_proj(new_gelu(self.c_fc(x)))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``swapped`` writes the product the other way round;
    ``fused`` computes gate and up by one projection (``"gate_up"`` or ``"up_gate"`` order)."""

    def __init__(self, swapped: bool = False, fused: str = "", bias: bool = False):
        super().__init__()
        self.swapped, self.fused = swapped, fused
        if fused:
            self.gate_up = nn.Linear(H, 2 * FF, bias=bias)
        else:
            self.gate = nn.Linear(H, FF, bias=bias)
            self.up = nn.Linear(H, FF, bias=bias)
        self.down = nn.Linear(FF, H, bias=bias)

    def forward(self, x):
        if self.fused == "gate_up":
            g, u = self.gate_up(x).chunk(2, dim=-1)
        elif self.fused == "up_gate":
            u, g = self.gate_up(x).chunk(2, dim=-1)
        else:
            g, u = self.gate(x), self.up(x)
        h = u * F.silu(g) if self.swapped else F.silu(g) * u
        return self.down(h)


# ---------------------------------------------------------------- forms the ring must not run


class CumsumMLP(PlainMLP):
    def forward(self, x):
        return self.down(torch.cumsum(F.gelu(self.up(x)), dim=-1))


class TrainDropoutMLP(PlainMLP):
    def forward(self, x):
        return self.down(F.dropout(F.gelu(self.up(x)), 0.1, training=True))


class ScaledByParamMLP(PlainMLP):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(FF))

    def forward(self, x):
        return self.down(F.gelu(self.up(x)) * self.scale)


class LeakyMLP(PlainMLP):
    """The activation is also read by something else than the down projection."""

    def forward(self, x):
        h = F.gelu(self.up(x))
        return self.down(h) + h.mean(-1, keepdim=True)


class InPlaceMLP(PlainMLP):
    def forward(self, x):
        return self.down(F.relu(self.up(x), inplace=True))


class StackedMoE(nn.Module):
    """A router and experts stacked in 3-D parameters, evaluated densely and weighted."""

    def __init__(self, experts: int = 4):
        super().__init__()
        self.router = nn.Linear(H, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, FF, H) * 0.1)
        self.w_out = nn.Parameter(torch.randn(experts, H, FF) * 0.1)

    def forward(self, x):
        weights, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        h = F.silu(torch.einsum("bsh,efh->bsef", x, self.w_in))
        y = torch.einsum("bsef,ehf->bseh", h, self.w_out)
        gate = torch.zeros(*x.shape[:-1], self.w_in.shape[0]).scatter(-1, idx, weights)
        return (y * gate[..., None]).sum(-2)


class LoopMoE(nn.Module):
    """A router and a list of gated-MLP experts (each a dense MLP of its own), weighted."""

    def __init__(self, experts: int = 2):
        super().__init__()
        self.gate = nn.Linear(H, experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP() for _ in range(experts))

    def forward(self, x):
        weights, idx = self.gate(x).softmax(-1).topk(1, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + expert(x) * (weights * (idx == e)).sum(-1, keepdim=True)
        return out


FORMS = {
    "plain_gelu": lambda: PlainMLP("gelu"),
    "plain_gelu_tanh": lambda: PlainMLP("gelu_tanh", bias=False),
    "relu2": lambda: PlainMLP("relu2"),
    "square_relu": lambda: PlainMLP("square_relu", bias=False),
    "new_gelu": lambda: PlainMLP("new_gelu"),
    "scaled_silu": lambda: PlainMLP("scaled_silu"),
    "conv1d": Conv1DMLP,
    "gated": GatedMLP,
    "gated_swapped": lambda: GatedMLP(swapped=True, bias=True),
    "fused_gate_up": lambda: GatedMLP(fused="gate_up"),
    "fused_up_gate_swapped": lambda: GatedMLP(swapped=True, fused="up_gate", bias=True),
}
SKIPPED = {
    "cumsum": (CumsumMLP, "cumsum is not elementwise"),
    "train_dropout": (TrainDropoutMLP, "draws random numbers"),
    "scaled_by_param": (ScaledByParamMLP, "a tensor from outside the MLP"),
    "leaky": (LeakyMLP, "is also used outside the MLP"),
    "in_place": (InPlaceMLP, "works in place"),
    "stacked_moe": (StackedMoE, "mixture of experts: layers.0.mlp.w_out [4, 64, 128] stacks"),
    "loop_moe": (LoopMoE, "mixture of experts: the router layers.0.mlp.gate.weight"),
}


def model_with(form, seed: int = 0, num_layers: int = 2):
    """The reference model (causal SDPA attention) with every layer's MLP replaced by
    ``form`` (a name of FORMS or SKIPPED, or a factory), weights from ``seed``."""
    from samples.reference_model import build_reference_model

    factory = FORMS.get(form) or (SKIPPED[form][0] if form in SKIPPED else form)
    model = build_reference_model(seed=seed, num_layers=num_layers, intermediate_size=FF)
    torch.manual_seed(seed + 1)
    for layer in model.layers:
        layer.mlp = factory()
    return model
