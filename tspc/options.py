"""The backend's options, as passed through ``torch.compile(..., options={...})``."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any


class OptionError(ValueError):
    pass


_CHOICES = {
    "inputs": ("replicated",),
    "outputs": ("gathered", "sharded"),
    "inner": ("eager", "aot_eager", "inductor"),
    "schedules": ("tsp", "sp", "none"),
    "recompute": ("none", "selective", "full"),
    "data_parallel": ("replicate", "fsdp", "hsdp"),
    "decode_layout": ("sequence", "heads"),
}


@dataclass(frozen=True)
class TSPOptions:
    """Options of the ``tsp`` backend.

    group: None (the default world group), a ``ProcessGroup``, or a ``DeviceMesh`` (then also
        ``mesh_dim``) — the ranks of the TSP axis.
    mesh_dim: the mesh dimension (name or index) of the TSP axis when ``group`` is a mesh.
    data_parallel: what the other axis of a 2-D ``group`` mesh does: "replicate" (default:
        every dp rank holds the TSP axis's parameters and optimizer state, gradients are
        all-reduced in buckets, ``runtime/data_parallel.py``) or "fsdp" (parameters,
        gradients and optimizer state also split over dp: 2-D DTensors, gathered per call,
        gradients reduce-scattered; ``runtime/dp_shard.py``, docs/cluster.md) or "hsdp" (a 3-D
        (replicate, shard, tsp) mesh: split over shard, gradients also averaged over
        replicate).
    inputs: "replicated" — every rank passes the full batch; the graph takes its zigzag part.
    outputs: "gathered" (results equal one device) or "sharded" (each rank keeps its zigzag
        tokens; see ``tspc.zigzag_unshard``) — for long context, where gathering logits would
        undo the memory saving.
    overlap: schedule transfers ahead of the compute that hides them (True) or leave each
        transfer next to its use (False; for measuring what overlap buys).
    inner: compiler for the local compute: "inductor" (default: Inductor's kernels for the
        compute between transfers), "aot_eager" (the same aot_autograd graphs run op by op:
        compiles in a fraction of Inductor's time; the tests use it), or "eager" (debugging:
        no aot_autograd, so backward keeps weights alive instead of re-streaming). The
        environment variable TSPC_INNER sets the default for options that do not name one.
    strict: raise instead of falling back when a pass cannot handle part of the model.
    dump_dir: write the graphs after each pass and a report there (also TSPC_DUMP_DIR).
    schedules: "tsp" (default); "sp" shards only the sequence (weights replicated, K/V
        all-gathered) — the sequence-parallel baseline; "none" runs the graph replicated.
    comm_timeout: seconds a collective may take before the run fails with an error naming it
        (also TSPC_COMM_TIMEOUT); None waits as long as the process group does.
    check_inputs: "shapes" (default): at a communicating graph's first call and whenever a
        rank's input shapes change, check that all ranks passed inputs of the same shapes and
        dtypes (one small all-gather); True: also compare a checksum of the inputs' values,
        every call; False: no input check. A difference raises ``tspc.InputMismatchError``
        naming the input and the ranks on every rank, before any transfer
        (``runtime/rank_check.py``).
    sync_module_states: at the first call, broadcast the parameters and buffers that differ
        from the TSP group's rank 0 instead of raising ``tspc.ModuleStateMismatchError`` (every
        rank's module states are checked there, before any weight is sharded).
    recompute: activation recomputation inside the schedules (``passes/recompute.py``):
        "none" (default: aot_autograd's partitioner chooses what to save), "full" (every
        transformer block recomputed from its input in the backward: weights re-streamed, K/V
        re-gathered; only each block's input shard is kept), "selective" (each layer's attention
        recomputed, the MLP's activations kept). Needs an aot inner compiler.
    loss_chunk: tokens per chunk of the language-model head + cross-entropy
        (``passes/chunk_loss.py``: no tokens x vocab tensor saved for the backward); None
        (default) picks about 8M logits a chunk, 0 leaves the loss as traced.
    dynamic_seq: a graph Dynamo traced with a symbolic sequence length is compiled once for
        every length that is a multiple of 2D (``tspc/length_family.py``): a new length runs
        the compiled program, with no pass and no inner compile (default). Off: each new
        length is one compile of the passes and the inner compiler.
    ring_chunks: the MLP ring's hops in this many sub-shard chunks (``ring_mlp(...,
        hop_chunks=)``): about one shard and one chunk of weights (and, in backward, of
        gradient accumulators) in flight instead of two shards, for the same bytes in more
        hops. None (default): 8 for the rings of recomputed blocks (``recompute``, or a
        user's checkpoint), where the ring's buffers are what is left at the peak, else 1.
    prefill_buckets: ``generate()``'s prompt padded on the right to a multiple of 2D and its
        batch to a power of two, with dynamic sequence dims (``tspc/prefill_buckets.py``), so
        prompts of any length and batch reuse a few compiled programs (default). Off: each
        prompt runs at its own shape.
    decode_layout: how ``generate()``'s decode steps hold the K/V cache (``tspc/generate.py``):
        "sequence" (default): each rank keeps its own tokens of every head and attention merges
        the ranks' partial results (an all-gather and an all-to-all per layer); "heads": at the
        first decode step each layer's cache is exchanged once (an all-to-all) so each rank
        keeps every token of its head group, and attention runs on the rank with no
        collective, as tensor parallelism decodes (2 all-reduces per layer in all). Both keep
        1/D of the cache per rank; a layer that cannot (K/V heads fewer than D, a sliding
        window, outputs gathered) stays "sequence".
    """

    group: Any = None
    mesh_dim: str | int | None = None
    data_parallel: str = "replicate"
    inputs: str = "replicated"
    outputs: str = "gathered"
    overlap: bool = True
    inner: str = "inductor"
    strict: bool = False
    dump_dir: str | None = None
    schedules: str = "tsp"
    comm_timeout: float | None = None
    check_inputs: bool | str = "shapes"
    sync_module_states: bool = False
    recompute: str = "none"
    loss_chunk: int | None = None
    dynamic_seq: bool = True
    ring_chunks: int | None = None
    prefill_buckets: bool = True
    decode_layout: str = "sequence"

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> TSPOptions:
        options = dict(options or {})
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise OptionError(f"unknown tsp backend option(s) {unknown}; known options: {known}")
        if "inner" not in options and os.environ.get("TSPC_INNER"):
            if os.environ["TSPC_INNER"] not in _CHOICES["inner"]:
                raise OptionError(
                    f"TSPC_INNER={os.environ['TSPC_INNER']!r} is not one of {list(_CHOICES['inner'])}"
                )
            options["inner"] = os.environ["TSPC_INNER"]
        for name, choices in _CHOICES.items():
            if name in options and options[name] not in choices:
                raise OptionError(f"option {name}={options[name]!r} is not one of {list(choices)}")
        if "check_inputs" in options and not (
            isinstance(options["check_inputs"], bool) or options["check_inputs"] == "shapes"
        ):
            raise OptionError(
                "option check_inputs must be 'shapes' (the default), True (also the values, "
                f"every call) or False, got {options['check_inputs']!r}"
            )
        for name in ("overlap", "strict", "sync_module_states", "dynamic_seq", "prefill_buckets"):
            if name in options and not isinstance(options[name], bool):
                raise OptionError(f"option {name} must be True or False, got {options[name]!r}")
        if options.get("recompute", "none") != "none" and options.get("inner") == "eager":
            raise OptionError(
                "option recompute needs aot_autograd's partitioner: use inner='aot_eager' or "
                "'inductor' (inner='eager' records the graph op by op and cannot recompute)"
            )
        c = options.get("loss_chunk")
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 0):
            raise OptionError(f"option loss_chunk must be a number of tokens >= 0, got {c!r}")
        c = options.get("ring_chunks")
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
            raise OptionError(f"option ring_chunks must be a number of chunks >= 1, got {c!r}")
        if options.get("dump_dir") is None and os.environ.get("TSPC_DUMP_DIR"):
            options["dump_dir"] = os.environ["TSPC_DUMP_DIR"]
        t = options.get("comm_timeout")
        if t is not None and (not isinstance(t, (int, float)) or t <= 0):
            raise OptionError(
                f"option comm_timeout must be a positive number of seconds, got {t!r}"
            )
        return cls(**options)
