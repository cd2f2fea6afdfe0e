"""strategy=fsdp: FSDP2 sharded data parallelism on real gloo processes, through the real CLI."""

from __future__ import annotations

import pytest
import torch

from launcher.launch.function import run_function
from tests.conftest import summary

LINEAR = ("recipe=linear", "strategy=fsdp", "trainer.steps=40", "trainer.checkpoint.every_steps=20")
# float32 sums of the same per-example gradients in another order (2 or 4 shards, reduce-scatter) differ by a few
# ulps (~1e-7 relative) per step; 40 momentum steps keep that well under 1e-5 relative.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def shard_and_measure() -> dict:
    """A 2-layer MLP with AdamW, one step: what this rank holds, against the whole model's bytes."""
    from launcher.strategies.fsdp import FSDPStrategy, local_bytes

    strategy = FSDPStrategy(wrap=["Linear"], device_type="cpu")
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        model, optimizer = strategy.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    resolver = strategy.cluster_resolver  # the job's, as mirrored's (it was None)
    return {"local": local_bytes(model, optimizer), "ddp": whole * 4, "sharded": type(next(model.parameters())).__name__,
            "task": (resolver.task_type, resolver.task_id)}


@pytest.mark.slow
def test_each_rank_holds_a_quarter_of_ddps_parameter_gradient_and_optimizer_bytes():
    """AdamW: parameters + gradients + 2 state tensors = 4x the parameters under DDP; FSDP on 4 ranks holds 1/4 of it."""
    results = run_function(shard_and_measure, device="cpu", nproc=4)
    for rank, r in results.items():
        assert r["sharded"] == "DTensor" and r["task"] == ("worker", rank)
        assert r["local"] == r["ddp"] // 4  # 64x128, 128, 128x64, 64 all split evenly in 4 along dim 0


def test_dry_run_shows_the_memory_per_rank(run_dlaunch):
    proc, _ = run_dlaunch("recipe=linear", "strategy=fsdp", "cluster=1x4", "launch.dry_run=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join((proc.stdout + proc.stderr).split())
    # Linear(32, 1): 33 fp32 parameters = 132 bytes; SGD with momentum: 1 state tensor; DDP: 3 x 132 = 396 bytes.
    assert "per rank: 99 bytes = 1/4 of DDP's 396 bytes (132 bytes parameters" in text, proc.stdout
    assert "SGD: 1 state tensor(s) per parameter" in text


def test_a_wrap_class_the_model_lacks_stops_before_the_first_step(run_dlaunch):
    proc, _ = run_dlaunch("recipe=linear", "strategy=fsdp", "strategy.wrap=[TransformerBlock]", "trainer.steps=5")
    assert proc.returncode == 1
    out = " ".join((proc.stdout + proc.stderr).replace("│", " ").split())
    assert "strategy.wrap names TransformerBlock, but Linear contains no module of that class" in out
    assert "its module types are: Linear" in out
    assert "step 1" not in out and "Traceback" not in out


def test_a_tied_weight_across_wrap_units_is_named_before_anything_is_sharded():
    """A tied embedding and output head with `strategy.wrap=[Block,Embedding]`: torch failed at the first forward
    ('shared with a parameter already managed by another FSDP group'); a new-user pass found it."""
    import pytest
    import torch

    from launcher.strategies.impl.fsdp import WrapError, wrapped_units

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    model = torch.nn.Module()
    model.embed, model.blocks = torch.nn.Embedding(10, 4), torch.nn.ModuleList([Block(), Block()])
    model.head = torch.nn.Linear(4, 10, bias=False)
    model.head.weight = model.embed.weight
    assert len(wrapped_units(model, ["Block"])) == 2  # the tied pair both in the root's unit: fine
    with pytest.raises(WrapError, match=r"held by embed.weight \(unit embed\), head.weight \(the root\).*leave "
                                        r"Embedding out of strategy.wrap"):
        wrapped_units(model, ["Block", "Embedding"])
    reused, block = torch.nn.Module(), Block()
    reused.blocks = torch.nn.ModuleList([block, block])  # one module at two places: one unit, no tie
    assert wrapped_units(reused, ["Block"]) == [block]


def test_one_process_trains_as_one_device_with_a_warning(run_dlaunch):
    proc, run_dir = run_dlaunch("recipe=linear", "strategy=fsdp", "trainer.steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy=fsdp on one process shards nothing" in proc.stdout + proc.stderr
    assert summary(run_dir)["num_replicas_in_sync"] == 1


def test_fp16_mixed_is_refused_with_the_reason(run_dlaunch):
    proc, _ = run_dlaunch("recipe=linear", "strategy=fsdp", "cluster=1x2", "trainer.precision=fp16-mixed")
    assert proc.returncode == 2
    assert "GradScaler checks only this rank's gradient shard" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_fsdp_on_2_and_4_processes_trains_like_one_device_and_checkpoints_reshard(run_dlaunch):
    """Final parameters within float32 reduction-order error of one device; the 1x4 checkpoint resumes on 1x2 (whose
    20 steps end where 1x4's, and so one device's, do) and on one device."""
    from launcher.checkpoint import layout, read_tensors

    runs = {}
    for name, args in (("one", ("strategy=one_device",)), ("fsdp4", ("cluster=1x4",))):
        proc, runs[name] = run_dlaunch(*LINEAR, *args, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    final = {name: read_tensors(layout.step_dir(d / "checkpoints", 40)) for name, d in runs.items()}
    assert summary(runs["fsdp4"])["world_size"] == 4
    for key, value in final["one"].items():
        torch.testing.assert_close(final["fsdp4"][key], value, **TOLERANCE, msg=f"fsdp4: {key}")

    halfway = layout.step_dir(runs["fsdp4"] / "checkpoints", 20)
    for name, args in (("resumed2", ("cluster=1x2",)), ("resumed1", ("strategy=one_device",))):
        proc, run_dir = run_dlaunch(*LINEAR, f"trainer.resume={halfway}", *args, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (summary(run_dir)["resumed_from_step"], summary(run_dir)["world_size"]) == (20, int(name[-1]))
        resumed = read_tensors(layout.step_dir(run_dir / "checkpoints", 40))
        for key, value in final["fsdp4"].items():
            torch.testing.assert_close(resumed[key], value, **TOLERANCE, msg=f"{name}: {key}")


@pytest.mark.slow
def test_wrapped_layers_train_in_bf16_with_clipping(run_dlaunch):
    """digits: each Linear its own unit, MixedPrecisionPolicy(bf16, fp32 reduce), clip_grad_norm on DTensor gradients,
    and fused Adam on the DTensor parameters (what ``recipe.optimizer.implementation=auto`` picks on CUDA)."""
    proc, run_dir = run_dlaunch("recipe=digits", "strategy=fsdp", "cluster=1x2", "strategy.wrap=[Linear]",
                                "strategy.reshard_after_forward=false", "trainer.precision=bf16-mixed",
                                "trainer.clip_grad_norm=1.0", "trainer.steps=30", "recipe.optimizer.implementation=fused")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert s["final_loss"] < 0.7 * s["first_loss"]
    assert s["metrics"]["eval_accuracy"] > 0.5


@pytest.mark.slow
def test_an_optimizer_with_state_from_its_construction_is_sharded_with_its_parameters(run_dlaunch):
    """Adagrad fills its ``sum`` when it is built, before prepare() shards the model: fsdp 1x2 trains as one device
    (it stopped with "give it an optimizer that has not stepped yet")."""
    adagrad = ("recipe=linear", "trainer.steps=20", "recipe.optimizer.name=adagrad", "recipe.optimizer.implementation=foreach")
    proc, sharded = run_dlaunch(*adagrad, "strategy=fsdp", "cluster=1x2", name="fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, one = run_dlaunch(*adagrad, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary(sharded)["final_loss"] == pytest.approx(summary(one)["final_loss"], rel=1e-5)
    assert summary(sharded)["param_norm"] == pytest.approx(summary(one)["param_norm"], rel=1e-5)


def test_an_optimizer_that_has_stepped_is_refused_one_built_with_state_is_not():
    """SGD's momentum buffers come from steps (no step count says otherwise); Adagrad's sum from its constructor."""
    from launcher.strategies.impl.fsdp import _check_optimizer, _rebind

    model = torch.nn.Linear(2, 1)
    before = {id(p): name for name, p in model.named_parameters()}
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    sgd.step()
    with pytest.raises(ValueError, match="give it an optimizer that has not stepped yet"):
        _check_optimizer(sgd, model)
    adagrad = torch.optim.Adagrad(model.parameters(), lr=0.1)
    _check_optimizer(adagrad, model)
    _rebind(adagrad, before, model)
    assert len(adagrad.state) == 2


def test_an_optimizer_over_other_parameters_is_refused_by_name_not_a_keyerror():
    """A KeyError of an object id (``KeyError: 140635916955120``) was all a script's user saw."""
    from launcher.strategies.impl.fsdp import _check_optimizer

    model = torch.nn.Linear(2, 1)
    stray = torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.ones(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) that are not the model's"):
        _check_optimizer(stray, model)


def test_prepare_leaves_placing_to_fully_shard_which_moves_one_unit_at_a_time():
    """Under fsdp the whole model never sits on one GPU: prepare() does not move it before sharding, and
    fully_shard moves each unit to the mesh's device as it shards it. A scope on the meta device stands in for a GPU:
    the model reaches the strategy's _prepare where it was built; without the opt-out it arrived on meta."""
    from launcher.distribute.extended import StrategyExtended
    from launcher.distribute.strategy import Strategy
    from launcher.strategies.impl.fsdp import _FSDPExtended

    assert _FSDPExtended.places_itself
    seen = []

    class PlacesItself(StrategyExtended):
        places_itself = True

        def _prepare(self, module, optimizer):
            seen.append(next(module.parameters()).device.type)
            return module, optimizer

    strategy = Strategy(PlacesItself(["meta"]))
    with strategy.scope():
        strategy.prepare(torch.nn.Linear(2, 2))
    assert seen == ["cpu"]


class _WithBuffers(torch.nn.Module):
    """Layers, a buffer in the state dict, and one kept out of it (``persistent=False``: a rotary table, a mask)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.register_buffer("scale", torch.rand(4))
        self.register_buffer("table", torch.randn(3, 4), persistent=False)

    def forward(self, x):
        return self.second(self.first(x).relu()) * self.scale + self.table.sum(0)


def built_on_rank0(optimizer_name: str) -> dict:
    import torch.distributed as dist

    from launcher.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(wrap=["Linear"], device_type="cpu", init_from="rank0")
    torch.manual_seed(dist.get_rank())  # a rank's own seed would show if its values were its own
    with strategy.scope():
        model = _WithBuffers()
        before = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
        optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=0.1)
        try:
            model, optimizer = strategy.prepare(model, optimizer)
        except ValueError as exc:
            return {"error": str(exc)}
    values = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
              for name, t in [*model.named_parameters(), *model.named_buffers()]}
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    drawn = torch.rand(3)  # what a recipe draws after its model (its data, a split): rank 0's generator went on
    return {"before": before, "values": values, "sharded": type(model.first.weight).__name__, "drawn": drawn}


@pytest.mark.slow
def test_init_from_rank0_builds_on_meta_elsewhere_and_sends_rank0s_values():
    """strategy.init_from=rank0: rank 1 builds on the meta device (no host copy), then holds rank 0's values (seeded
    differently here, so its own would show), buffers kept out of the state dict too; it trains from there."""
    results = run_function(built_on_rank0, args=("AdamW",), device="cpu", nproc=2)
    assert set(results[0]["before"].values()) == {"cpu"} and set(results[1]["before"].values()) == {"meta"}
    torch.manual_seed(0)
    reference = _WithBuffers()
    expected = dict([*reference.named_parameters(), *reference.named_buffers()])
    assert torch.equal(results[0]["drawn"], results[1]["drawn"])
    for rank in (0, 1):
        assert results[rank]["sharded"] == "DTensor"
        for name, value in results[rank]["values"].items():
            assert torch.equal(value, expected[name].detach()), (rank, name)


@pytest.mark.slow
def test_init_from_rank0_refuses_an_optimizer_with_state_from_its_construction():
    results = run_function(built_on_rank0, args=("Adagrad",), device="cpu", nproc=2)
    for rank in (0, 1):
        assert "strategy.init_from=rank0: Adagrad made state when it was built" in results[rank]["error"]
        assert "use strategy.init_from=every_rank" in results[rank]["error"]


@pytest.mark.slow
def test_init_from_rank0_trains_bit_for_bit_as_every_rank_does(run_dlaunch):
    """The same seed, so the same values either way: rank 0's, sent, are what every rank would have built."""
    common = ("recipe=charlm", "strategy=fsdp", "cluster=1x2", "strategy.wrap=[TransformerEncoderLayer]",
              "trainer.steps=10", "trainer.checkpoint.every_steps=10", "recipe.sample_chars=0")
    proc, every = run_dlaunch(*common, name="every")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, rank0 = run_dlaunch(*common, "strategy.init_from=rank0", name="rank0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "built on rank 0, sent to the others" in proc.stdout
    from tests.checkpoint.test_resume import assert_bitwise_equal, final_state

    for a, b in zip(final_state(every), final_state(rank0)):
        assert_bitwise_equal(a, b)


@pytest.mark.slow
def test_a_fine_tune_loads_on_rank_0_keeps_its_frozen_layer_and_the_plan_counts_no_state_for_it(run_dlaunch, tmp_path):
    """A pretrained file loaded in build (docs/RECIPES.md, Fine-tuning) under init_from=rank0: the plan's meta build
    printed torch's "copying from a non-meta parameter ... is a no-op" once per tensor, and its memory row counted
    gradients and AdamW state for the frozen layer too."""
    from tests.checkpoint.test_resume import final_state
    from tests.fixtures import finetune_recipe

    torch.manual_seed(7)
    pretrained = finetune_recipe.model_for(finetune_recipe.Config(name="ft", entry="ft")).state_dict()
    torch.save(pretrained, tmp_path / "pretrained.pt")
    proc, run_dir = run_dlaunch(f"recipe.entry={finetune_recipe.__file__}", "recipe.optimizer.name=adamw",
                                "strategy=fsdp", "cluster=1x2", "strategy.init_from=rank0", "trainer.steps=6",
                                "trainer.checkpoint.every_steps=6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "non-meta parameter" not in out
    # 32x16 + 16 frozen (2,112 bytes), 16 + 1 trained (68 bytes): params 2,180 + grads 68 + AdamW 2 x 68 = 2,384
    assert "1/2 of DDP's 2,384 bytes (2,180 bytes parameters, 2,112 bytes of them frozen, AdamW: 2 state tensor(s) " \
           "per trained parameter" in out, out
    model, optim = final_state(run_dir)
    assert torch.equal(model["0.weight"], pretrained["0.weight"]) and torch.equal(model["0.bias"], pretrained["0.bias"])
    assert not torch.equal(model["2.weight"], pretrained["2.weight"])
    assert {key.split(".")[1] for key in optim if key.startswith("state.")} == {"2"}, list(optim)


def whole_weights_after_sharding() -> dict:
    """docs/MIGRATION.md's `unwrap_model` row under fsdp: every rank gathers the full state dict, rank 0 keeps it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from launcher.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(wrap=["Linear"], device_type="cpu")
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        plain = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model = strategy.prepare(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    own = model.state_dict()["0.weight"]
    return {"own": tuple(own.to_local().shape), "full": full if dist.get_rank() == 0 else None, "plain": plain}


@pytest.mark.slow
def test_the_whole_weights_of_a_sharded_model_load_into_a_plain_one():
    """Saving `model.state_dict()` from rank 0 under fsdp kept its shards only: DTensors of 16 of 32 rows."""
    results = run_function(whole_weights_after_sharding, device="cpu", nproc=2)
    assert results[0]["own"] == (16, 8)
    full, plain = results[0]["full"], results[0]["plain"]
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    fresh.load_state_dict(full)  # plain tensors, the whole shapes
    for key, value in plain.items():
        assert torch.equal(full[key], value), key


def test_the_memory_row_of_a_recipe_that_computes_on_its_data_as_it_builds(run_dlaunch):
    """charlm cuts its text into windows in build(): all of it on the meta device could not be (`Cannot copy out of
    meta tensor`), and the plan said `memory unknown` for a shipped recipe under a strategy it names."""
    proc, _ = run_dlaunch("recipe=charlm", "strategy=fsdp", "cluster=1x2", "launch.dry_run=true")
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, text[-2000:]
    assert "memory params + grads + optimizer state per rank: 1.0 MiB = 1/2 of DDP's 2.1 MiB" in text, text[-2000:]
