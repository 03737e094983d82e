"""Small random-weight models from libraries other than transformers (issue 26's peer zoo).

Each builder makes a model of ``layers`` decoder layers (2 by default) (width 64, 4 heads, 2 KV heads where the library has GQA,
vocabulary 128) from the library's own model code, and returns a module that maps token ids
``[B, S]`` to logits. The libraries are a test extra installed into ``.peers/`` (see
``requirements-peers.txt`` and ``docs/models.md``): ``with_peers()`` puts that folder on
``sys.path``; it is not on the path of the rest of the suite, so the extra's packages (triton,
which torchtitan imports, among them) change nothing for other tests.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers")
VOCAB, DIM, HEADS, KV_HEADS, HIDDEN, LAYERS = 128, 64, 4, 2, 128, 2


def with_peers() -> None:
    """Put the peer libraries' folder on ``sys.path`` (first, so its pins win)."""
    if os.path.isdir(PEERS) and PEERS not in sys.path:
        sys.path.insert(0, PEERS)
        importlib.invalidate_caches()


def version(dist: str) -> str:
    with_peers()
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _titan_layers(builder: Callable, **kw) -> list:
    """torchtitan's own layer builder, with SDPA (causal, GQA by ``enable_gqa``) as the inner
    attention: its language-model configs only name FlexAttention and varlen backends, whose
    masks are built outside the model; the SDPA module is the library's own."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = builder(attn_backend="flex", **kw)
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def titan_llama3(layers: int = LAYERS) -> nn.Module:
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _titan_layers(
        _build_llama3_layers,
        fuse_qkv=True,
        n_layers=layers,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=HIDDEN,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=256, theta=500000),
    )
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
    ).build()


def titan_qwen3(layers: int = LAYERS) -> nn.Module:
    from torchtitan.models.common import Embedding, Linear
    from torchtitan.models.common.rope import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _qwen3_norm

    head_dim = 16
    layers = _titan_layers(
        _build_qwen3_layers,
        fuse_qkv=True,
        n_layers=layers,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=head_dim,
        hidden_dim=HIDDEN,
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=256, theta=1000000.0),
    )
    return Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=layers,
    ).build()


# the arguments torchtune's model builders share
_TUNE = dict(vocab_size=VOCAB, num_heads=HEADS, embed_dim=DIM, max_seq_len=256)


def tune_llama3(layers: int = LAYERS) -> nn.Module:
    from torchtune.models.llama3 import llama3

    return llama3(**_TUNE, num_layers=layers, num_kv_heads=KV_HEADS, intermediate_dim=HIDDEN)


def tune_qwen2(layers: int = LAYERS) -> nn.Module:
    from torchtune.models.qwen2 import qwen2

    return qwen2(**_TUNE, num_layers=layers, num_kv_heads=KV_HEADS, intermediate_dim=HIDDEN)


def tune_gemma(layers: int = LAYERS, kv_heads: int = KV_HEADS) -> nn.Module:
    from torchtune.models.gemma import gemma

    return gemma(
        **_TUNE,
        num_layers=layers,
        head_dim=DIM // HEADS,
        num_kv_heads=kv_heads,
        intermediate_dim=HIDDEN,
    )


def tune_gemma_mqa(layers: int = LAYERS) -> nn.Module:
    return tune_gemma(layers, kv_heads=1)  # Gemma-2B's multi-query attention


def _litgpt_model():
    """litgpt's ``model.py`` and ``config.py``, loaded without the package's ``__init__``: it
    imports the training stack (lightning, its loggers and strategies), which building a
    model never uses and the test extra does not install. ``model.py``'s one import from the
    checkpoint converter (``qkv_reassemble``, for loading Hugging Face weights) is stubbed."""
    import importlib.util
    import types

    if "litgpt.model" in sys.modules:
        return sys.modules["litgpt.model"]
    spec = importlib.util.find_spec("litgpt")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("litgpt is not installed (requirements-peers.txt)")
    root = list(spec.submodule_search_locations)[0]
    pkg = types.ModuleType("litgpt")
    pkg.__path__ = [root]
    scripts = types.ModuleType("litgpt.scripts")
    scripts.__path__ = [os.path.join(root, "scripts")]
    convert = types.ModuleType("litgpt.scripts.convert_hf_checkpoint")

    def qkv_reassemble(*args, **kwargs):
        raise NotImplementedError("stubbed: the peer zoo loads no Hugging Face checkpoint")

    convert.qkv_reassemble = qkv_reassemble
    sys.modules.update({"litgpt": pkg, "litgpt.scripts": scripts, convert.__name__: convert})
    for name in ("config", "model"):
        mspec = importlib.util.spec_from_file_location(
            f"litgpt.{name}", os.path.join(root, f"{name}.py")
        )
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mspec.name] = module
        mspec.loader.exec_module(module)
        setattr(pkg, name, module)  # config.py resolves its class names on ``litgpt.model``
    return sys.modules["litgpt.model"]


def _litgpt(layers: int, **kw) -> nn.Module:
    model = _litgpt_model()
    from litgpt.config import Config

    base = dict(block_size=256, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=layers)
    return model.GPT(Config(**base, n_head=HEADS, n_embd=DIM, **kw))


def litgpt_llama(layers: int = LAYERS) -> nn.Module:
    return _litgpt(
        layers,
        n_query_groups=KV_HEADS,
        bias=False,
        parallel_residual=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=HIDDEN,
    )


def litgpt_pythia(layers: int = LAYERS) -> nn.Module:
    # Pythia / GPT-NeoX as litgpt writes it: parallel residual, LayerNorm, biases, a GELU MLP,
    # RoPE on a quarter of each head
    return _litgpt(
        layers,
        n_query_groups=HEADS,
        bias=True,
        rotary_percentage=0.25,
        parallel_residual=True,
        mlp_class_name="GptNeoxMLP",
        intermediate_size=4 * DIM,
    )


class _LogitsOnly(nn.Module):
    """x-transformers' wrapper returns the logits; this keeps the zoo's ``model(ids)`` contract
    and names the layers' container for the judge's count."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def _x_transformers(layers: int, **kw) -> nn.Module:
    from loguru import logger
    from x_transformers import Decoder, TransformerWrapper

    logger.disable("x_transformers")  # its advice on rotary sizes for real training runs

    decoder = Decoder(dim=DIM, depth=layers, heads=HEADS, attn_dim_head=DIM // HEADS, **kw)
    return _LogitsOnly(TransformerWrapper(num_tokens=VOCAB, max_seq_len=256, attn_layers=decoder))


def x_transformers_glu(layers: int = LAYERS) -> nn.Module:
    # einsum/einops attention (``Attend``), rotary embeddings, a GLU feed-forward whose fused
    # projection sits one module below the down projection (``Sequential(GLU, ..., Linear)``),
    # RMSNorm and q/k l2-norm written with ``F.normalize``
    return _x_transformers(
        layers, rotary_pos_emb=True, ff_glu=True, use_rmsnorm=True, attn_qk_norm=True
    )


def x_transformers_gqa(layers: int = LAYERS) -> nn.Module:
    return _x_transformers(layers, rotary_pos_emb=True, attn_kv_heads=KV_HEADS)


def x_transformers_mqa(layers: int = LAYERS) -> nn.Module:
    # one KV head, scored with ``einsum('b h i d, b j d -> b h i j')`` (keys without heads)
    return _x_transformers(layers, rotary_pos_emb=True, attn_kv_heads=1)


def einsum_decoder(layers: int = LAYERS) -> nn.Module:
    from tests.einsum_model import EinsumDecoder

    return EinsumDecoder(VOCAB, DIM, HEADS, HIDDEN, layers)


# name -> (builder, the distribution whose version the table names, what it exercises)
PEER_MODELS: dict[str, tuple[Callable[[], nn.Module], str, str]] = {
    "torchtitan llama3": (titan_llama3, "torchtitan", "fused wqkv with GQA, complex RoPE"),
    "torchtitan qwen3": (titan_qwen3, "torchtitan", "fused wqkv with GQA, q/k RMSNorm, tied"),
    "torchtune llama3": (tune_llama3, "torchtune", "GQA by view + expand + reshape"),
    "torchtune qwen2": (tune_qwen2, "torchtune", "GQA by view + expand, q/k/v biases"),
    "torchtune gemma": (tune_gemma, "torchtune", "GELU-tanh GLU, scaled embedding"),
    "torchtune gemma mqa": (tune_gemma_mqa, "torchtune", "multi-query attention (one KV head)"),
    "einsum decoder": (einsum_decoder, "tspc", "einsum attention and an einsum GLU, chunked"),
    "litgpt llama": (litgpt_llama, "litgpt", "fused qkv [Q..; K..; V..] with GQA, LLaMAMLP"),
    "litgpt pythia": (litgpt_pythia, "litgpt", "parallel residual, partial RoPE, GELU MLP"),
    "x-transformers glu": (
        x_transformers_glu,
        "x-transformers",
        "einops attention, q/k l2-norm, F.normalize RMSNorm, nested GLU",
    ),
    "x-transformers gqa": (x_transformers_gqa, "x-transformers", "GQA by einops repeat"),
    "x-transformers mqa": (x_transformers_mqa, "x-transformers", "multi-query einsum"),
}


def build(name: str, seed: int = 0, layers: int = LAYERS) -> nn.Module:
    """The model ``name`` with ``layers`` decoder layers and deterministic random weights: every
    matrix N(0, 0.05), every vector 1 + N(0, 0.1) (norm scales), the embedding N(0, 1)."""
    with_peers()
    model = PEER_MODELS[name][0](layers)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = 1.0 if "embed" in pname else 0.05
                p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.float()
