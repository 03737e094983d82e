"""The backend's front door: registration by entry point, options, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from samples.reference_model import build_reference_model
from tspc.options import OptionError, TSPOptions


@pytest.mark.slow
def test_backend_resolves_without_importing_tspc():
    code = (
        "import sys, torch\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "fn = lookup_backend('tsp')\n"
        "assert fn.__module__ == 'tspc.backend', fn\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_unknown_option_is_an_error_listing_known_ones():
    model = build_reference_model(num_layers=1)
    compiled = torch.compile(model, backend="tsp", options={"overlapp": True})
    with pytest.raises(Exception, match=r"unknown tsp backend option\(s\) \['overlapp'\].*overlap"):
        compiled(torch.randint(0, 256, (1, 8)))


@pytest.mark.parametrize(
    "options,match",
    [
        ({"inner": "tvm"}, r"inner='tvm' is not one of"),
        ({"outputs": "scattered"}, r"outputs='scattered'"),
        ({"strict": "yes"}, r"strict must be True or False"),
        ({"comm_timeout": -1}, r"comm_timeout must be a positive"),
    ],
)
def test_bad_option_values(options, match):
    with pytest.raises(OptionError, match=match):
        TSPOptions.from_dict(options)


def test_inner_default_is_inductor_unless_tspc_inner_says(monkeypatch):
    monkeypatch.delenv("TSPC_INNER", raising=False)
    assert TSPOptions.from_dict({}).inner == "inductor"
    monkeypatch.setenv("TSPC_INNER", "aot_eager")  # what the test suite runs with
    assert TSPOptions.from_dict({}).inner == "aot_eager"
    assert TSPOptions.from_dict({"inner": "inductor"}).inner == "inductor"  # an option wins
    monkeypatch.setenv("TSPC_INNER", "tvm")
    with pytest.raises(OptionError, match=r"TSPC_INNER='tvm' is not one of"):
        TSPOptions.from_dict({})


def test_group_must_be_a_process_group_or_mesh():
    from tspc.runtime.group import GroupResolutionError, resolve_group

    with pytest.raises(GroupResolutionError, match="ProcessGroup or a DeviceMesh"):
        resolve_group(group="world")


def test_launcher_without_process_group_is_an_error_not_a_silent_single_rank(monkeypatch):
    """torchrun sets WORLD_SIZE; forgetting init_process_group would run every process as
    D = 1 on the whole model."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    compiled = torch.compile(build_reference_model(num_layers=1), backend="tsp")
    with pytest.raises(Exception, match=r"WORLD_SIZE=2 is set but torch.distributed is not"):
        compiled(torch.randint(0, 256, (1, 16)))


def test_a_new_scalar_value_does_not_recompile_a_dynamic_graph():
    """With symbolic shapes tspc compiles once per concrete shape; a 0-d tensor input (here a
    temperature) is keyed by its shape, not its value — only 0-d inputs whose value the graph
    bakes in (``.item()``) are keyed by value. Counted by tspc's own compile reports."""
    import tspc.report

    def f(x, temperature):
        return torch.softmax(x / temperature, dim=-1)

    torch.compiler.reset()
    compiled = torch.compile(f, backend="tsp", dynamic=True)
    before = tspc.report.last_graph_id()
    x = torch.randn(2, 8, 4)
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(compiled(x, torch.tensor(t)), f(x, torch.tensor(t)))
    assert len(tspc.report.reports_after(before)) == 1
    compiled(torch.randn(2, 12, 4), torch.tensor(3.0))  # a new shape: one more compile
    assert len(tspc.report.reports_after(before)) == 2


@pytest.mark.slow
def test_comm_timeout_is_the_graphs_own_not_the_process_default():
    """options={"comm_timeout": t} applies to that model's collectives only: compiling it
    leaves the process default (TSPC_COMM_TIMEOUT) alone, and the scope nests."""
    from tspc.runtime import comm

    default = comm.SETTINGS.timeout_s
    torch.compiler.reset()
    model = build_reference_model(num_layers=1)
    compiled = torch.compile(model, backend="tsp", options={"comm_timeout": 7.0})
    compiled(torch.randint(0, 256, (2, 16)))
    assert comm.SETTINGS.timeout_s == default
    assert comm.current_timeout() == default
    with comm.timeout_scope(7.0):
        assert comm.current_timeout() == 7.0
        with comm.timeout_scope(None):  # a graph without its own: the process default
            assert comm.current_timeout() == default
        assert comm.current_timeout() == 7.0


def test_a_graph_no_pipeline_level_can_run_is_a_clear_error(monkeypatch, fake_group):
    """Every level failing (here: injected) must name each failure, not end in a bare assert."""
    import tspc.backend as backend

    def failing(gm, example_inputs, group, opts, level, graph_id):
        raise RuntimeError(f"injected failure at level {level}")

    fake_group(0, 2)
    monkeypatch.setattr(backend, "run_pipeline", failing)
    torch.compiler.reset()
    # strict=True: the first level's failure is the error, naming the level and the cause.
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="tsp", options={"strict": True})
    with pytest.raises(
        Exception, match=r"'tsp' pipeline failed(.|\n)*injected failure at level tsp"
    ):
        compiled(torch.randn(2, 4))
    torch.compiler.reset()
    # Without strict (the default) each level's failure is a warning naming it, and as nothing was
    # released yet the graph falls back to a plain compile that computes what the module does.
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    compiled = torch.compile(lin, backend="tsp")
    with pytest.warns(Warning) as record:
        out = compiled(x)
    said = "\n".join(str(w.message) for w in record)
    for level in ("tsp", "sp", "replicated"):
        assert f"injected failure at level {level}" in said
    assert "every pipeline level failed" in said and "plain torch.compile" in said
    torch.testing.assert_close(out, lin(x))
    torch.compiler.reset()
