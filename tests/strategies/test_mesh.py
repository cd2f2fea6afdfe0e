"""MeshStrategy in real gloo processes: the device assignment, the three annotations, their ValueErrors, the tp_mlp equivalence."""

from __future__ import annotations

import pytest
import torch

from launcher.distribute.device_assignment import DeviceAssignment, Topology
from launcher.launch.function import run_function

pytestmark = pytest.mark.slow


def _strategy(computation_shape: list[int], num_replicas: int):
    import torch.distributed as dist  # noqa: F401 - the process group is joined by the strategy

    from launcher.strategies.mesh import MeshStrategy

    world = int(__import__("os").environ["WORLD_SIZE"])
    return MeshStrategy(DeviceAssignment.build(Topology.from_devices(world), computation_shape, num_replicas=num_replicas))


def seed_examples() -> dict:
    """The seed's 2 logical x 4 replicas ([1,1,1,2]) annotations, on 8 processes."""
    import torch.distributed as dist

    s = _strategy([1, 1, 1, 2], 4)
    rank = dist.get_rank()
    mine = torch.full((2, 3), float(rank))  # each logical device computed something different
    assigned = s.experimental_assign_to_logical_device(mine, 0)
    labels = s.experimental_replicate_to_logical_devices(torch.arange(4.0))
    images = torch.arange(2 * 4 * 6 * 3, dtype=torch.float32).reshape(2, 4, 6, 3)
    split = s.experimental_split_to_logical_devices(images, [1, 2, 1, 1])
    values = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    doubled = s.run(lambda v: v * 2, args=(values,))
    batch = next(iter(s.experimental_distribute_dataset([torch.arange(8)])))
    contexts = []
    from_fn_ds = s.distribute_datasets_from_function(lambda ctx: contexts.append(ctx) or [torch.tensor([ctx.input_pipeline_id])])
    from_fn = next(iter(from_fn_ds))
    context = from_fn_ds.input_contexts[0]
    return {
        "batch": s.experimental_local_results(batch)[0], "pipelines": (context.num_input_pipelines, context.input_pipeline_id),
        "calls": len(contexts),
        "from_fn": s.experimental_local_results(from_fn)[0],
        "replicas": s.num_replicas_in_sync, "logical": s.num_logical_devices, "logical_id": s.logical_device_id,
        "assigned": assigned.to_local(), "assigned_placements": str(assigned.placements),
        "labels": labels.to_local(), "split_local": split.to_local(), "split_shape": list(split.shape),
        "split_full": split.full_tensor(), "images": images,
        "sum_of_doubled": s.reduce("SUM", doubled, axis=None), "local": s.experimental_local_results(doubled)[0],
    }


def _saves_summary() -> tuple[bool, str, int]:
    strategy = _strategy([1, 1, 1, 2], 1)
    return strategy.extended.should_save_summary, strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id


def test_one_process_saves_the_summary_when_a_replica_spans_two():
    """One replica split over two processes: both are replica 0, and one alone writes the run's shared files. Each
    process's strategy has the job's resolver, as mirrored's has (it had None)."""
    assert run_function(_saves_summary, device="cpu", nproc=2) == {0: (True, "worker", 0), 1: (False, "worker", 1)}


def test_two_logical_devices_by_four_replicas_follow_the_seed():
    results = run_function(seed_examples, device="cpu", nproc=8)
    for rank, r in results.items():
        replica, logical = divmod(rank, 2)
        assert (r["replicas"], r["logical"], r["logical_id"]) == (4, 2, logical)
        assert torch.equal(r["assigned"], torch.full((2, 3), float(2 * replica)))  # logical device 0's value
        assert "Replicate" in r["assigned_placements"]
        assert torch.equal(r["labels"], torch.arange(4.0))
        assert r["split_shape"] == [2, 4, 6, 3]
        assert torch.equal(r["split_local"], r["images"][:, 2 * logical : 2 * logical + 2])  # dim 1 split 2 ways
        assert torch.equal(r["split_full"], r["images"])
        assert float(r["sum_of_doubled"]) == 2 * (0 + 1 + 2 + 3)  # one value per replica, reduced over replicas
        assert float(r["local"]) == 2 * replica
        assert r["batch"].tolist() == [2 * replica, 2 * replica + 1]  # the replica's share; its logical devices read the same
        assert r["pipelines"] == (4, replica) and r["from_fn"].tolist() == [replica]
        assert r["calls"] == (1 if logical == 0 else 0)  # dataset_fn once per replica: its logical device 0 reads


def eight_logical_devices() -> dict:
    """The seed's [1, 2, 2, 2] x 1 replica: an image batch split 2 x 4 over 8 logical devices, then a model on it."""
    s = _strategy([1, 2, 2, 2], 1)
    images = torch.arange(2 * 4 * 8 * 3, dtype=torch.float32).reshape(2, 4, 8, 3)
    split = s.experimental_split_to_logical_devices(images, [1, 2, 4, 1])
    pooled = split.sum(dim=(1, 2))  # a model step on the split tensor: partial sums combined by DTensor
    out = s.experimental_replicate_to_logical_devices(pooled)
    return {"local_shape": list(split.to_local().shape), "local": split.to_local(), "images": images,
            "out": out.to_local(), "logical": s.num_logical_devices, "replicas": s.num_replicas_in_sync}


def test_a_model_split_two_by_four_over_eight_logical_devices():
    results = run_function(eight_logical_devices, device="cpu", nproc=8)
    seen = set()
    for rank, r in results.items():
        assert (r["logical"], r["replicas"], r["local_shape"]) == (8, 1, [2, 2, 2, 3])
        seen.add(r["local"].flatten()[0].item())
        assert torch.equal(r["out"], r["images"].sum(dim=(1, 2)))
    assert len(seen) == 8  # every logical device holds a different block


def errors() -> dict:
    s = _strategy([1, 1, 1, 2], 1)
    found = {}
    for name, call in {
        "id": lambda: s.experimental_assign_to_logical_device(torch.ones(2), 2),
        "rank": lambda: s.experimental_split_to_logical_devices(torch.ones(4, 4), [2]),
        "product": lambda: s.experimental_split_to_logical_devices(torch.ones(4, 4), [2, 2]),
        "divisible": lambda: s.experimental_split_to_logical_devices(torch.ones(3, 4), [2, 1]),
    }.items():
        try:
            call()
            found[name] = "no error"
        except ValueError as exc:
            found[name] = str(exc)
    return found


def test_each_seed_value_error_says_what_is_wrong():
    for found in run_function(errors, device="cpu", nproc=2).values():
        assert found["id"].startswith("The logical device id presented is not consistent with total number of partitions "
                                      "specified by the device assignment.")  # the seed's ValueError, word for word
        assert "logical device id 2 is out of range" in found["id"] and "2 logical device(s), ids 0..1" in found["id"]
        assert "has 1 entries, but the tensor has rank 2" in found["rank"]
        assert "product of partition_dimensions [2, 2] is 4, but each replica has 2" in found["product"]
        assert "dimension 0 of the tensor (size 3) is not divisible by its partition 2" in found["divisible"]


def test_the_seed_value_errors_in_one_process_too():
    """The same errors where TPUStrategy() is one process of one logical device (no process group)."""
    from launcher import distribute as dl

    s = dl.TPUStrategy()
    with pytest.raises(ValueError, match=r"^The logical device id presented is not consistent with total number of "
                                         r"partitions specified by the device assignment\. \(logical device id 1 is out "
                                         r"of range: the device assignment gives each replica 1 logical device\(s\), ids 0\.\.0\)"):
        s.experimental_assign_to_logical_device(torch.ones(2), 1)
    with pytest.raises(ValueError, match=r"has 1 entries, but the tensor has rank 2"):
        s.experimental_split_to_logical_devices(torch.ones(4, 4), [2])
    with pytest.raises(ValueError, match=r"product of partition_dimensions \[2, 1\] is 2, but each replica has 1"):
        s.experimental_split_to_logical_devices(torch.ones(4, 4), [2, 1])


def tp_mlp_equivalence(logical: int, replicas: int) -> dict:
    """tp_mlp split over the logical devices vs the unsplit model on the same global batch: outputs, gradients, a step."""
    from launcher.recipes import tp_mlp

    s = _strategy([1, 1, 1, logical], replicas)
    cfg = tp_mlp.Config(name="tp_mlp", entry="launcher.recipes.tp_mlp", hidden=64)
    torch.manual_seed(0)
    plain = tp_mlp.MLP(cfg.features, cfg.hidden, cfg.outputs)
    torch.manual_seed(0)
    split = tp_mlp.tensor_parallel(tp_mlp.MLP(cfg.features, cfg.hidden, cfg.outputs), s.logical_mesh)
    x, y = torch.randn(8, cfg.features, generator=torch.Generator().manual_seed(3)), torch.randn(8, cfg.outputs)
    out = split(x)
    torch.nn.functional.mse_loss(out, y).backward()
    ref = plain(x)
    torch.nn.functional.mse_loss(ref, y).backward()
    grads = {n: (p.grad.full_tensor(), dict(plain.named_parameters())[n].grad) for n, p in split.named_parameters()}
    return {"out": (_plain(out), ref.detach()), "grads": grads, "sharded": str(split.fc1.weight.placements)}


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A collective's output as a plain tensor (RowwiseParallel returns one still in flight)."""
    wait = getattr(tensor, "wait", None)
    return (wait() if callable(wait) else tensor).detach().clone()


@pytest.mark.parametrize("logical,replicas", [(2, 1), (4, 1)])
def test_tp_mlp_outputs_and_gradients_equal_the_unsplit_model(logical, replicas):
    for r in run_function(tp_mlp_equivalence, device="cpu", nproc=logical * replicas, args=(logical, replicas)).values():
        torch.testing.assert_close(*r["out"], rtol=1e-5, atol=1e-6)
        for name, (got, want) in r["grads"].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
        assert "Shard(dim=0)" in r["sharded"]


def test_tp_mlp_trains_like_one_device_and_its_dtensor_checkpoints_reshard(run_dlaunch):
    """2 replicas x 2 logical devices (the default on 1x4) vs one device; then resume under other layouts."""
    from launcher.checkpoint import layout, read_tensors
    from tests.conftest import summary

    common = ("recipe=tp_mlp", "trainer.steps=40", "trainer.checkpoint.every_steps=20")
    proc, mesh_dir = run_dlaunch(*common, "strategy=mesh", "cluster=1x4", name="mesh")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no parameter of the model is split" not in proc.stdout + proc.stderr  # its layers are split
    proc, one_dir = run_dlaunch(*common, name="one")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(mesh_dir)
    assert s["num_replicas_in_sync"] == 2 and s["world_size"] == 4
    assert s["final_loss"] < 0.5 * s["first_loss"]
    assert s["metrics"]["eval_loss"] == pytest.approx(summary(one_dir)["metrics"]["eval_loss"], rel=1e-5)
    final = {name: read_tensors(layout.step_dir(d / "checkpoints", 40)) for name, d in (("mesh", mesh_dir), ("one", one_dir))}
    for key, value in final["one"].items():
        torch.testing.assert_close(final["mesh"][key], value, rtol=1e-5, atol=1e-6, msg=key)

    halfway = layout.step_dir(mesh_dir / "checkpoints", 20)
    for name, layout_args in (("four_logical", ("strategy=mesh", "cluster=1x4", "strategy.device_assignment.computation_shape=[1,1,1,4]")),
                              ("one_device", ())):
        proc, run_dir = run_dlaunch("recipe=tp_mlp", "trainer.steps=40", "trainer.checkpoint.every_steps=20",
                                    f"trainer.resume={halfway}", *layout_args, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert summary(run_dir)["resumed_from_step"] == 20
        resumed = read_tensors(layout.step_dir(run_dir / "checkpoints", 40))
        for key, value in final["mesh"].items():
            torch.testing.assert_close(resumed[key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tp_mlp_runs_on_cuda_with_nccl(run_dlaunch):
    from tests.conftest import summary

    proc, run_dir = run_dlaunch("recipe=tp_mlp", "strategy=mesh", "cluster=1x2", "cluster.device=cuda", "trainer.steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    assert (s["device"], s["backend"], s["world_size"]) == ("cuda", "nccl", 2)


def test_a_model_with_nothing_split_over_the_logical_devices_is_said_once(run_dlaunch):
    """linear under mesh (allowed by hand): each logical device held and computed the whole model, silently."""
    proc, _ = run_dlaunch("recipe=linear", "strategy=mesh", "cluster=1x2", "recipe.strategies=[mesh]", "trainer.steps=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = " ".join((proc.stdout + proc.stderr).split())
    assert text.count("mesh: no parameter of the model is split over the 2 logical devices of a replica") == 1, text
    assert "strategy=mirrored on the same devices trains 2 replicas instead" in text


def test_clipping_sees_the_replicas_average_and_counts_split_and_whole_layers_like_one_device(run_dlaunch):
    """grad_norm and the clipped updates under 2 replicas, and under 2 logical devices with a layer left whole,
    are one device's. Before: the replicas clipped their own gradients, and the mixed layouts stopped at step 1."""
    import json

    from tests.conftest import FIXTURES

    common = (f"recipe={FIXTURES / 'tp_mixed_recipe.py'}", "trainer.steps=6", "trainer.log_every=1", "trainer.clip_grad_norm=0.05")
    runs = {"one": (), "replicas": ("strategy=mesh", "cluster=1x2", "strategy.device_assignment.computation_shape=[1]"),
            "logical": ("strategy=mesh", "cluster=1x2", "strategy.device_assignment.computation_shape=[1,1,1,2]")}
    logged = {}
    for name, args in runs.items():
        proc, run_dir = run_dlaunch(*common, *args, name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        logged[name] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    one = [value for r in logged["one"] if "loss" in r for value in (r["loss"], r["grad_norm"])]
    assert all(norm > 0.05 for norm in one[1::2])  # every step is clipped
    for name in ("replicas", "logical"):
        got = [value for r in logged[name] if "loss" in r for value in (r["loss"], r["grad_norm"])]
        assert got == pytest.approx(one, rel=1e-5), name
