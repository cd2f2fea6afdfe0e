"""Splitting a global batch across replicas (launcher.input.split)."""

import collections

import pytest
import torch

from launcher.input.split import Step, batch_size_of, like, replica_sizes, rows_for_replica, slice_batch, split_batch

Example = collections.namedtuple("Example", "x y")


def test_full_batch_of_8_over_2_replicas():
    first, second = split_batch(torch.arange(8), range(2), 2)
    assert torch.equal(first, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(second, torch.tensor([4, 5, 6, 7]))


def test_last_partial_batch_of_6_keeps_the_full_per_replica_size():
    first, second = split_batch(torch.arange(6), range(2), 2, global_batch_size=8)
    assert torch.equal(first, torch.tensor([0, 1, 2, 3]))
    assert torch.equal(second, torch.tensor([4, 5]))


def test_a_replica_may_get_no_rows():
    pieces = split_batch(torch.arange(3), range(4), 4, global_batch_size=8)
    assert [p.tolist() for p in pieces] == [[0, 1], [2], [], []]


def test_without_global_batch_size_the_batch_itself_is_split_evenly():
    first, second = split_batch(torch.arange(6), range(2), 2)
    assert first.tolist() == [0, 1, 2] and second.tolist() == [3, 4, 5]


def test_split_of_a_subset_of_replicas():
    (third,) = split_batch(torch.arange(8), range(2, 3), 4)
    assert third.tolist() == [4, 5]


def test_replica_sizes_are_as_even_as_tf_rebatches_them():
    assert replica_sizes(8, 2) == [4, 4]
    assert replica_sizes(51, 2) == [26, 25]
    assert replica_sizes(7, 4) == [2, 2, 2, 1]
    assert replica_sizes(6, 4) == [2, 2, 1, 1]  # not ceil's [2, 2, 2, 0]
    assert replica_sizes(1, 4) == [1, 0, 0, 0]


def test_a_batch_that_does_not_divide_is_split_as_evenly_as_tf_does():
    assert [p.tolist() for p in split_batch(torch.arange(6), range(4), 4)] == [[0, 1], [2, 3], [4], [5]]
    first, second = split_batch(torch.arange(51), range(2), 2)
    assert (len(first), len(second)) == (26, 25)


def test_a_last_partial_batch_fills_the_replicas_in_order_with_their_sizes():
    pieces = split_batch(torch.arange(1), range(2), 2, global_batch_size=51)
    assert [p.tolist() for p in pieces] == [[0], []]
    pieces = split_batch(torch.arange(5), range(4), 4, global_batch_size=6)
    assert [p.tolist() for p in pieces] == [[0, 1], [2, 3], [4], []]


def test_rows_for_replica_are_clipped_to_the_batch():
    assert rows_for_replica(0, [4, 4, 4], 6) == (0, 4)
    assert rows_for_replica(1, [4, 4, 4], 6) == (4, 6)
    assert rows_for_replica(2, [4, 4, 4], 6) == (6, 6)


def test_a_split_says_the_global_batchs_rows_and_copies_keep_them():
    step = split_batch(torch.arange(6), range(1, 2), 2, global_batch_size=8)
    assert isinstance(step, Step) and step.rows == 6 and step[0].tolist() == [4, 5]
    assert like([torch.zeros(2)], step).rows == 6
    assert type(like([1], [2])) is list  # a plain list of pieces stays one


def test_nests_are_split_leafwise_and_keep_their_types():
    batch = {"ex": Example(torch.arange(4), torch.arange(4) * 10), "meta": "tag", "scalar": torch.tensor(7)}
    first, second = split_batch(batch, range(2), 2)
    assert type(first["ex"]) is Example
    assert first["ex"].y.tolist() == [0, 10] and second["ex"].x.tolist() == [2, 3]
    assert first["meta"] == "tag"
    assert torch.equal(second["scalar"], torch.tensor(7))  # 0-d tensors are not sliced


def test_slice_batch_of_a_list_batch():
    assert [t.tolist() for t in slice_batch([torch.arange(5)], 1, 3)] == [[1, 2]]


def test_batch_size_of_a_nest():
    assert batch_size_of((torch.zeros(5, 2), {"y": torch.zeros(5)}, torch.tensor(1.0))) == 5


def test_batch_size_of_mismatched_leading_dimensions_raises():
    with pytest.raises(ValueError, match="share its first dimension"):
        batch_size_of((torch.zeros(5), torch.zeros(4)))


def test_batch_size_of_a_batch_without_tensors_raises():
    with pytest.raises(ValueError, match=r"needs a tensor with a first \(batch\) dimension; this element has none"):
        batch_size_of({"a": 1})


def test_an_unbatched_element_goes_whole_to_one_replica_and_is_refused_by_two():
    """central_storage_strategy.txt distributes experimental_make_numpy_dataset(np.ones([10])) unbatched: with one
    replica TF passes each scalar through; two replicas cannot split one, and are told to batch the dataset."""
    step = split_batch(torch.tensor(1.0), range(1), 1)
    assert step == [torch.tensor(1.0)] and step.rows is None
    with pytest.raises(ValueError, match=r"this element has none \(tensor\(1\.\)\): batch the dataset by the global batch "
                                         r"size, e\.g\. DataLoader\(dataset, batch_size=GLOBAL_BATCH_SIZE\)"):
        split_batch(torch.tensor(1.0), range(2), 2)
