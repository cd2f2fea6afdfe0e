"""Seeking the input: the batches after a position are the ones an uninterrupted stream gives."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

from launcher import distribute as dl
from launcher.input.files import FileDataset, write_shards
from launcher.input.position import DataStream, EpochBatchSampler, Position


def take(stream, n):
    return [b for b in itertools.islice(stream, n)]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(torch.utils.data.default_collate(a), torch.utils.data.default_collate(b)))


def test_epoch_sampler_regenerates_any_epoch():
    sampler = EpochBatchSampler(10, 4, shuffle=True, seed=3, drop_last=True)
    first, second = list(sampler), list(sampler)
    assert len(first) == len(sampler) == 2 and first != second
    sampler.set_position(Position(1, 1))
    assert list(sampler) == second[1:]
    assert sorted(sum(list(EpochBatchSampler(10, 4, False, 0, drop_last=False)), [])) == list(range(10))


def loader(n=40, batch=8):
    data = TensorDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))
    return DataLoader(data, batch_sampler=EpochBatchSampler(n, batch, shuffle=True, seed=0))


def test_stream_seek_matches_an_uninterrupted_stream():
    strategy = dl.OneDeviceStrategy("cpu:0")
    straight = DataStream(strategy.experimental_distribute_dataset(loader()))
    expected = take(straight, 13)  # 5 batches per epoch: crosses two epoch boundaries
    assert straight.position == Position(2, 3)
    resumed = DataStream(strategy.experimental_distribute_dataset(loader()))
    resumed.seek(Position(1, 2))
    got = take(resumed, 6)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected[7:]))
    assert resumed.position == Position(2, 3)


def test_seek_on_file_shards(tmp_path):
    files = write_shards({"x": torch.arange(24, dtype=torch.float32).unsqueeze(1)}, tmp_path, 3, "pt")
    make = lambda: FileDataset(tuple(map(str, files)), "pt").batch(4).shuffle(1)  # noqa: E731
    strategy = dl.OneDeviceStrategy("cpu:0")
    expected = take(DataStream(strategy.experimental_distribute_dataset(make())), 10)
    resumed = DataStream(strategy.experimental_distribute_dataset(make()))
    resumed.seek(Position(1, 1))
    got = take(resumed, 3)
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, expected[7:]))


def test_a_plain_iterable_is_replayed():
    batches = [torch.full((2,), float(i)) for i in range(5)]
    stream = DataStream(batches)
    stream.seek(Position(1, 3))
    assert [float(b[0]) for b in take(stream, 4)] == [3.0, 4.0, 0.0, 1.0]


def test_data_smaller_than_one_global_batch_says_what_to_change():
    import pytest

    from launcher.input.position import NoBatch

    strategy = dl.OneDeviceStrategy("cpu:0")
    data = TensorDataset(torch.arange(3, dtype=torch.float32).unsqueeze(1))
    def stream(**kw):
        return DataStream(strategy.experimental_distribute_dataset(
            DataLoader(data, batch_sampler=EpochBatchSampler(3, 8, shuffle=False, seed=0, drop_last=True))), **kw)

    with pytest.raises(NoBatch, match=r"lower input.global_batch_size, or set input.drop_remainder=false") as caught:
        next(iter(stream()))
    assert caught.value.explained
    with pytest.raises(NoBatch, match=r"^the 3 rows of the training data are fewer than one global batch "
                                      r"\(input.global_batch_size=8\).*use input.global_batch_size=3 or less, or "
                                      r"input.drop_remainder=false"):
        next(iter(stream(global_batch_size=8)))


def test_a_run_whose_data_is_smaller_than_one_global_batch_names_the_rows_and_the_batch(tmp_path):
    """3000 rows under input.global_batch_size=4000: NoBatch said only "smaller than one global batch"."""
    from tests.conftest import dlaunch

    proc = dlaunch("recipe.examples=3000", "input.global_batch_size=4000", "strategy=mirrored", "cluster=1x2",
                   "trainer.steps=2", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1, out[-3000:]
    assert ("NoBatch: the 3000 rows of the training data are fewer than one global batch (input.global_batch_size=4000), "
            "and input.drop_remainder=true drops a partial batch: no step would have a batch; use "
            "input.global_batch_size=3000 or less (a multiple of 2: replicas x trainer.grad_accum_steps), or "
            "input.drop_remainder=false") in out, out[-3000:]


def test_an_iterables_own_batch_size_is_counted_and_said_once(caplog):
    """A recipe's iterable of 10-row batches under input.global_batch_size=32: examples/s counts 10 rows a step."""
    strategy = dl.MirroredStrategy(["cpu:0", "cpu:1"])
    batches = [torch.arange(10, dtype=torch.float32).unsqueeze(1) + 10 * i for i in range(4)]
    stream = DataStream(strategy.experimental_distribute_dataset(batches), global_batch_size=32)
    assert stream.rows_per_batch == 32  # nothing read yet: as configured
    with caplog.at_level("WARNING", logger="dlaunch"):
        take(stream, 6)  # over an epoch's end: still one warning
    said = [r.getMessage() for r in caplog.records if "global batch" in r.getMessage()]
    assert said == ["the training data's first global batch holds 10 rows, input.global_batch_size says 32: the recipe's "
                    "iterable makes its own batches; examples/s counts 10 per step (set input.global_batch_size=10 to match)"]
    assert stream.rows_per_batch == 10


def test_the_advice_for_an_iterables_own_batch_size_is_a_setting_the_config_accepts(caplog):
    """51-row batches on 2 replicas: input.global_batch_size=51 is refused (not divisible by 2), so it is not advised."""
    from launcher.config import compose as composer

    batches = [torch.zeros(51, 1) for _ in range(2)]
    stream = DataStream(dl.MirroredStrategy(["cpu:0", "cpu:1"]).experimental_distribute_dataset(batches),
                        global_batch_size=64, batch_multiple=2)
    with caplog.at_level("WARNING", logger="dlaunch"):
        take(stream, 1)
    (said,) = [r.getMessage() for r in caplog.records if "global batch" in r.getMessage()]
    assert "input.global_batch_size=51" not in said
    assert said.endswith("input.global_batch_size must be a multiple of 2 (replicas x trainer.grad_accum_steps), which 51 "
                         "is not: to match, make the iterable's batches 50 or 52 rows and set input.global_batch_size to that")
    for advised in (50, 52):
        composer.compose_and_validate(["strategy=mirrored", "cluster=1x2", f"input.global_batch_size={advised}"], cuda_devices=0)


def test_batches_of_the_configured_size_are_not_remarked_on(caplog):
    strategy = dl.OneDeviceStrategy("cpu:0")
    with caplog.at_level("WARNING", logger="dlaunch"):
        stream = DataStream(strategy.experimental_distribute_dataset(loader()), global_batch_size=8)
        take(stream, 3)
    assert stream.rows_per_batch == 8 and not [r for r in caplog.records if "global batch" in r.getMessage()]


def test_a_resume_at_an_epochs_last_partial_batch_cuts_no_later_batch():
    """One replica keeps an epoch's last, partial batch (drop_remainder=false); a resume that starts there must not
    take its size for the global batch's."""
    def partial_loader():
        data = TensorDataset(torch.arange(10, dtype=torch.float32).unsqueeze(1))
        return DataLoader(data, batch_sampler=EpochBatchSampler(10, 4, shuffle=True, seed=0, drop_last=False))

    strategy = dl.OneDeviceStrategy("cpu:0")
    expected = take(DataStream(strategy.experimental_distribute_dataset(partial_loader())), 6)  # 4, 4, 2, 4, 4, 2 rows
    resumed = DataStream(strategy.experimental_distribute_dataset(partial_loader()))
    resumed.seek(Position(0, 2))
    got = take(resumed, 4)
    assert [len(b[0]) for b in got] == [2, 4, 4, 2]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected[2:]))


def test_element_spec_does_not_move_a_seekable_sampler_on():
    for strategy in (dl.OneDeviceStrategy("cpu:0"), dl.MirroredStrategy(["cpu:0", "cpu:1"])):
        expected = take(DataStream(strategy.experimental_distribute_dataset(loader())), 1)
        dataset = strategy.experimental_distribute_dataset(loader())
        assert dataset.element_spec is not None
        got = take(DataStream(dataset), 1)
        parts = [[t for part in strategy.experimental_local_results(step[0]) for t in part] for step in (got, expected)]
        assert all(torch.equal(a, b) for a, b in zip(*parts)), type(strategy).__name__


def test_a_loader_whose_batches_hold_other_than_batch_size_rows_is_not_cut():
    """A pre-batched dataset (each item 8 rows, batch_size=1, a collate that unwraps): its batches are 8 rows."""
    items = [torch.full((8, 1), float(i)) for i in range(4)]
    unwrapped = DataLoader(items, batch_size=1, collate_fn=lambda batch: batch[0])
    got = take(DataStream(dl.OneDeviceStrategy("cpu:0").experimental_distribute_dataset(unwrapped)), 2)
    assert [tuple(b.shape) for b in got] == [(8, 1), (8, 1)]


def test_a_recipes_plain_loader_is_read_in_a_seekable_order_with_its_own_settings():
    """DataLoader(shuffle=True) draws each epoch's order from the global RNG as the epoch starts: a resumed run cannot
    draw it again, so dlaunch reads such a loader through an EpochBatchSampler (input.seed + epoch)."""
    from torch.utils.data import RandomSampler

    from launcher.input.position import seekable_loader

    data = TensorDataset(torch.arange(10.0))
    collate = lambda rows: torch.stack([r[0] for r in rows])  # noqa: E731
    for shuffle in (True, False):
        plain = DataLoader(data, batch_size=4, shuffle=shuffle, drop_last=False, collate_fn=collate)
        loader = seekable_loader(plain, seed=3)
        sampler = loader.batch_sampler
        assert isinstance(sampler, EpochBatchSampler) and (sampler.shuffle, sampler.seed, sampler.batch_size) == (shuffle, 3, 4)
        assert loader.collate_fn is collate and [len(b) for b in loader] == [4, 4, 2]  # drop_last=False kept
        sampler.set_position(Position(2, 1))  # seeks without reading epochs 0 and 1
        order = [float(i) for i in EpochBatchSampler(10, 4, shuffle, 3, False).order(2)]
        assert [b.tolist() for b in loader] == [order[4:8], order[8:]]
    from torch.utils.data import BatchSampler

    given = seekable_loader(DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 3, drop_last=True)), seed=3)
    assert (given.batch_sampler.batch_size, given.batch_sampler.drop_last, len(given)) == (3, True, 3)
    kept = [DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1)),  # its own order
            DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True)),
            DataLoader(data, batch_sampler=[[0, 1], [2, 3]]), [torch.zeros(2)]]
    assert all(seekable_loader(other, seed=3) is other for other in kept)


def test_a_one_shot_source_that_runs_out_says_so_not_that_it_is_small():
    """A generator of 3 batches under trainer.steps=5 said "it is smaller than one global batch ... set
    input.drop_remainder=false", which was neither the cause nor a fix."""
    import pytest

    from launcher.input.position import NoBatch

    strategy = dl.OneDeviceStrategy("cpu:0")
    stream = DataStream(strategy.experimental_distribute_dataset(torch.full((4,), float(i)) for i in range(3)), 4)
    assert [float(b[0]) for b in take(stream, 3)] == [0.0, 1.0, 2.0]
    with pytest.raises(NoBatch, match=r"^the training data ran out: its pass 1 gave 3 batch\(es\), and the next gives "
                                      r"none \(an iterator, such as a generator, cannot start over\); make train_data "
                                      r"re-iterable .*or set trainer.steps to the batches it has$"):
        next(stream)


def test_an_iterable_whose_second_pass_is_empty_says_its_iter_does_not_start_over():
    import pytest

    from launcher.input.position import NoBatch

    class Once:
        def __init__(self):
            self.batches = [torch.ones(2), torch.ones(2)]

        def __iter__(self):
            batches, self.batches = self.batches, []
            return iter(batches)

    stream = DataStream(dl.OneDeviceStrategy("cpu:0").experimental_distribute_dataset(Once()))
    take(stream, 2)
    with pytest.raises(NoBatch, match=r"pass 1 gave 2 batch\(es\), and the next gives none \(its __iter__ does not start over\)"):
        next(stream)


def test_a_random_sampler_of_the_recipes_own_draws_the_same_order_on_every_rank_whatever_the_global_rng():
    """SubsetRandomSampler drew each epoch from the global RNG: a rank-0-only evaluation that drew from it (dropout
    left on) moved rank 0's alone, and the ranks' shares of each global batch overlapped (rows 5 and 6 twice, 0 and
    3 never). Each rank's loader now has a generator seeded with input.seed."""
    from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

    from launcher.input.position import seekable_loader

    def order(make_sampler, rng_seed):
        torch.manual_seed(rng_seed)  # a rank whose global RNG went elsewhere
        loader = seekable_loader(DataLoader(TensorDataset(torch.arange(8)), batch_size=4, sampler=make_sampler()), seed=3)
        return [[int(v) for v in b[0]] for _ in range(2) for b in loader]

    for make in (lambda: SubsetRandomSampler(range(8)), lambda: WeightedRandomSampler([1.0] * 8, 8)):
        assert order(make, 0) == order(make, 1)
    assert sorted(sum(order(lambda: SubsetRandomSampler(range(8)), 0)[:2], [])) == list(range(8))


def test_a_long_replay_says_how_far_it_is(caplog, monkeypatch):
    """A stream that cannot seek is read from its start on a resume: minutes of silence on a large one."""
    import logging

    from launcher.input import position

    stream = DataStream([torch.full((2,), float(i)) for i in range(5)])
    real = position._Replay.__init__
    monkeypatch.setattr(position._Replay, "__init__", lambda self, target: real(self, target, every_s=0.0))  # each batch
    with caplog.at_level(logging.INFO, logger="dlaunch"):
        stream.seek(Position(1, 2))
    assert "replaying the training data: 7 batch(es) read, now in epoch 1 (to reach epoch 1, batch 2)" in caplog.text
    assert "replayed 7 batch(es) in" in caplog.text
    assert [float(b[0]) for b in take(stream, 1)] == [2.0]


def test_a_stream_of_no_length_is_read_on_to_a_step_across_passes():
    """A parameter-server worker resumes at the chief's global step; with a stream of no length (each worker's own
    part of one) that was Position(0, step), past the end of the first pass: the worker failed."""
    class Passes:  # re-iterable, no __len__
        def __iter__(self):
            return iter([torch.full((2,), float(i)) for i in range(3)])

    stream = DataStream(Passes())
    stream.seek_step(5)
    assert [float(b[0]) for b in take(stream, 2)] == [2.0, 0.0] and stream.position.epoch == 2
    sized = DataStream([torch.full((2,), float(i)) for i in range(3)])
    sized.seek_step(5)
    assert [float(b[0]) for b in take(sized, 1)] == [2.0]


def test_a_dataset_fn_that_returns_a_generator_is_said_to_be_one_shot():
    import pytest

    from launcher.input.position import NoBatch

    strategy = dl.OneDeviceStrategy("cpu:0")
    stream = DataStream(strategy.distribute_datasets_from_function(lambda ctx: (torch.ones(2) for _ in range(2))))
    take(stream, 2)
    with pytest.raises(NoBatch, match=r"gave 2 batch\(es\), and the next gives none \(an iterator, such as a generator"):
        next(stream)
