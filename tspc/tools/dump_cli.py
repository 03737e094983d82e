"""`tspc dump`: run the passes for rank r of D in this process and write what they did.

    tspc dump samples/reference_model.py:build_reference_model --world-size 2
    tspc dump llama --world-size 4 --rank all --seq 128
    tspc dump path/to/config.json --world-size 2 --set num_hidden_layers=2

No process group is started: the run uses torch's ``fake`` process-group backend, on which every
collective completes at once and moves nothing, so the compiled graph runs (forward, then a
backward of the outputs' sum) and aot_autograd produces its forward and backward graphs exactly
as on a real rank r of D. The dump lands in ``OUT/rank<r>/graph<id>/`` (``tspc/dump.py``), the
same files a real run writes with ``options={"dump_dir": OUT}``. A short summary is printed.
``--rank all`` dumps every rank in turn and compares the order of their collectives: ranks that
would issue different collectives hang, and the command then says which and exits with 1.

``--device cuda`` traces on fake CUDA tensors (``tspc/tools/fake_cuda.py``: no GPU needed) and adds
``device_check.json`` (``tspc/tools/device_check.py``): every op of the graphs and of the zigzag
attention's forward and backward bodies that has no CUDA kernel (the command then exits with 1),
and the attention kernels chosen. Without a real GPU the autograd engine cannot run on CUDA
tensors, so only the forward graph is traced (as an inference graph); the attention backward
kernels are still checked.

TARGET is one of

* ``FILE.py:FUNC`` or ``package.module:FUNC`` — FUNC returns ``(model, inputs)``, where inputs is
  a tensor, a tuple of positional arguments, a dict of keyword arguments, or ``(args, kwargs)``;
  or returns just a model, which then gets random token ids ``[batch, seq]`` (its vocabulary from
  ``model.config.vocab_size``, ``model.cfg.vocab_size`` or its first ``nn.Embedding``). FUNC
  gets ``seq`` / ``batch`` if it has parameters of those names, and every ``--set KEY=VALUE``.
  ``FILE.py`` alone calls its ``build_model_and_inputs``.
* a transformers config: ``config.json`` (or a folder holding one) at its own sizes, or a
  model type (``llama``, ``mistral``, ``qwen2``, ...) at small sizes; ``--set`` overrides
  config fields. The model is built with random weights (nothing is downloaded), SDPA
  attention and ``use_cache=False`` (a training-shaped forward).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import shutil
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

SMALL_CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}
DEFAULT_FUNCTION = "build_model_and_inputs"
_FORBIDDEN_OPTIONS = ("group", "mesh_dim", "dump_dir")


class DumpError(ValueError):
    """Bad target or arguments: reported on one line, exit status 2."""


@dataclass
class Target:
    model: Any
    args: tuple
    kwargs: dict = field(default_factory=dict)
    what: str = ""


# ---------------------------------------------------------------------------- targets


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assignments(items: list[str], flag: str) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise DumpError(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key] = _parse_value(value)
    return out


def _vocab_size(model) -> int | None:
    import torch.nn as nn

    for attr in ("config", "cfg"):
        v = getattr(getattr(model, attr, None), "vocab_size", None)
        if isinstance(v, int):
            return v
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return emb.num_embeddings if emb is not None else None


def _token_ids(model, batch: int, seq: int, what: str):
    import torch

    vocab = _vocab_size(model)
    if vocab is None:
        raise DumpError(
            f"{what} returned a model without a known vocabulary; return (model, example_inputs)"
        )
    return torch.randint(0, vocab, (batch, seq))


def _normalise(result: Any, batch: int, seq: int, what: str) -> Target:
    import torch

    if isinstance(result, torch.nn.Module):
        return Target(result, (_token_ids(result, batch, seq, what),), {}, what)
    if not isinstance(result, (tuple, list)) or len(result) not in (2, 3):
        raise DumpError(f"{what} must return a model or (model, inputs), got {type(result)}")
    model, inputs, *rest = result
    if not isinstance(model, torch.nn.Module):
        raise DumpError(f"{what} returned {type(model).__name__} where a torch.nn.Module goes")
    if rest:
        return Target(model, tuple(inputs), dict(rest[0]), what)
    if isinstance(inputs, torch.Tensor):
        return Target(model, (inputs,), {}, what)
    if isinstance(inputs, Mapping):
        return Target(model, (), dict(inputs), what)
    return Target(model, tuple(inputs), {}, what)


def _load_function(target: str):
    path, _, func = target.partition(":")
    if path.endswith(".py"):
        if not os.path.isfile(path):
            raise DumpError(f"no such file: {path}")
        func = func or DEFAULT_FUNCTION
        name = "tspc_dump_target_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up by name
        # like `python FILE.py`: the file's folder is importable while it loads
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.pop(0)
    else:
        if os.getcwd() not in sys.path:  # like `python -m`: the working directory is importable
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(path)
        except ImportError as e:
            raise DumpError(f"cannot import {path!r}: {e}") from e
    fn = getattr(module, func, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if inspect.isfunction(v) and n[0] != "_"]
        raise DumpError(
            f"{path} has no function {func!r} (functions: {', '.join(found) or 'none'}); "
            "name one as TARGET:FUNC"
        )
    return fn


def _call_function(target: str, seq: int, batch: int, sets: dict) -> Target:
    fn = _load_function(target)
    params = inspect.signature(fn).parameters
    kwargs = dict(sets)
    for name, value in (("seq", seq), ("batch", batch)):
        if name in params and name not in kwargs:
            kwargs[name] = value
    return _normalise(fn(**kwargs), batch, seq, target)


def _hf_config(target: str, seq: int, sets: dict):
    from transformers import CONFIG_MAPPING, AutoConfig

    path = os.path.join(target, "config.json") if os.path.isdir(target) else target
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise DumpError(f"no such file: {path}")
        with open(path) as f:
            fields = json.load(f)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise DumpError(f"{path} has no 'model_type'")
    else:
        model_type = target
        if model_type not in CONFIG_MAPPING:
            close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=5)
            raise DumpError(
                f"{target!r} is not a file, a module:function nor a transformers model type"
                + (f" (did you mean {', '.join(close)}?)" if close else "")
            )
        fields = dict(SMALL_CONFIG, max_position_embeddings=max(128, seq))
    # a training-shaped forward: config.json files say use_cache=true, which adds the KV cache
    # to the graph's outputs (and to the gathers); --set use_cache=true restores it
    fields["use_cache"] = False
    fields.update(sets)
    return AutoConfig.for_model(model_type, **fields)


def _hf_model(target: str, seq: int, batch: int, sets: dict, max_params: float) -> Target:
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(target, seq, sets)
    with torch.device("meta"):  # count first: a real config.json would allocate gigabytes
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    if n > max_params:
        raise DumpError(
            f"{target} builds a model of {n / 1e6:.0f}M parameters (limit {max_params / 1e6:.0f}M):"
            " shrink it, e.g. --set num_hidden_layers=2, or raise --max-params"
        )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    what = f"{target} ({type(model).__name__}, {cfg.num_hidden_layers} layers)"
    return Target(model, (_token_ids(model, batch, seq, target),), {}, what)


def load_target(
    target: str, seq: int, batch: int, sets: dict | None = None, max_params: float = 5e8
) -> Target:
    """The model and example inputs that TARGET names (see the module docstring)."""
    import torch

    torch.manual_seed(0)
    sets = dict(sets or {})
    base = target.split(":", 1)[0]
    if base.endswith(".py") or (":" in target and not target.endswith(".json")):
        return _call_function(target, seq, batch, sets)
    return _hf_model(target, seq, batch, sets, max_params)


# ---------------------------------------------------------------------------- running


@contextlib.contextmanager
def fake_process_group(rank: int, world: int) -> Iterator[None]:
    """rank r of D on torch's ``fake`` backend: collectives complete at once, move nothing."""
    import torch.distributed as dist

    from tspc.runtime.compat import fake_process_group_store

    if dist.is_initialized():
        raise DumpError("tspc dump starts its own fake process group; one is already initialised")
    dist.init_process_group("fake", store=fake_process_group_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _loss_of(out: Any):
    """Sum of every floating output that requires grad: what the backward is run on."""
    import torch

    leaves: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
        elif isinstance(x, Mapping):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(out)
    grads = [t for t in leaves if t.requires_grad and t.is_floating_point()]
    return sum(t.float().sum() for t in grads) if grads else None


def _clear_old_dump(rank_dir: str) -> None:
    """Remove graph folders of an earlier dump (only folders holding a tspc report.json)."""
    if not os.path.isdir(rank_dir):
        return
    for name in os.listdir(rank_dir):
        d = os.path.join(rank_dir, name)
        if name.startswith("graph") and os.path.isfile(os.path.join(d, "report.json")):
            shutil.rmtree(d)


@contextlib.contextmanager
def _on_fake_cuda(target: Target, backward: bool) -> Iterator[tuple[Target, bool]]:
    """``target`` on fake CUDA tensors, and whether a backward can run (needs a real GPU)."""
    import torch

    from tspc.runtime.compat import fake_tensor_mode, tree_map
    from tspc.tools import fake_cuda
    from tspc.tools.fake_run import _keep_fake_parameter_class

    try:
        fake_cuda.ensure_device_guard()
    except fake_cuda.FakeCudaUnavailable as e:
        raise DumpError(str(e)) from e
    grads = backward and fake_cuda.autograd_available()
    mode = fake_tensor_mode(allow_non_fake_inputs=True)
    model = fake_cuda.model_to_fake_cuda(target.model, mode, requires_grad=grads)

    def conv(x):
        return fake_cuda.fake_cuda_like(mode, x) if isinstance(x, torch.Tensor) else x

    fake = Target(model, tree_map(conv, target.args), tree_map(conv, target.kwargs), target.what)
    with _keep_fake_parameter_class(), mode, torch.set_grad_enabled(grads):
        yield fake, grads


def dump_rank(
    target: Target,
    rank: int,
    world: int,
    out: str,
    options: dict,
    backward: bool = True,
    device: str = "cpu",
) -> list:
    """Compile and run ``target`` as rank ``rank`` of ``world``; the ``GraphDump`` of every
    graph it compiled (one per Dynamo graph). ``device="cuda"``: on fake CUDA tensors, with a
    ``device_check`` (``tspc/tools/device_check.py``) on every dump."""
    import torch

    from tspc import backend
    from tspc.dump import DUMPS

    _clear_old_dump(os.path.join(out, f"rank{rank}"))
    with fake_process_group(rank, world):
        torch.compiler.reset()  # never reuse another rank's graph
        # number this rank's graphs from 0, as a fresh process does; the process's own count
        # goes on afterwards (a later compile in this process must not reuse an id)
        ids, backend._GRAPH_IDS = backend._GRAPH_IDS, itertools.count()
        first = len(DUMPS)
        on_device = (
            _on_fake_cuda(target, backward)
            if device == "cuda"
            else contextlib.nullcontext((target, backward))
        )
        with on_device as (target, backward):
            opts = {**options, "dump_dir": out}
            if device == "cuda":  # fake CUDA tensors: Inductor would need a GPU toolchain
                opts.setdefault("inner", "aot_eager")
            compiled = torch.compile(target.model, backend="tsp", options=opts)
            result = compiled(*target.args, **target.kwargs)
            if backward:
                loss = _loss_of(result)
                if loss is not None:
                    loss.backward()
        dumps = DUMPS[first:]
        torch.compiler.reset()
        backend._GRAPH_IDS = ids
    if not dumps:
        raise DumpError("the backend compiled no graph (is the model's forward empty?)")
    if device == "cuda":
        for d in dumps:
            _write_device_check(d)
    return dumps


def _write_device_check(dump) -> None:
    from tspc.tools.device_check import check_graphs

    if dump.inner == "eager":  # no aot graphs: the pipeline's graph is what runs
        forward, backward = [dump.result.gm], []
    else:
        forward, backward = dump.graphs.forward_gms, dump.graphs.backward_gms
    dump.device_check = dict(check_graphs(forward, backward), device="cuda")
    with open(os.path.join(dump.dir, "device_check.json"), "w") as f:
        json.dump(dump.device_check, f, indent=2)
        f.write("\n")


def device_check_text(check: dict) -> str:
    """What ``tspc dump --device cuda`` prints of a dump's ``device_check.json``."""
    bad = {where: ops for where, ops in check["cpu_only_ops"].items() if ops}
    lines = [
        "device cuda: "
        + (
            "CPU-only ops: " + "; ".join(f"{w}: {', '.join(o)}" for w, o in bad.items())
            if bad
            else f"every op has a CUDA kernel ({check['ops_checked']} ops checked)"
        )
    ]
    kernels = {w: k for w, k in check["attention_kernels"].items() if k}
    lines.append(
        "attention kernels: "
        + ("; ".join(f"{w}: {', '.join(k)}" for w, k in kernels.items()) or "none")
    )
    if not check["backward_graph_traced"]:
        lines.append(
            "backward graph not traced: autograd on CUDA tensors needs a GPU (forward graph "
            "traced as inference; the attention backward kernels are checked)"
        )
    return "\n".join(lines) + "\n"


def _file_list(d: str) -> str:
    return " ".join(sorted(os.listdir(d)))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tspc dump",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", help="FILE.py[:FUNC], module:FUNC, config.json or a model type")
    p.add_argument("--world-size", "-D", type=int, required=True, help="D, the TSP group size")
    p.add_argument("--rank", default="0", help="r in 0..D-1, or 'all' (default 0)")
    p.add_argument("--seq", type=int, default=64, help="sequence length S (default 64)")
    p.add_argument("--batch", type=int, default=2, help="batch size B (default 2)")
    p.add_argument("--out", default="tspc_dump", help="output folder (default ./tspc_dump)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config field or FUNC argument (VALUE parsed as JSON when it is JSON)",
    )
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option, e.g. overlap=false, schedules=sp, inner=inductor",
    )
    p.add_argument("--no-backward", action="store_true", help="forward only")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="trace on fake tensors of this device; cuda adds device_check.json (no GPU needed)",
    )
    p.add_argument("--max-params", type=float, default=5e8, help="refuse configs larger than this")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return _run(a)
    except DumpError as e:
        print(f"tspc dump: error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace) -> int:
    from tspc.options import TSPOptions

    if a.world_size < 1:
        raise DumpError("--world-size must be at least 1")
    if a.rank == "all":
        ranks = list(range(a.world_size))
    elif a.rank.isdigit() and int(a.rank) < a.world_size:
        ranks = [int(a.rank)]
    else:
        raise DumpError(f"--rank must be 0..{a.world_size - 1} or 'all', got {a.rank!r}")
    sets = parse_assignments(a.set, "--set")
    options = parse_assignments(a.option, "--option")
    bad = [k for k in options if k in _FORBIDDEN_OPTIONS]
    if bad:
        raise DumpError(f"--option {bad[0]} is set by tspc dump itself")
    try:
        TSPOptions.from_dict(options)
    except ValueError as e:
        raise DumpError(str(e)) from e

    digests: dict[int, list[dict]] = {}
    cpu_only = False
    for i, rank in enumerate(ranks):
        target = load_target(a.target, a.seq, a.batch, sets, a.max_params)
        dumps = dump_rank(target, rank, a.world_size, a.out, options, not a.no_backward, a.device)
        if a.device == "cuda" and any(
            ops for d in dumps for ops in d.device_check["cpu_only_ops"].values()
        ):
            cpu_only = True
        reports = [d.report_dict() for d in dumps]
        digests[rank] = [r["issue_order_digest"] for r in reports]
        if i == 0:
            print(
                f"tspc dump: {target.what}, rank {rank} of {a.world_size}, graph-only "
                f"(fake process group), batch {a.batch}, sequence {a.seq}"
                + (", on fake CUDA tensors" if a.device == "cuda" else "")
            )
            if len(dumps) > 1:
                print(f"{len(dumps)} graphs: the model has graph breaks")
            for d in dumps:
                with open(os.path.join(d.dir, "summary.txt")) as f:
                    print(f.read(), end="")
                if a.device == "cuda":
                    print(device_check_text(d.device_check), end="")
                print(f"wrote {d.dir}/: {_file_list(d.dir)}\n")
        else:
            print(f"rank {rank}: wrote {', '.join(d.dir for d in dumps)}")
    if len(ranks) > 1:
        first = digests[ranks[0]]
        differ = [r for r in ranks if digests[r] != first]
        if differ:
            print(
                f"collective issue order DIFFERS on ranks {differ} from rank {ranks[0]}: these "
                f"ranks would hang; diff {a.out}/rank{ranks[0]}/graph0/collectives.txt "
                f"{a.out}/rank{differ[0]}/graph0/collectives.txt"
            )
            return 1
        print(f"collective issue order identical on all {len(ranks)} ranks")
    return 1 if cpu_only else 0


if __name__ == "__main__":
    raise SystemExit(main())
