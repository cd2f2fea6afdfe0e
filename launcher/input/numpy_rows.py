"""``NumpyRows``: what ``strategy.experimental_make_numpy_dataset`` returns, a dataset of array rows.

As ``tf.data.Dataset.from_tensor_slices``: every element is one row (index along
dim 0) of each array of the nest; a list of arrays is stacked first, as TF does::

    dataset = NumpyRows(np.ones([10], dtype=np.float32))
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)     # dataset.batch(2)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.distribute.values import map_structure


class NumpyRows(Dataset):
    """Rows of a nest (tuples, dicts) of NumPy arrays, as tensors sharing the arrays' memory."""

    def __init__(self, numpy_input: Any):
        if isinstance(numpy_input, list):
            numpy_input = np.stack(numpy_input)
        self.tensors = map_structure(lambda a: torch.as_tensor(np.asarray(a)), numpy_input)
        lengths: set[int] = set()
        map_structure(lambda t: lengths.add(int(t.shape[0]) if t.dim() else -1), self.tensors)
        if len(lengths) != 1 or -1 in lengths:
            raise ValueError(f"numpy_input must be arrays of one length along dim 0, got lengths {sorted(lengths)}")
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return map_structure(lambda t: t[index], self.tensors)
