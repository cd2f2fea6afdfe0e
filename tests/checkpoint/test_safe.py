"""A checkpoint is data: a planted pickle fails with a clear error and never runs."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from launcher.checkpoint import CheckpointError, UnsafeCheckpoint, integrity, read_tensors
from launcher.checkpoint.safe import SafeReader
from tests.conftest import dlaunch


class Payload:
    """Unpickling this runs ``touch MARKER``: what an attacker would plant."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_plain(path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process": it is one
        dcp.save({"model": {"weight": torch.ones(2, 3)}, "note": [1, 2.5]}, checkpoint_id=str(path), no_dist=True)


def test_planted_metadata_pickle_is_refused_and_never_runs(tmp_path):
    save_plain(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        SafeReader(str(tmp_path / "ckpt")).read_metadata()
    assert not marker.exists()


def test_a_dotted_name_through_an_allowed_module_is_refused(tmp_path):
    save_plain(tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    # built by hand, as an attacker would: STACK_GLOBAL "torch.distributed.checkpoint.metadata" "torch.os.system"
    body = (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00"
            + b"\x8c" + bytes([len("torch.distributed.checkpoint.metadata")]) + b"torch.distributed.checkpoint.metadata\x94"
            + b"\x8c\x0ftorch.os.system\x94\x93\x94"
            + b"\x8c" + bytes([len(f"touch {marker}")]) + f"touch {marker}".encode() + b"\x94\x85\x94R\x94.")
    (tmp_path / "ckpt" / ".metadata").write_bytes(body)
    with pytest.raises(UnsafeCheckpoint, match="torch.os.system"):
        SafeReader(str(tmp_path / "ckpt")).read_metadata()
    assert not marker.exists()
    with open(tmp_path / "ckpt" / ".metadata", "rb") as fh:  # the same bytes do run under plain pickle
        pickle.load(fh)
    assert marker.exists()


def test_metadata_may_not_point_outside_the_checkpoint(tmp_path):
    save_plain(tmp_path / "ckpt")
    meta_path = tmp_path / "ckpt" / ".metadata"
    metadata = pickle.loads(meta_path.read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    meta_path.write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match="outside its checkpoint directory"):
        read_tensors(tmp_path / "ckpt")


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
    saved = run_dir / "checkpoints" / "step-00000005"
    (saved / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    manifest = json.loads((saved / "manifest.json").read_text())  # whoever plants a file can rewrite its checksum too
    manifest["files"][".metadata"] = {"size": (saved / ".metadata").stat().st_size, "sha256": integrity.digest(saved / ".metadata")}
    (saved / "manifest.json").write_text(json.dumps(manifest))
    proc = dlaunch("trainer.steps=10", *common, cwd=tmp_path)
    text = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2, text[-2000:]
    assert "trainer.resume" in text and "not checkpoint metadata" in text and "Traceback" not in text
    assert not marker.exists()
