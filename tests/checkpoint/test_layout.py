"""The checkpoint directory: atomic commits, the latest marker, retention, unfinished saves."""

from __future__ import annotations

import pytest

from launcher.checkpoint import CheckpointError, layout


def fake_manifest(step):
    """A manifest with every key resuming reads (the values do not matter to the layout)."""
    return {"format": 1, "step": step, "data_position": {}, "world_size": 1, "num_replicas": 1, "strategy": "one_device",
            "cluster": "1x1", "global_batch_size": 1, "per_replica_batch_size": 1, "input": {}, "recipe": {}}


def fake_save(root, step, keep=3, complete=True):
    partial = layout.partial_dir(root, step)
    partial.mkdir(parents=True)
    (partial / ".metadata").write_bytes(b"meta")
    (partial / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    if complete:
        return layout.commit(partial, fake_manifest(step), keep)
    return partial


def test_latest_moves_only_with_a_complete_checkpoint(tmp_path):
    fake_save(tmp_path, 5)
    assert layout.latest(tmp_path) == layout.step_dir(tmp_path, 5)
    fake_save(tmp_path, 10, complete=False)  # killed midway through the save
    assert layout.latest(tmp_path) == layout.step_dir(tmp_path, 5)
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    layout.clean_partials(tmp_path)
    assert not layout.partial_dir(tmp_path, 10).exists()


def test_keep_prunes_the_oldest(tmp_path):
    for step in (5, 10, 15, 20):
        fake_save(tmp_path, step, keep=2)
    assert [p.name for p in layout.complete_steps(tmp_path)] == ["step-00000015", "step-00000020"]


def test_a_lost_latest_marker_falls_back_to_the_newest_complete(tmp_path):
    fake_save(tmp_path, 5)
    fake_save(tmp_path, 10)
    (tmp_path / "latest").write_text("garbage\n")
    assert layout.latest(tmp_path) == layout.step_dir(tmp_path, 10)


def test_a_garbled_latest_marker_falls_back_to_the_newest_complete(tmp_path):
    fake_save(tmp_path, 5)
    fake_save(tmp_path, 10)
    (tmp_path / "latest").write_bytes(b"\x00\xffjunk")  # not even text
    assert layout.latest(tmp_path) == layout.step_dir(tmp_path, 10)


@pytest.mark.parametrize("garbled", [b"step-000\x0010\xff", b"garbage\n", b""], ids=["flipped bits", "text", "empty"])
def test_a_garbled_latest_marker_is_reported_and_the_run_that_resumes_names_its_start(tmp_path, garbled):
    """It was passed over without a word, though docs/RELIABILITY.md says it is reported."""
    fake_save(tmp_path, 5)
    fake_save(tmp_path, 10)
    (tmp_path / "latest").write_bytes(garbled)
    choice = layout.choose(tmp_path)
    assert choice.path == layout.step_dir(tmp_path, 10)
    ((path, why),) = choice.skipped
    assert path == tmp_path / "latest" and f"the marker is garbled (it holds {garbled!r}, not a step-N name)" in why
    layout.set_aside_after(tmp_path, 10)  # the run that resumes from step 10
    assert (tmp_path / "latest").read_text() == "step-00000010\n" and not layout.choose(tmp_path).skipped


def test_a_step_committed_when_latest_could_not_follow_is_resumed_from(tmp_path):
    """The disk filled up between a step's commit and the write of ``latest``: the committed step wins."""
    fake_save(tmp_path, 5)
    fake_save(tmp_path, 10)
    (tmp_path / "latest").write_text("step-00000005\n")
    assert layout.choose(tmp_path).path == layout.step_dir(tmp_path, 10) and not layout.choose(tmp_path).skipped


def test_resume_choices(tmp_path):
    assert layout.resolve("never", tmp_path).path is None
    assert layout.resolve("auto", tmp_path).path is None  # nothing saved yet: start afresh
    fake_save(tmp_path, 5)
    assert layout.resolve("auto", tmp_path).path == layout.step_dir(tmp_path, 5)
    assert layout.resolve(str(tmp_path), tmp_path / "elsewhere").path == layout.step_dir(tmp_path, 5)
    assert layout.resolve(str(layout.step_dir(tmp_path, 5)), tmp_path).path == layout.step_dir(tmp_path, 5)
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        layout.resolve(str(tmp_path / "missing"), tmp_path)


def test_manifest_must_be_dlaunch_json(tmp_path):
    path = fake_save(tmp_path, 5)
    (path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a dlaunch checkpoint manifest"):
        layout.read_manifest(path)


def test_saving_a_step_again_replaces_it_in_one_rename(tmp_path):
    first = fake_save(tmp_path, 5)
    (first / "old-copy").write_text("x")
    again = fake_save(tmp_path, 5)
    assert again == first and not (again / "old-copy").exists()
    assert not list(tmp_path.glob(".*.replaced"))


def test_a_copy_set_aside_by_a_commit_that_died_before_its_rename_is_put_back(tmp_path, monkeypatch):
    """Saving step 5 again moves the old step-5 aside, then renames the new one in: killed between the two renames,
    the old copy must not be cleaned away with the unfinished save (step 5 would be gone)."""
    import os

    fake_save(tmp_path, 5)
    real_replace, calls = os.replace, []

    def dies_on_the_second_rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process is killed here
        real_replace(src, dst)

    monkeypatch.setattr(layout.os, "replace", dies_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        fake_save(tmp_path, 5)
    monkeypatch.setattr(layout.os, "replace", real_replace)
    assert not layout.step_dir(tmp_path, 5).exists() and list(tmp_path.glob(".*.replaced"))
    assert layout.choose(tmp_path).path == layout.step_dir(tmp_path, 5)  # what a resume picks
    layout.clean_partials(tmp_path)  # what the next save does first
    assert layout.latest(tmp_path) == layout.step_dir(tmp_path, 5)
    assert not list(tmp_path.glob(".*.replaced")) and not list(tmp_path.glob(".*.partial"))


def test_latest_names_only_a_checkpoint_beside_it(tmp_path):
    fake_save(tmp_path / "elsewhere", 9)
    fake_save(tmp_path / "root", 5)
    (tmp_path / "root" / "latest").write_text("../elsewhere/step-00000009\n")
    assert layout.latest(tmp_path / "root") == layout.step_dir(tmp_path / "root", 5)


def test_later_checkpoints_of_a_replaced_timeline_are_set_aside(tmp_path):
    for step in (5, 10, 15):
        fake_save(tmp_path, step)
    moved = layout.set_aside_after(tmp_path, 5)
    assert [p.name.split(".")[1] for p in moved] == ["superseded-step-00000010", "superseded-step-00000015"]
    assert [p.name for p in layout.complete_steps(tmp_path)] == ["step-00000005"]


def test_a_manifest_without_the_keys_resuming_reads_is_refused(tmp_path):
    path = fake_save(tmp_path, 5)
    (path / "manifest.json").write_text('{"step": 5, "recipe": "linear"}')
    with pytest.raises(CheckpointError, match="missing or mistyped: format, data_position"):
        layout.read_manifest(path)


def test_a_latest_marker_that_cannot_be_written_leaves_the_saved_step_saved(tmp_path, monkeypatch, caplog):
    fake_save(tmp_path, 5)

    def full(step, marker="latest"):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout, "_point", full)
    fake_save(tmp_path, 10)  # committed; only the marker failed
    assert "step-00000010 is saved, but the latest marker could not follow it" in caplog.text
    assert (tmp_path / "latest").read_text().strip() == "step-00000005"
    assert layout.latest(tmp_path) == layout.choose(tmp_path).path == layout.step_dir(tmp_path, 10)
