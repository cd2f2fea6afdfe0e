"""``disk.unusable_dir``: why a directory cannot be made, asked of the real file system."""

from __future__ import annotations

import os

from launcher.config import disk


def test_a_directory_that_can_be_made_is_fine_and_nothing_is_left_behind(tmp_path):
    assert disk.unusable_dir(str(tmp_path / "a" / "b")) is None
    assert disk.unusable_dir(str(tmp_path)) is None
    assert sorted(os.listdir(tmp_path)) == []  # the probe's directory is gone, and nothing else was made


def test_a_file_in_the_way_is_named(tmp_path):
    (tmp_path / "f").write_text("")
    assert disk.unusable_dir(str(tmp_path / "f")) == f"{tmp_path / 'f'} exists and is not a directory"
    assert disk.unusable_dir(str(tmp_path / "f" / "x")) == f"{tmp_path / 'f'} is not a directory, so nothing can be made under it"


def test_a_file_system_that_holds_no_new_directory_is_named_though_it_looks_writable():
    """As root, /proc passes os.access; only making something there shows that it cannot be done."""
    why = disk.unusable_dir("/proc/dlaunch-nowhere")
    assert why is not None and why.startswith("cannot")


def test_only_the_part_before_an_interpolation_is_asked(tmp_path):
    assert disk.unusable_dir(str(tmp_path) + "/${hydra:job.num}") is None
    assert not any(tmp_path.iterdir())
