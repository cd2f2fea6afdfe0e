"""TensorRows: a TensorDataset read a batch at a time loads what the row-at-a-time DataLoader loads."""

import torch
from torch.utils.data import DataLoader, TensorDataset

from launcher.config.compose import compose_and_validate
from launcher.input.distributed_dataset import _local_loader
from launcher.input.position import EpochBatchSampler
from launcher.input.tensor_rows import TensorRows, already_batched, batched_reads
from launcher.runtime.train_input import global_batches


def _data(n: int = 50) -> TensorDataset:
    """Rows of three shapes and dtypes, one of them a permuted view (images kept NHWC, read as NCHW)."""
    g = torch.Generator().manual_seed(0)
    nhwc = torch.randn(n, 4, 5, 3, generator=g)
    return TensorDataset(nhwc.permute(0, 3, 1, 2), torch.randint(0, 9, (n,), generator=g), torch.arange(n).double())


def _same(a, b) -> bool:
    return type(a) is type(b) and len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.is_contiguous() and torch.equal(x, y) for x, y in zip(a, b))


def _both(data, make_sampler, **kw):
    """Each loader gets its own sampler: an EpochBatchSampler moves to the next epoch at each iter()."""
    rows, collate = batched_reads(data)
    return (list(DataLoader(data, batch_sampler=make_sampler(), **kw)),
            list(DataLoader(rows, batch_sampler=make_sampler(), collate_fn=collate, **kw)))


def test_the_batches_are_the_row_wise_ones_bit_for_bit_with_a_partial_last_one():
    by_row, by_batch = _both(_data(), lambda: EpochBatchSampler(50, 16, shuffle=True, seed=3, drop_last=False))
    assert len(by_row) == len(by_batch) == 4 and len(by_batch[-1][0]) == 2
    assert all(_same(a, b) for a, b in zip(by_row, by_batch))
    assert isinstance(by_batch[0], list)  # as default_collate gives
    assert by_batch[0][0].view(16, -1).shape == (16, 60)  # contiguous, as a stack is, though the data is a permuted view


def test_loader_workers_load_the_same_batches():
    by_row, by_batch = _both(_data(), lambda: [[4, 9, 1], [0, 2, 3]], num_workers=2)
    assert len(by_row) == len(by_batch) == 2
    assert all(_same(a, b) for a, b in zip(by_row, by_batch))


def test_a_process_with_no_rows_of_the_last_batch_loads_its_first_row_as_the_pad():
    """12 rows in batches of 8 over 2 replicas: replica 1's share of the last batch (4 rows) is empty, so its process
    loads that batch's first row, which its replica steps on at weight 0 (launcher.input.split.Step's pad)."""
    data = _data(12)
    rows, collate = batched_reads(data)
    for replica, expected, padded in ((0, [4, 4], False), (1, [4, 1], True)):
        plain, _ = _local_loader(DataLoader(data, batch_sampler=EpochBatchSampler(12, 8, False, drop_last=False)), replica, 1, 2)
        fast, _ = _local_loader(DataLoader(rows, batch_sampler=EpochBatchSampler(12, 8, False, drop_last=False),
                                           collate_fn=collate), replica, 1, 2)
        got_plain, got_fast = list(plain), list(fast)
        assert len(got_plain) == len(got_fast) == 2
        assert all(_same(a, b) for a, b in zip(got_plain, got_fast))
        assert [len(b[0]) for b in got_fast] == expected
        assert list(fast.batch_sampler.global_rows) == [(8, False), (4, padded)]  # each global batch's rows; a pad?
    assert torch.equal(got_fast[1][2], torch.tensor([8.0], dtype=torch.float64))  # the last batch's first row


def test_only_a_plain_tensor_dataset_is_read_by_batch():
    class Doubled(TensorDataset):
        def __getitem__(self, index):
            return tuple(2 * t[index] for t in self.tensors)

    data = Doubled(torch.arange(4))
    assert batched_reads(data) == (data, None)
    assert isinstance(batched_reads(_data())[0], TensorRows) and batched_reads(_data())[1] is already_batched


def test_dlaunch_builds_its_loader_of_a_tensor_dataset_that_way():
    spec = compose_and_validate(["input.global_batch_size=16"], cuda_devices=0)
    loader = global_batches(_data(), spec)
    assert isinstance(loader.dataset, TensorRows)
    s = loader.batch_sampler
    row_wise = DataLoader(_data(), batch_sampler=EpochBatchSampler(s.num_examples, s.batch_size, s.shuffle, s.seed, s.drop_last))
    got, expected = list(loader), list(row_wise)
    assert len(got) == len(expected) == 3 and all(_same(a, b) for a, b in zip(got, expected))
