"""``trainer.activation_checkpointing`` (launcher/distribute/activation_checkpointing.py): fewer saved activations,
the same losses and gradients, the model's names unchanged."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch

from launcher import distribute as dl
from launcher.distribute import activation_checkpointing as ac
from tests.conftest import dlaunch


class Block(torch.nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Net(torch.nn.Module):
    def __init__(self, width: int = 32, blocks: int = 3, dropout: float = 0.1):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width, dropout) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def trained_once(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, float, list[torch.Tensor]]:
    """Elements saved for backward, the loss, and the gradients of one forward and backward (dropout seeded)."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.manual_seed(5)
        loss = model(x)
    loss.backward()
    return saved[0], loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    plain = Net()
    recomputed = copy.deepcopy(plain)
    assert ac.apply(recomputed, ["Block"]) == 3
    return plain, recomputed


def test_it_saves_less_and_trains_bit_for_bit_the_same_dropout_included(pair):
    plain, recomputed = pair
    x = torch.randn(64, 32)
    (saved, loss, grads), (saved_ac, loss_ac, grads_ac) = trained_once(plain, x), trained_once(recomputed, x)
    assert loss == loss_ac and all(torch.equal(g, h) for g, h in zip(grads, grads_ac))
    assert saved_ac * 5 < saved  # each block keeps its input alone: 2,048 per block here, not ~20,000


def test_names_state_dict_and_copies_are_unchanged(pair):
    plain, recomputed = pair
    assert [n for n, _ in recomputed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(recomputed.state_dict()) == list(plain.state_dict())
    assert ac.checkpointed(recomputed) == 3 and ac.checkpointed(plain) == 0
    copied = copy.deepcopy(recomputed)  # mirrored's replicas and the tests' copies: the copy recomputes itself
    assert all(b.forward.args[0] is b for b in copied.blocks) and ac.checkpointed(copied) == 3


def test_a_whole_model_pickle_loads_and_recomputes_as_the_original(pair):
    plain, recomputed = pair
    buffer = io.BytesIO()
    torch.save(recomputed, buffer)  # the whole model, as a user's own save might do; dlaunch saves state_dicts
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert ac.checkpointed(loaded) == 3 and all(b.forward.args[0] is b for b in loaded.blocks)
    x = torch.randn(16, 32)
    (saved, loss, grads), (saved_ac, loss_ac, grads_ac) = trained_once(plain, x), trained_once(loaded, x)
    assert loss == loss_ac and all(torch.equal(g, h) for g, h in zip(grads, grads_ac)) and saved_ac * 5 < saved


def test_evaluation_and_no_grad_run_the_plain_forward(pair, monkeypatch):
    plain, recomputed = pair
    called = []
    monkeypatch.setattr(ac, "checkpoint", lambda *a, **k: called.append(1))
    x = torch.randn(8, 32)
    with torch.no_grad():
        assert torch.equal(recomputed.eval()(x), plain.eval()(x))
    recomputed.train()
    with torch.no_grad():
        recomputed(x)
    assert called == []


def test_a_class_inside_another_recomputed_one_is_left_to_its_parent_and_applying_twice_changes_nothing():
    model = Net()
    assert ac.apply(model, ["Block", "Linear"]) == 4  # 3 blocks and the head; the blocks' Linears are inside them
    assert ac.apply(model, ["Block", "Linear"]) == 4 and ac.checkpointed(model) == 4
    assert ac.apply(model, []) == 0


def test_a_name_the_model_lacks_is_said_with_the_models_module_types():
    with pytest.raises(ac.UnknownModuleClass, match=r"trainer.activation_checkpointing names Blok, but Net contains no module "
                       r"of that class; its module types are: Block, Dropout, Linear, ModuleList, Net$"):
        ac.apply(Net(), ["Block", "Blok"])


class Scaled(torch.nn.Module):
    """A block given a tensor by keyword, under a name torch.utils.checkpoint also takes (``debug``)."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, *, debug: torch.Tensor) -> torch.Tensor:
        return self.drop(self.lin(x)) * debug


def test_keyword_tensors_reach_the_forward_and_train_as_without_it():
    torch.manual_seed(0)
    plain = torch.nn.ModuleList([Scaled()])
    recomputed = copy.deepcopy(plain)
    ac.apply(recomputed, ["Scaled"])
    x, scale = torch.randn(4, 8), torch.full((4, 8), 3.0, requires_grad=True)
    results = []
    for model in (plain, recomputed):
        scale.grad = None
        torch.manual_seed(1)
        model[0](x, debug=scale).square().sum().backward()
        results.append([scale.grad.clone(), model[0].lin.weight.grad.clone()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("model, names, said", [
    (torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))), ["Sequential"],
     "0 (Sequential) holds 0.1 (BatchNorm1d), whose running statistics the recompute would update a second time"),
    (Net(), ["Net"], "names Net, the model itself: its recompute in backward would hold all its activations at once"),
], ids=["batch norm", "the model itself"])
def test_what_the_recompute_would_get_wrong_is_refused(model, names, said):
    with pytest.raises(ac.NotRecomputable, match=re.escape(said)):
        ac.apply(model, names)


def test_a_forward_set_on_the_instance_and_a_string_are_refused():
    model = Net()
    model.blocks[1].forward = lambda x: x
    with pytest.raises(ac.NotRecomputable, match=r"blocks.1 \(Block\) has a forward set on the instance"):
        ac.apply(model, ["Block"])
    with pytest.raises(TypeError, match="a list of module class names, not the string 'Block'"):
        ac.apply(Net(), "Block")


def test_a_name_a_model_lacks_is_skipped_where_not_strict():
    model = Net()
    assert ac.apply(model, ["Blok", "Block"], strict=False) == 3


def test_prepare_applies_the_strategys_setting_and_replica_threads_refuse_it(strategy):
    one = dl.OneDeviceStrategy("cpu")
    one.activation_checkpointing = ("Block", "Tanh")
    with one.scope():
        model = one.prepare(Net())  # a script may prepare several models: Tanh may be another's
    assert ac.checkpointed(model) == 3 and one._unfound_recompute() == ["Tanh"]
    with one.scope():
        one.prepare(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
    assert one._unfound_recompute() == []
    strategy.activation_checkpointing = ("Block",)  # two replica threads (tests/conftest.py)
    with strategy.scope(), pytest.raises(ValueError, match="needs one replica per process: replica threads share"):
        strategy.prepare(Net())


@pytest.mark.slow
def test_compiled_it_saves_less_and_trains_as_compiled_without_it(pair):
    """Dynamo turns the call into torch's checkpoint operator: the compiled graph recomputes too."""
    plain, recomputed = pair
    plain.compile()
    recomputed.compile()
    x = torch.randn(64, 32)
    (saved, loss, grads), (saved_ac, loss_ac, grads_ac) = trained_once(plain, x), trained_once(recomputed, x)
    assert loss == loss_ac and all(torch.equal(g, h) for g, h in zip(grads, grads_ac))
    assert saved_ac * 2 < saved


TWO_MODELS = """import torch
from launcher import distribute as dl

strategy = dl.get_strategy()
with strategy.scope():
    gen = strategy.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()))
    disc = strategy.prepare(torch.nn.Sequential(torch.nn.Linear(8, 1), torch.nn.Sigmoid()))
disc(gen(torch.randn(2, 4))).sum().backward()
print("recomputed:", [type(m).__name__ for m in (*gen, *disc) if "forward" in vars(m)])
"""


@pytest.mark.slow
def test_a_script_recomputes_the_named_classes_of_each_model_it_prepares_and_is_told_of_a_name_none_has(tmp_path):
    """A script may prepare several models, each with some of the classes: a name only one has is no error (a
    recipe's one model is held to every name: tests/runtime/test_training_options.py)."""
    (tmp_path / "two_models.py").write_text(TWO_MODELS)
    proc = dlaunch("script=two_models.py", "trainer.activation_checkpointing=[Tanh,Sigmoid,Block]",
                   f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recomputed: ['Tanh', 'Sigmoid']" in proc.stdout
    said = " ".join((proc.stdout + proc.stderr).split())
    assert "1 module(s) of Tanh recompute" in said and "1 module(s) of Sigmoid recompute" in said
    assert ("trainer.activation_checkpointing names Block, but no model the script gave strategy.prepare() contains "
            "a module of that class, so nothing was recomputed for it") in said
