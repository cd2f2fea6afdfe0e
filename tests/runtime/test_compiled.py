"""trainer.compile (launcher/runtime/compiled.py): what is compiled, and what a model that cannot be compiled is told."""

from __future__ import annotations

import types

import pytest
import torch

from launcher.runtime.compiled import compile_error, compile_model

SPEC = types.SimpleNamespace(enabled=True, mode="default", fullgraph=True, dynamic=None)


@pytest.mark.parametrize("wrap", ["plain", "ddp", "fsdp"])
@pytest.mark.parametrize("make", ["sequential", "linear", "custom"])
def test_compile_model_compiles_torchs_own_modules_too(make, wrap, monkeypatch):
    """nn.Module.compile alone compiles nothing for a model of torch's modules (dynamo skips their frames)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.a(x).relu()

    makers = {"sequential": lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)),
              "linear": lambda: torch.nn.Linear(8, 1), "custom": Custom}
    torch._dynamo.reset()
    counters.clear()
    model = makers[make]()
    keys = list(model.state_dict())
    if wrap != "plain":
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    if wrap == "fsdp":  # FSDP2's hooks are dynamo.disable'd: traced from _call_impl, nothing compiled, fullgraph failed
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    try:
        # fullgraph: dynamo must never be handed DDP's own forward (its C++ reducer would break the graph)
        compile_model(model, SPEC)
        model(torch.randn(4, 8)).sum().backward()
        assert counters["stats"]["unique_graphs"] >= 1
        assert [k.removeprefix("module.") for k in model.state_dict()] == keys  # checkpoints keep their names
        assert counters["stats"]["calls_captured"] >= 1, dict(counters["stats"])
        assert all(p.grad is not None for p in model.parameters())
    finally:
        if wrap != "plain":
            dist.destroy_process_group()
        torch._dynamo.reset()



class Mismatched(torch.nn.Module):
    """A shape bug: 16 features into a layer of 8."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 16), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(self.a(x))  # the line the error names


class Printing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x):
        print("a graph break")  # the line the error names
        return self.a(x)


def said(model) -> str:
    torch._dynamo.reset()
    compile_model(model, SPEC)
    try:
        with pytest.raises(Exception) as caught:
            model(torch.randn(2, 4))
        error = compile_error(caught.value, model, fullgraph=True)
        assert error is not None, caught.value
        return str(error)
    finally:
        torch._dynamo.reset()


def test_a_bug_in_the_model_is_said_as_eager_torch_says_it_at_the_users_line():
    text = said(Mismatched())
    assert text.startswith("torch.compile could not compile Mismatched (tests.runtime.test_compiled): RuntimeError: "
                           "a and b must have same reduction dim, but got [2, 16] X [8, 1].")
    assert f"\n  at {__file__}:" in text and "in forward: return self.b(self.a(x))  # the line the error names" in text
    assert text.endswith("eagerly (trainer.compile.enabled=false) it would fail too")


def test_a_graph_break_under_fullgraph_says_fullgraph_made_it_an_error():
    text = said(Printing())
    assert "Unsupported: Failed to trace builtin operator" in text and "`print`" in text
    assert 'in forward: print("a graph break")  # the line the error names' in text
    assert text.endswith("trainer.compile.fullgraph=true makes this graph break an error: set it false to run that part "
                         "eagerly, or change the line")


def test_a_bug_in_a_model_of_torchs_modules_names_no_line_of_dlaunch():
    """An nn.Sequential is entered through dlaunch's ``module_call``, the only frame outside torch: the error named
    that line of dlaunch's as the user's."""
    text = said(torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(8, 1)))
    assert text.startswith("torch.compile could not compile Sequential (torch.nn.modules.container): RuntimeError: ")
    assert "compiled.py" not in text and "\n  at " not in text, text


def test_no_frame_of_dlaunchs_own_is_named_as_the_users_line():
    """Activation checkpointing's replay is dlaunch's frame between torch's modules: it was named as the user's."""
    from launcher.distribute import activation_checkpointing

    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Linear(8, 1))
    activation_checkpointing.apply(model, ["Linear"])
    text = said(model)
    assert "RuntimeError: " in text and "launcher/" not in text and "\n  at " not in text, text


def test_other_errors_are_not_compile_errors():
    assert compile_error(ValueError("a user's own"), torch.nn.Linear(1, 1)) is None


@torch.library.custom_op("dlaunch_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class CustomOp(torch.nn.Module):
    """An op that runs eagerly but has no fake implementation, so tracing it fails."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.a(doubled(x))


def test_an_op_that_only_fails_while_tracing_is_not_called_a_bug_in_the_model():
    text = said(CustomOp())
    assert "There was no fake impl registered" in text
    assert text.endswith("The op runs eagerly but cannot be traced (it needs a fake/meta implementation for torch.compile); "
                         "run the model eagerly with trainer.compile.enabled=false")
    assert CustomOp()(torch.randn(2, 4)).shape == (2, 1)  # eagerly it runs
