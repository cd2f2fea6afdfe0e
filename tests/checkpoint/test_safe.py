"""A checkpoint is data: a planted pickle fails with a clear error and never runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from launcher.checkpoint import CheckpointError, UnsafeCheckpoint, read_tensors
from launcher.checkpoint.safe import SafeReader
from tests.conftest import dlaunch


class Payload:
    """Unpickling this runs ``touch MARKER``: what an attacker would plant."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_plain(path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"weight": torch.ones(2, 3)}, "note": [1, 2.5]}, checkpoint_id=str(path), no_dist=True)


def test_planted_metadata_pickle_is_refused_and_never_runs(tmp_path):
    save_plain(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        SafeReader(str(tmp_path / "ckpt")).read_metadata()
    assert not marker.exists()


def test_planted_data_pickle_is_refused_and_never_runs(tmp_path):
    save_plain(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    data = next((tmp_path / "ckpt").glob("*.distcp"))
    data.write_bytes(pickle.dumps(Payload(marker)) * 8)
    with pytest.raises(CheckpointError):
        read_tensors(tmp_path / "ckpt")
    assert not marker.exists()


def test_plain_checkpoints_still_load(tmp_path):
    save_plain(tmp_path / "ckpt")
    assert torch.equal(read_tensors(tmp_path / "ckpt")["weight"], torch.ones(2, 3))


@pytest.mark.slow
def test_dlaunch_refuses_a_planted_pickle_before_starting(tmp_path):
    run_dir = tmp_path / "run"
    common = ("trainer.checkpoint.every_steps=5", "recipe.examples=640", f"hydra.run.dir={run_dir}")
    assert dlaunch("trainer.steps=5", *common, cwd=tmp_path).returncode == 0
    marker = tmp_path / "pwned"
    (run_dir / "checkpoints" / "step-00000005" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    proc = dlaunch("trainer.steps=10", *common, cwd=tmp_path)
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2, text[-2000:]
    assert "trainer.resume" in text and "not checkpoint metadata" in text and "Traceback" not in text
    assert not marker.exists()
