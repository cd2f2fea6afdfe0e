"""trainer.pretrained: a run's first weights from a checkpoint or a file (launcher/checkpoint/weights.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from launcher.checkpoint import CheckpointError, read_tensors, weights
from launcher.launch.function import run_function


class Opaque:
    """An object a weights-only load refuses."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _pretrained() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {k: torch.randn_like(v) for k, v in _model().state_dict().items()}


def _dcp(path: Path, tensors: dict[str, torch.Tensor], prefix: str = "model") -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({prefix: tensors} if prefix else dict(tensors), checkpoint_id=str(path), no_dist=True)
    return path


def test_the_names_and_shapes_decide_what_loads():
    here = {"a": (2, 3), "b": (4,), "head": (10, 4)}
    found = weights.match(here, {"a": (2, 3), "b": (4,), "head": (5, 4), "extra": (1,)})
    assert found.load == ["a", "b"] and found.unexpected == ["extra"] and found.mismatched == [("head", (5, 4), (10, 4))]
    strict = found.problem(strict=True)
    assert strict.startswith("2 of the model's 3 tensors match it (1 only in it: extra; 1 of another shape: "
                             "head [5, 4] there, [10, 4] here)")
    assert "trainer.pretrained.strict=false" in strict
    assert found.problem(strict=False) is None
    assert found.said() == "2 of the model's 3 tensors; kept as built: head; not used: extra"
    nothing = weights.match(here, {"other": (1,)})
    assert nothing.problem(strict=False).startswith("none of the model's 3 tensors is in it by name and shape")


def test_a_plain_module_loads_a_file_and_a_dcp_checkpoint_exactly(tmp_path):
    source = _pretrained()
    torch.save(source, tmp_path / "plain.pt")
    torch.save({"state_dict": source, "epoch": 3}, tmp_path / "wrapped.pt")  # Lightning's and others' layout
    for path in (tmp_path / "plain.pt", tmp_path / "wrapped.pt", _dcp(tmp_path / "dcp", source),
                 _dcp(tmp_path / "flat", source, prefix="")):  # another tool's DCP: the model's names alone
        model = _model()
        found = weights.load(path, model, strict=True)
        assert found.load == list(source) and not (found.missing or found.unexpected or found.mismatched)
        for name, value in model.state_dict().items():
            assert torch.equal(value, source[name]), (path.name, name)


def test_strict_false_keeps_a_new_heads_values_as_built(tmp_path):
    source = {k: v for k, v in _pretrained().items() if not k.startswith("2.")}  # the body without its head
    source["2.weight"] = torch.zeros(7, 16)  # another number of classes
    torch.save(source, tmp_path / "body.pt")
    model, built = _model(), _model().state_dict()
    with pytest.raises(CheckpointError, match=r"2 of the model's 4 tensors match it \(1 not in it: 2.bias; "):
        weights.load(tmp_path / "body.pt", model, strict=True)
    found = weights.load(tmp_path / "body.pt", model, strict=False)
    assert found.load == ["0.weight", "0.bias"]
    assert torch.equal(model.state_dict()["0.weight"], source["0.weight"])
    assert torch.equal(model.state_dict()["2.weight"], built["2.weight"])  # kept: build()'s values


def test_each_kind_of_source_is_found_or_refused_by_name(tmp_path):
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="junk.pt is not a torch.save file"):
        weights.saved_shapes(tmp_path / "junk.pt")
    torch.save({"model": Opaque()}, tmp_path / "objects.pt")
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors, which are not loaded \(weights_only=True\)"):
        weights.saved_shapes(tmp_path / "objects.pt")
    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "numbers.pt")
    with pytest.raises(CheckpointError, match="holds a dict with keys epoch, lr, not a state dict"):
        weights.saved_shapes(tmp_path / "numbers.pt")
    with pytest.raises(CheckpointError, match="does not exist"):
        weights.source(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"empty: it holds no checkpoint \(a run that saved to its own "):
        weights.source(str(tmp_path / "empty"))


def test_a_run_directory_gives_its_newest_intact_checkpoint(run_dlaunch, tmp_path):
    proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=20", "trainer.checkpoint.every_steps=10", name="pre")
    assert proc.returncode == 0, proc.stderr[-2000:]
    newest = run_dir / "checkpoints" / "step-00000020"
    assert weights.source(str(run_dir)) == newest
    assert weights.source(str(run_dir / "checkpoints")) == newest
    (newest / "manifest.json").write_text(json.dumps({**json.loads((newest / "manifest.json").read_text()), "step": 7}))
    assert weights.source(str(run_dir)) == run_dir / "checkpoints" / "step-00000010"  # the damaged one passed over
    with pytest.raises(CheckpointError, match="step-00000020 cannot be loaded: manifest.json says step 7"):
        weights.source(str(newest))


def test_a_fine_tune_starts_from_the_pretrained_weights_with_a_fresh_optimizer(run_dlaunch, tmp_path):
    proc, pre = run_dlaunch("recipe=linear", "trainer.steps=20", "trainer.checkpoint.every_steps=20", name="pre")
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch.save(read_tensors(pre / "checkpoints" / "step-00000020"), tmp_path / "pre.pt")
    first = {}
    for name, source in (("dir", str(pre)), ("file", str(tmp_path / "pre.pt")), ("fresh", None)):
        given = [f"trainer.pretrained.path={source}"] if source else []
        proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=3", "trainer.log_every=1", *given, name=name)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        first[name] = records[0]["loss"]
        out = " ".join((proc.stdout + proc.stderr).split())
        if source:
            assert "pretrained: from " in out and ": 2 of the model's 2 tensors" in out and "Traceback" not in out
            assert f"pretrained {source}: its model weights before step 0" in out  # the plan's row
            assert records[0]["step"] == 1 and records[0]["lr"] == pytest.approx(0.05)
    assert first["dir"] == first["file"]  # the same weights, from a checkpoint or a file
    assert first["dir"] < first["fresh"] / 3  # the pretrained start: 5.67 against 34.3 (seed 0)


@pytest.mark.parametrize("shape", [(), ("strategy=mirrored", "cluster=1x2")])
def test_a_resumed_fine_tune_goes_on_with_its_own_weights(run_dlaunch, tmp_path, shape):
    """Across processes the workers' spec named the checkpoint to resume from beside the pretrained path, which
    they refused (a new-user pass: a fine-tune under mirrored or fsdp could never be resumed)."""
    source = _pretrained_linear(tmp_path)
    args = ("recipe=linear", *shape, f"trainer.pretrained.path={source}", "trainer.checkpoint.every_steps=2")
    proc, run_dir = run_dlaunch(*args, "trainer.steps=4", name="ft")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, _ = run_dlaunch(*args, "trainer.steps=6", name="ft")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, out[-2000:]
    assert "pretrained not used: the run resumes from step-00000004, its own weights" in out
    assert "pretrained:" not in out and "resumed from" in out


def _pretrained_linear(tmp_path: Path) -> Path:
    torch.manual_seed(3)
    path = tmp_path / "linear.pt"
    torch.save({"weight": torch.randn(1, 32), "bias": torch.randn(1)}, path)
    return path


@pytest.mark.parametrize("extra, says", [
    (("recipe.hidden=128",), "1 of the model's 4 tensors match it (3 of another shape: fc1.weight [256, 32] there, "
                             "[128, 32] here, fc1.bias [256] there, [128] here and 1 more)"),
    (("trainer.resume=never", "trainer.pretrained.strict=false", "recipe.features=16", "recipe.hidden=64",
      "recipe.outputs=2"), "none of the model's 4 tensors is in it by name and shape"),
])
def test_a_source_that_does_not_fit_the_model_stops_before_anything_starts(run_dlaunch, tmp_path, extra, says):
    proc, pre = run_dlaunch("recipe=tp_mlp", "trainer.steps=2", "trainer.checkpoint.every_steps=2", name="pre")
    assert proc.returncode == 0, proc.stderr[-2000:]
    source = pre / "checkpoints" / "step-00000002"
    proc, run_dir = run_dlaunch("recipe=tp_mlp", f"trainer.pretrained.path={source}", *extra, name="ft")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in text, proc.stderr[-2000:]
    assert "trainer.pretrained.path = " in text and says in text
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_partial_match_is_said_in_the_plan_with_strict_false(run_dlaunch, tmp_path):
    proc, pre = run_dlaunch("recipe=tp_mlp", "trainer.steps=2", "trainer.checkpoint.every_steps=2", name="pre")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, _ = run_dlaunch("recipe=tp_mlp", f"trainer.pretrained.path={pre}", "recipe.hidden=128",
                          "trainer.pretrained.strict=false", "launch.dry_run=true", name="ft")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, out[-2000:]
    assert f"pretrained: from {pre / 'checkpoints' / 'step-00000002'}: 1 of the model's 4 tensors; kept as built: " \
           "fc1.weight, fc1.bias, fc2.weight" in out
    assert "(tensors that match; the rest as build() made them); a fresh optimizer" in out


def _shard_and_load(pt: str, checkpoint: str) -> dict:
    """FSDP2 over 2 ranks: a whole-tensor file and a DCP checkpoint, each loaded into the shards; the whole model back."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from launcher.checkpoint.state import unwrap
    from launcher.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(wrap=["Linear"], device_type="cpu")
    with strategy.scope():
        model = _model()
        model, _ = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out = {}
    for name, path in (("pt", pt), ("dcp", checkpoint)):
        weights.load(Path(path), model, strict=True)
        out[name] = {k: v.full_tensor() for k, v in get_model_state_dict(unwrap(model)).items()}  # every shard gathered
        out["sharded"] = type(next(model.parameters())).__name__
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return out


@pytest.mark.slow
def test_fsdp_shards_load_a_whole_file_and_a_checkpoint_exactly(tmp_path):
    source = _pretrained()
    torch.save(source, tmp_path / "pre.pt")
    _dcp(tmp_path / "dcp", source)
    results = run_function(_shard_and_load, nproc=2, args=(str(tmp_path / "pre.pt"), str(tmp_path / "dcp")), device="cpu")
    for rank, r in results.items():
        assert r["sharded"] == "DTensor"
        for kind in ("pt", "dcp"):
            for name, value in source.items():
                assert torch.equal(r[kind][name], value), (rank, kind, name)


def test_a_flat_dcp_checkpoint_of_a_model_with_a_model_submodule_is_read_by_its_names(tmp_path):
    """Hugging Face's layout (`.model`, `.lm_head`) saved with its plain names: the `model.` prefix was taken for
    dlaunch's and stripped, and nothing matched (a diff review)."""
    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.lm_head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)

    torch.manual_seed(5)
    saved = {k: torch.randn_like(v) for k, v in Wrapped().state_dict().items()}
    model = Wrapped()
    found = weights.load(_dcp(tmp_path / "hf", saved, prefix=""), model, strict=True)
    assert sorted(found.load) == sorted(saved)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_a_file_torch_cannot_read_is_refused_by_name_not_with_a_traceback(tmp_path):
    """dlaunch's own `latest` pointer (an easy mistake), an empty file, a YAML file: torch's weights-only unpickler
    raised IndexError there, a traceback and exit 1 (a diff review)."""
    for name, text in (("latest", "step-00000020"), ("empty.pt", ""), ("conf.yaml", "a: [1, 2]\n")):
        (tmp_path / name).write_text(text)
        with pytest.raises(CheckpointError, match=f"{name} (cannot be read as a torch.save file|is not a torch.save file)"):
            weights.saved_shapes(tmp_path / name)


def test_a_safetensors_file_gives_its_shapes_from_its_header_and_loads(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    source = _pretrained()
    safetensors.save_file(source, str(tmp_path / "pre.safetensors"))
    assert weights.saved_shapes(tmp_path / "pre.safetensors") == {k: tuple(v.shape) for k, v in source.items()}
    model = _model()
    weights.load(tmp_path / "pre.safetensors", model, strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())


def test_a_checkpoint_of_the_runs_own_directory_is_refused_where_its_saves_would_set_it_aside(run_dlaunch):
    proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=4", "trainer.checkpoint.every_steps=2", name="own")
    assert proc.returncode == 0, proc.stderr[-2000:]
    own = run_dir / "checkpoints" / "step-00000002"
    proc, _ = run_dlaunch("recipe=linear", "trainer.steps=4", "trainer.checkpoint.every_steps=2", "trainer.resume=never",
                          f"trainer.pretrained.path={own}", name="own")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "a checkpoint of this run's own directory, which this run's saves set aside" in text


def _agree_on(directory: str) -> str:
    import torch.distributed as dist

    from launcher.strategies.fsdp import FSDPStrategy

    FSDPStrategy(wrap=["Linear"], device_type="cpu")  # joins the workers' process group

    try:
        weights.agree(Path(directory) / f"step-0000000{dist.get_rank()}")  # each node chose its own newest
    except CheckpointError as exc:
        return str(exc)
    return "agreed"


def test_ranks_that_chose_different_sources_stop_before_loading(tmp_path):
    """Each node's dlaunch resolves a directory to its newest checkpoint itself; a run still saving there could give
    the nodes different steps, and they trained on from different weights without an error (a diff review)."""
    said = run_function(_agree_on, nproc=2, args=(str(tmp_path),), device="cpu")
    assert all(text.startswith("trainer.pretrained: the nodes chose different sources") for text in said.values()), said


def test_a_wrappers_prefix_is_dropped_where_the_models_names_then_match(tmp_path):
    """A LightningModule's checkpoint holds `model.`-prefixed names under `state_dict`, a DDP module's `module.`: both
    matched nothing (a new-user pass)."""
    source = _pretrained()
    torch.save({"state_dict": {f"model.{k}": v for k, v in source.items()}, "epoch": 3}, tmp_path / "lightning.ckpt")
    torch.save({f"module._orig_mod.{k}": v for k, v in source.items()}, tmp_path / "ddp.pt")
    for name in ("lightning.ckpt", "ddp.pt"):
        model = _model()
        assert weights.load(tmp_path / name, model, strict=True).load == list(source)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items()), name
    assert weights.as_model_names({"model.a": 1, "model.b": 2}, ["model.a", "model.b"])[1] == ""  # already the model's


def test_dlaunchs_latest_pointer_names_the_checkpoint_it_points_at(run_dlaunch):
    proc, run_dir = run_dlaunch("recipe=linear", "trainer.steps=4", "trainer.checkpoint.every_steps=2", name="pre")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert weights.source(str(run_dir / "checkpoints" / "latest")) == run_dir / "checkpoints" / "step-00000004"


class _Tied(torch.nn.Module):
    """A decoder's output head tied to its embedding: one tensor under two names."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("kind", ["pt", "dcp"])
def test_a_tied_model_from_an_untied_source_takes_the_first_names_value_and_says_so(tmp_path, caplog, kind):
    """The order of the load decided which name's value the one tensor kept, and nothing was said."""
    torch.manual_seed(0)
    source = {k: v.clone() for k, v in _Tied().state_dict().items()}
    same = tmp_path / "same.pt"
    torch.save(source, same)
    source["head.weight"] = torch.randn(10, 4)  # trained untied
    path = tmp_path / "untied.pt"
    torch.save(source, path) if kind == "pt" else _dcp(path, source)
    model = _Tied()
    weights.load(path, model, strict=True)
    assert model.head.weight is model.embed.weight and torch.equal(model.embed.weight, source["embed.weight"])
    assert "holds other values for head.weight (tied to embed.weight)" in caplog.text
    caplog.clear()
    weights.load(same, _Tied(), strict=True)
    assert "tied" not in caplog.text
