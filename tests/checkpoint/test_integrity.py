"""Verified checkpoints: sizes and sha256 in the manifest, damaged ones passed over for the newest intact one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from launcher import checkpoint
from launcher.checkpoint import Checkpointer, NoIntactCheckpoint, integrity, layout
from launcher.config.compose import compose_and_validate
from launcher.input.position import Position
from tests.checkpoint.test_layout import fake_save


def spec_for(*overrides):
    return compose_and_validate(["trainer.checkpoint.every_steps=5", "trainer.steps=40", *overrides], cuda_devices=0)


def save_steps(run_dir, *steps):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ckpt = Checkpointer(spec_for(), run_dir, rank=0)
    return [ckpt.save(step, Position(0, step), model, torch.optim.SGD(model.parameters(), lr=0.1)) for step in steps]


def data_file(path):
    return next(path.glob("*.distcp"))


def truncate(path):
    f = data_file(path)
    f.write_bytes(f.read_bytes()[:-7])


def flip_a_bit(path):
    f = data_file(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


def test_the_manifest_lists_every_file_with_its_size_and_sha256(tmp_path):
    (path,) = save_steps(tmp_path, 5)
    files = layout.read_manifest(path)["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(files) == on_disk and ".metadata" in files
    for name, record in files.items():
        assert record["size"] == (path / name).stat().st_size
        assert record["sha256"] == integrity.digest(path / name)
    assert layout.check(path) is None


def _edit_manifest(path, **changes):
    saved = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**saved, **changes}))


def _drop_from_manifest(path, *keys):
    saved = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({k: v for k, v in saved.items() if k not in keys}))


@pytest.mark.parametrize("damage,reason", [
    (truncate, r"__0_0\.distcp is \d+ bytes, the manifest says \d+ \(truncated\)"),
    (flip_a_bit, r"__0_0\.distcp does not match its sha256"),
    (lambda p: data_file(p).unlink(), r"__0_0\.distcp is missing"),
    (lambda p: (p / "manifest.json").unlink(), r"manifest\.json is missing"),
    (lambda p: (p / "manifest.json").write_text("{"), r"cannot read manifest\.json"),
    (lambda p: _edit_manifest(p, files={}), r"manifest\.json lists no \.metadata among its files"),
    (lambda p: _edit_manifest(p, step=36), r"manifest\.json says step 36, but its directory is step-00000040"),
    (lambda p: _drop_from_manifest(p, "files"), r"manifest\.json lists no files \(a save always does\)"),
])
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path, damage, reason):
    _, thirty, forty = save_steps(tmp_path, 20, 30, 40)
    damage(forty)
    choice = layout.choose(tmp_path / "checkpoints")
    assert choice.path == thirty
    (where, why), = choice.skipped
    assert where == forty
    assert re.search(reason, why), why


def test_latest_naming_a_deleted_step_falls_back_with_the_reason(tmp_path):
    root = tmp_path / "checkpoints"
    _, thirty = save_steps(tmp_path, 20, 30)
    (root / "latest").write_text("step-00000050\n")
    choice = layout.choose(root)
    assert choice.path == thirty
    assert [(p.name, why) for p, why in choice.skipped] == [("step-00000050", "latest names it, but it does not exist")]


def test_sizes_only_checks_miss_a_flipped_bit_but_not_a_truncation(tmp_path):
    (path,) = save_steps(tmp_path, 5)
    flip_a_bit(path)
    assert layout.check(path, full=False) is None
    assert "sha256" in layout.check(path, full=True)
    truncate(path)
    assert "truncated" in layout.check(path, full=False)


def test_digests_are_computed_by_threads_at_once_and_a_late_flipped_bit_is_found(tmp_path, monkeypatch):
    """Eight ranks' files: two digests must be under way together (the barrier breaks if they run one by one),
    and a bit flipped in the last file is named."""
    import threading

    for rank in range(8):
        (tmp_path / f"__{rank}_0.distcp").write_bytes(bytes(range(256)) * 64 * (rank + 1))
    files = integrity.fingerprint(tmp_path)
    together, digest = threading.Barrier(2, timeout=30), integrity.digest

    def observed(path, stop=None):
        if path.name in ("__0_0.distcp", "__1_0.distcp"):
            together.wait()
        return digest(path, stop)

    monkeypatch.setattr(integrity, "_READERS", 2)
    monkeypatch.setattr(integrity, "digest", observed)
    assert integrity.damage(tmp_path, files) is None
    last = tmp_path / "__7_0.distcp"
    data = bytearray(last.read_bytes())
    data[-1] ^= 1
    last.write_bytes(bytes(data))
    together.reset()
    assert integrity.damage(tmp_path, files) == "__7_0.distcp does not match its sha256 (its bytes changed after the save)"


def test_when_every_checkpoint_is_damaged_select_lists_them_all(tmp_path):
    paths = save_steps(tmp_path, 10, 20)
    truncate(paths[0])
    (paths[1] / "manifest.json").unlink()
    with pytest.raises(NoIntactCheckpoint) as caught:
        checkpoint.select(spec_for(), tmp_path)
    assert [p for p, _ in caught.value.skipped] == [paths[1], paths[0]]
    assert "trainer.resume=never" in str(caught.value)


def test_a_named_damaged_checkpoint_is_an_error_not_a_fallback(tmp_path):
    _, forty = save_steps(tmp_path, 30, 40)
    flip_a_bit(forty)
    with pytest.raises(checkpoint.CheckpointError, match="cannot be resumed from: .*sha256"):
        checkpoint.select(spec_for(f"trainer.resume={forty}"), tmp_path)


def test_a_checkpoint_saved_before_checksums_still_loads(tmp_path):
    """Such a manifest has no files and no lr_decay either (recorded since 2026-11-24; files since 11-23)."""
    path = fake_save(tmp_path, 5)
    _drop_from_manifest(path, "files", "lr_decay")
    assert layout.check(path) is None
    (path / ".metadata").unlink()
    assert layout.check(path) == ".metadata is missing"


def test_resume_with_never_sets_damaged_checkpoints_aside(tmp_path):
    root = tmp_path / "checkpoints"
    (forty,) = save_steps(tmp_path, 40)
    (forty / "manifest.json").unlink()
    moved = layout.set_aside_after(root, 0)
    assert [p.name.split(".")[1] for p in moved] == ["superseded-step-00000040"]
    assert layout.choose(root) == layout.Choice(None)  # and `latest` no longer names it


def test_setting_aside_repoints_a_latest_that_named_a_missing_step(tmp_path):
    root = tmp_path / "checkpoints"
    _, thirty = save_steps(tmp_path, 20, 30)
    (root / "latest").write_text("step-00000050\n")
    layout.set_aside_after(root, 30)  # what the run resuming from step 30 does first
    assert (root / "latest").read_text() == "step-00000030\n"
    assert layout.choose(root) == layout.Choice(thirty)


def _read_back_in(root: str) -> dict:
    """Each rank writes its own DCP-named file in a directory of its own, then the collective read-back."""
    import torch.distributed as dist

    from launcher.checkpoint import _read_back
    from launcher.cluster.env import WorkerEnv
    from launcher.cluster.process_group import ensure_process_group

    ensure_process_group(WorkerEnv.from_environ(), device_type="cpu")
    rank = dist.get_rank()
    mine = Path(root) / f"rank{rank}"
    mine.mkdir()
    (mine / f"__{rank}_0.distcp").write_bytes(bytes([rank]) * (1000 + rank))
    (mine / f"__{rank}_1.distcp").write_bytes(b"second file")
    return {"found": _read_back(mine, rank)}


@pytest.mark.slow
def test_each_rank_reads_back_its_own_files_and_rank_0_gathers_them(tmp_path):
    """Two real gloo processes, each seeing only its own directory: rank 0's records of rank 1's files can only have
    come from rank 1 (a save's digests take 1/N of the time)."""
    from launcher.launch.function import run_function

    results = run_function(_read_back_in, args=(str(tmp_path),), device="cpu", nproc=2)
    assert results[1]["found"] is None
    found = results[0]["found"]
    assert sorted(found) == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}" / f"__{rank}_0.distcp"
        assert found[path.name] == {"size": 1000 + rank, "sha256": integrity.digest(path)}


@pytest.mark.slow
def test_a_two_rank_save_lists_every_file_with_the_digest_of_its_bytes(run_dlaunch):
    proc, run_dir = run_dlaunch("strategy=mirrored", "cluster=1x2", "trainer.steps=4", "trainer.checkpoint.every_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = layout.latest(run_dir / "checkpoints")
    files = layout.read_manifest(path)["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files)
    assert sorted(files) == sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    for name, record in files.items():
        assert record == {"size": (path / name).stat().st_size, "sha256": integrity.digest(path / name)}


def test_a_digest_no_longer_needed_stops_within_a_chunk(tmp_path):
    import threading

    path = tmp_path / "__0_0.distcp"
    path.write_bytes(bytes(3 * integrity._CHUNK))
    stop = threading.Event()
    assert integrity.digest(path, stop) == integrity.digest(path)
    stop.set()
    with pytest.raises(integrity.Abandoned):
        integrity.digest(path, stop)
