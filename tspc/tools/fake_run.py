"""Running the reference model as rank r of D on fake tensors and torch's ``fake`` process group.

What ``tspc plan --measure`` (:mod:`tspc.tools.measure`) and the time model
(:mod:`tspc.tools.timemodel`) share: the model a measurement runs (the reference Llama-style
model of a planner ``ModelShape`` with its loss), the fake process group, the default dtype, the
warm-up and measured steps, and which parameters the backend sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------
# The model a measurement runs
# --------------------------------------------------------------------------------------------


class LossModel(nn.Module):
    """``model(ids) -> logits`` plus the token-level cross-entropy, as one compiled module.

    Compiling the loss with the model is what a long-context user does: tspc then computes the
    loss of each rank's own tokens and all-reduces one number, instead of gathering the
    ``[B, S, vocab]`` logits on every rank. The targets are given already shifted.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ref_config_from_shape(shape: Any, layers: int | None = None) -> Any:
    """The reference model's config for a planner ``ModelShape`` (optionally fewer layers); for
    a MoE shape the transformers config of its family (``tools/fake_moe.py``)."""
    from tspc.samples.reference_model import RefConfig

    if getattr(shape, "is_moe", False):
        from tspc.tools.fake_moe import hf_moe_config

        return hf_moe_config(shape, layers)

    if shape.head_dim is not None and shape.head_dim != shape.hidden // shape.heads:
        raise ValueError(
            f"the reference model derives head_dim = hidden / heads; this model has head_dim "
            f"{shape.head_dim} != {shape.hidden} / {shape.heads}"
        )
    return RefConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_layers=shape.layers if layers is None else layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        tie_embeddings=shape.tied_embeddings,
        mask="causal",
    )


def model_of_config(config: Any) -> nn.Module:
    """The model a measurement runs for ``config``: the reference model of a ``RefConfig``, the
    transformers causal LM (returning logits) of a transformers MoE config."""
    from tspc.tools.fake_moe import build_moe_model, is_hf_config

    if is_hf_config(config):
        return build_moe_model(config)
    from tspc.samples.reference_model import RefModel

    return RefModel(config)


def reference_model(shape: Any, layers: int | None = None, seed: int = 0) -> nn.Module:
    """The reference model of a planner ``ModelShape``, with the deterministic random weights
    of ``build_reference_model(seed)`` (the same on every rank)."""
    from tspc.samples.reference_model import build_reference_model

    return build_reference_model(seed, **asdict(ref_config_from_shape(shape, layers)))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local tensor of a DTensor (what this rank holds), else ``t``."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def shards_of(model: nn.Module) -> list[torch.Tensor]:
    """The local tensors of ``model``'s sharded DTensor parameters (empty when nothing is
    sharded)."""
    return [_local(p) for p in model.parameters() if is_matched_param(p)]


@contextlib.contextmanager
def _fake_group(rank: int, world: int) -> Iterator[None]:
    """Rank ``rank`` of ``world`` on torch's ``fake`` process-group backend, for the duration."""
    import torch.distributed as dist

    from tspc.runtime.compat import fake_process_group_store

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"tspc measure runs on the 'fake' process group, but a '{backend}' process "
                "group is already initialised in this process"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", store=fake_process_group_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _keep_fake_parameter_class() -> Iterator[None]:
    """TEMPORARY, until ``runtime/release.py`` leaves fake parameters' class alone.

    The backend's weight release frees each full weight's storage (``resize_(0)``) and, as a
    guard against reading freed memory, turns the parameter into a ``ReleasedParameter``. A
    ``FakeTensor`` whose class is changed can no longer dispatch (Dynamo's recompile then fails
    with "dispatch_on_subclass called with NO overloaded args"). Fake tensors have no data to
    protect and the guard has no memory effect, so here the class swap is a no-op (the
    parameter keeps its class); the storage release itself runs unchanged and is measured.
    """
    from unittest import mock

    from tspc.runtime import release
    from tspc.runtime.compat import FakeTensor

    if not hasattr(release, "ReleasedParameter"):
        yield
        return
    with mock.patch.object(release, "ReleasedParameter", FakeTensor):
        yield


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def warm_up(
    step: Callable, ids: Any, targets: Any, mode: str, steps: int, make_optimizer: Callable
) -> torch.optim.Optimizer | None:
    """``steps`` calls of ``step(ids, targets)`` as the measured one runs them (``mode``: "train"
    or "forward"). In training the optimizer is made after the first call, when the shards
    exist, and each step runs it (the first creates its moments). Returns the optimizer."""
    optimizer = None
    for _ in range(steps):
        if mode == "train":
            step(ids, targets).backward()
            if optimizer is None:
                optimizer = make_optimizer()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                step(ids, targets)
    return optimizer


def measured_step(
    step: Callable, ids: Any, targets: Any, mode: str, optimizer: torch.optim.Optimizer | None
) -> torch.Tensor:
    """The measured step: the forward, and in training its backward and the optimizer step."""
    if mode != "train":
        with torch.no_grad():
            return step(ids, targets)
    loss = step(ids, targets)
    loss.backward()
    optimizer.step()
    return loss


def is_matched_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is the DTensor parameter of a weight the backend sharded (this rank may
    hold no slice of it)."""
    from tspc.runtime.tsp_params import tsp_param_of

    tp = tsp_param_of(p)
    return tp is not None and tp.sharded
