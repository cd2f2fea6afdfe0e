"""A recipe's items that cannot be stacked: the field, the items, their shapes and the dataset's __getitem__."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from launcher.input.collate import CheckedCollate, UnstackableItems, first_difference


class Ragged(Dataset):
    """Item 3's features are one short."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.zeros(4 if i != 3 else 3), torch.tensor(i)


def test_the_first_field_whose_shape_differs_is_named_with_both_items():
    same = (torch.zeros(2), torch.tensor(1))
    assert first_difference([same, same]) is None
    found = first_difference([same, (torch.zeros(3), torch.tensor(1))])
    assert found == "field 0: item 1 of the batch is [3] (float32), item 0 is [2] (float32)"
    found = first_difference([{"x": torch.zeros(2)}, {"x": torch.zeros(2, dtype=torch.int64), "y": 1}])
    assert found == "field 'x': item 1 of the batch is [2] (int64), item 0 is [2] (float32)"
    assert first_difference([{"x": 1}, {"x": 1, "y": 2}]) == "item 1 of the batch has the fields [\"'x'\", \"'y'\"], item 0 [\"'x'\"]"
    assert first_difference([(torch.zeros(2), None), (torch.zeros(2), 1)]) == "field 1: item 1 of the batch is int, item 0 is NoneType"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_loader_of_ragged_items_names_the_datasets_getitem_and_the_shapes(workers):
    data = Ragged()
    loader = DataLoader(data, batch_size=8, num_workers=workers, collate_fn=CheckedCollate(None, data))
    with pytest.raises(UnstackableItems) as caught:
        next(iter(loader))
    message = str(caught.value)
    line = Ragged.__getitem__.__code__.co_firstlineno
    assert message.startswith(f"Ragged.__getitem__ (test_collate.py:{line}) returns items that cannot be stacked "
                              "into one batch: field 0: item 3 of the batch is [3] (float32), item 0 is [4] (float32)")
    assert "Original Traceback" not in message  # a loader worker's failure keeps the explanation, not torch's wrapping


def test_items_that_stack_are_batched_as_the_collate_batches_them():
    data = Ragged()
    batch = next(iter(DataLoader(data, batch_size=3, collate_fn=CheckedCollate(None, data))))
    assert batch[0].shape == (3, 4) and batch[1].tolist() == [0, 1, 2]


def test_a_failure_that_is_not_about_the_items_is_torchs_own():
    def broken(samples):
        raise ValueError("the recipe's own collate failed")

    with pytest.raises(ValueError, match="own collate failed"):
        CheckedCollate(broken, Ragged())([(torch.zeros(2),), (torch.zeros(2),)])


def test_a_run_whose_dataset_gives_ragged_items_says_so_once_without_torchs_frames(tmp_path):
    from pathlib import Path

    from tests.conftest import dlaunch

    linear = (Path(__file__).resolve().parents[2] / "recipes" / "linear.py").read_text()
    assert "train_data=train_data," in linear
    ragged = "class Ragged(torch.utils.data.Dataset):\n" \
             "    def __len__(self):\n        return 64\n" \
             "    def __getitem__(self, i):\n        return torch.zeros(4 - (i == 5)), torch.zeros(1)\n\n\n"
    (tmp_path / "mine.py").write_text(linear.replace("\ndef build(", f"\n{ragged}def build(", 1)
                                      .replace("train_data=train_data,", "train_data=Ragged(),", 1))
    proc = dlaunch("recipe=mine.py", "trainer.steps=2", "input.shuffle=false", "hydra.run.dir=run", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert out.count("UnstackableItems: Ragged.__getitem__ (mine.py:") == 1, out[-3000:]
    assert "field 0: item 5 of the batch is [3] (float32), item 0 is [4] (float32)" in out
    assert "collate.py" not in out and "Traceback" not in out
