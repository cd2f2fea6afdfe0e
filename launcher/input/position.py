"""Where the input stands: (epoch, batches delivered in that epoch), and how to get back there.

A checkpoint records the position; a resumed run seeks to it and sees exactly
the batches the interrupted run would have seen next. Seeking is cheap where
the order is a function of (seed, epoch): ``EpochBatchSampler`` (what dlaunch
builds for a map-style dataset, and reads a recipe's plain shuffling ``DataLoader``
through: ``seekable_loader``) and file-backed datasets skip index lists, not
data. Any other iterable is replayed batch by batch from its start.

Example::

    sampler = EpochBatchSampler(len(dataset), batch_size=64, shuffle=True, seed=0)
    stream = DataStream(strategy.experimental_distribute_dataset(DataLoader(dataset, batch_sampler=sampler)))
    stream.seek(Position(epoch=1, offset=8))   # the 9th batch of the second epoch comes next
    batch = next(stream)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Iterator

import torch

log = logging.getLogger("dlaunch")


@dataclasses.dataclass(frozen=True)
class Position:
    """``offset`` batches of epoch ``epoch`` have been delivered."""

    epoch: int = 0
    offset: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class EpochBatchSampler:
    """Global batches of indices; epoch ``e`` is shuffled with ``seed + e``, so any epoch can be regenerated.

    Each ``iter()`` is the next epoch (as a ``DataLoader`` calls it); ``set_position``
    makes the next ``iter()`` start at a given epoch and offset.
    """

    def __init__(self, num_examples: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        self.num_examples, self.batch_size = num_examples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self._next = Position()

    def set_position(self, position: Position) -> None:
        self._next = position

    @property
    def position(self) -> Position:
        """Where the next ``iter()`` starts."""
        return self._next

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_examples))
        return torch.randperm(self.num_examples, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        position, self._next = self._next, Position(self._next.epoch + 1, 0)
        order = self.order(position.epoch)
        for start in range(position.offset * self.batch_size, self._usable(), self.batch_size):
            yield order[start : start + self.batch_size]

    def _usable(self) -> int:
        return self.num_examples - self.num_examples % self.batch_size if self.drop_last else self.num_examples

    def __len__(self) -> int:
        return -(-self._usable() // self.batch_size)


def seekable_loader(loader: Any, seed: int) -> Any:
    """A recipe's plain ``DataLoader(dataset, batch_size=B, shuffle=...)`` read through an ``EpochBatchSampler`` (epoch
    ``e`` shuffled with ``seed + e``), with the loader's own settings. Its ``RandomSampler`` without a generator draws
    each epoch's order from the global RNG as the epoch starts, so a resumed run, which cannot draw those numbers
    again, replayed every batch before its position and then trained on other batches. Now a resume seeks, as with
    a dataset returned as it is, and finds the same order. Any other loader (a sampler of its own, a seeded
    generator, with replacement) keeps its order, and a resume replays it (``_own_generator``)."""
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

    if type(loader) is not DataLoader or type(loader.batch_sampler) is not BatchSampler:
        return loader
    sampler = loader.batch_sampler.sampler
    if type(sampler) is RandomSampler:
        if sampler.generator is not None or sampler.replacement or sampler.num_samples != len(loader.dataset):
            return _own_generator(loader, seed)
    elif type(sampler) is not SequentialSampler:
        return _own_generator(loader, seed)
    given = loader.batch_sampler  # batch_size=B makes it; batch_sampler=BatchSampler(...) leaves loader.batch_size None
    batches = EpochBatchSampler(len(loader.dataset), given.batch_size, type(sampler) is RandomSampler, seed, given.drop_last)
    extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers} if loader.num_workers else {}
    return DataLoader(
        loader.dataset, batch_sampler=batches, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        # the workers' base seed, drawn at each iter(): from a generator of the loader's, not the global RNG
        generator=loader.generator if loader.generator is not None else torch.Generator().manual_seed(seed), **extra,
    )


def _own_generator(loader: Any, seed: int) -> Any:
    """torch's random samplers that draw from the global RNG (no generator given) get one seeded with ``seed``: every
    rank must draw the same order, and a rank-0-only evaluation that draws from the global RNG (dropout left on)
    moved rank 0's alone, after which the ranks' shares overlapped and rows went unseen."""
    from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

    sampler = loader.batch_sampler.sampler
    if type(sampler) in (RandomSampler, SubsetRandomSampler, WeightedRandomSampler) and sampler.generator is None:
        sampler.generator = torch.Generator().manual_seed(seed)
    return loader


class _Replay:
    """Progress of a resume's replay, said every ``every_s`` seconds (a stream read from its start takes a while)."""

    def __init__(self, target: Position, every_s: float = 30.0):
        self.target, self.every_s, self.read = target, every_s, 0
        self.started = self.last = time.monotonic()

    def tick(self, epoch: int) -> None:
        self.read += 1
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            log.info("replaying the training data: %d batch(es) read, now in epoch %d (to reach epoch %d, batch %d)",
                     self.read, epoch, self.target.epoch, self.target.offset)

    def done(self) -> None:
        if self.last != self.started:  # said at least once: say the end too
            log.info("replayed %d batch(es) in %.0f s", self.read, time.monotonic() - self.started)


class NoBatch(ValueError):
    """The training data is smaller than one global batch."""

    explained = True  # the message says what to change: dlaunch's frames add nothing


class DataStream:
    """Batches epoch after epoch, counting the position; ``seek`` resumes at a position.

    ``dataset`` is iterated once per epoch. If it is ``seekable`` (dlaunch's
    distributed datasets over files or an ``EpochBatchSampler`` are) the seek is
    delegated to its ``set_position``; otherwise the batches before
    the position are read and dropped: exact only if the iterable gives the same
    batches each time it is iterated (a ``DataLoader`` with a ``RandomSampler``
    reshuffles from the global RNG, so it is not).

    ``read_ahead``: steps that ``read_ahead()`` fetches after a step (see there).
    ``position`` counts the batches handed out, not those fetched ahead.
    """

    def __init__(self, dataset: Any, global_batch_size: int | None = None, read_ahead: int = 0, batch_multiple: int = 1):
        self._dataset = dataset
        self._position = self._cursor = Position()  # handed out; fetched (ahead of it by the batches in _ahead)
        self._read_ahead = read_ahead
        self._ahead: collections.deque[tuple[Any, Position, int | None, Any]] = collections.deque()
        self._rows: int | None = None
        self._pad: Any = None
        self._epoch_iter: Iterator[Any] | None = None
        self._configured = global_batch_size
        self._multiple = batch_multiple  # what input.global_batch_size must be a multiple of: replicas x accumulation
        self._checked = False
        self._ended: Position | None = None  # the last pass that ended (NoBatch says so if the next gives none)

    @property
    def rows_per_batch(self) -> int | None:
        """Rows in a global batch: as read (an iterable's own batches) once the first is, else as configured."""
        return getattr(self._dataset, "global_batch_size", None) or self._configured

    def _check_rows(self, batch: Any) -> None:
        """Once: an iterable whose batches do not hold ``input.global_batch_size`` rows is said to, not hidden; one
        whose elements are no batches (a scalar, which the API passes whole to a lone replica, as TF does) is refused:
        the loop would train on one example a step while examples/s counted a global batch."""
        self._checked = True
        found = getattr(self._dataset, "global_batch_size", None)
        first_rank = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if found is None and first_rank:
            from launcher.distribute.values import PerReplica, map_structure
            from launcher.input.split import batch_size_of

            leaves: list[Any] = []
            map_structure(leaves.append, batch)
            if not any(isinstance(leaf, PerReplica) for leaf in leaves):
                batch_size_of(batch)  # the batch's message where it has no first (batch) dimension
        if found and self._configured and found != self._configured and first_rank:
            log.warning("the training data's first global batch holds %d rows, input.global_batch_size says %d: "
                        "the recipe's iterable makes its own batches; examples/s counts %d per step%s",
                        found, self._configured, found, self._advice(found))

    def _advice(self, found: int) -> str:
        """A setting that the config accepts: the batch's own size where it is a multiple of what the config asks."""
        if found % self._multiple == 0:
            return f" (set input.global_batch_size={found} to match)"
        from launcher.config.run_rules import nearby_multiples

        return (f". Its batches are split over the replicas as evenly as tf.distribute does, and train as on one device; "
                f"input.global_batch_size must be a multiple of {self._multiple} (replicas x trainer.grad_accum_steps), "
                f"which {found} is not: to match, make the iterable's batches {nearby_multiples(found, self._multiple)} "
                f"rows and set input.global_batch_size to that")

    @property
    def position(self) -> Position:
        return self._position

    @property
    def rows(self) -> int | None:
        """The rows of the global batch that the batch last handed out was cut from (None: the dataset does not say)."""
        return self._rows

    @property
    def pad(self) -> Any:
        """The row a replica with none of that batch's rows steps on at weight 0 (None: every replica has rows)."""
        return self._pad

    def seek(self, position: Position) -> None:
        self._position = self._cursor = position
        self._ahead.clear()
        if getattr(self._dataset, "seekable", False):
            self._dataset.set_position(position)
            self._epoch_iter = iter(self._dataset)
            return
        log.warning("the training data cannot seek; reading and dropping the batches before epoch %d, batch %d",
                    position.epoch, position.offset)
        said = _Replay(position)
        for epoch in range(position.epoch):
            for _ in self._dataset:
                said.tick(epoch)
        self._epoch_iter = iter(self._dataset)
        for taken in range(position.offset):
            if next(self._epoch_iter, None) is None:
                raise ValueError(f"the training data has only {taken} batch(es) in an epoch now; the checkpoint was "
                                 f"saved after batch {position.offset} of epoch {position.epoch}: did the data change?")
            said.tick(position.epoch)
        said.done()

    def __iter__(self) -> "DataStream":
        return self

    def __next__(self) -> Any:
        batch, self._position, self._rows, self._pad = self._ahead.popleft() if self._ahead else self._fetch()
        return batch

    def read_ahead(self) -> None:
        """Fetch the next ``read_ahead`` steps now, after a step was launched and checkpointed: the host collates and
        pins them while the device still runs that step (on CUDA their copies are queued behind it, or overlap it on
        a side stream: ``input.copy_stream``). Fetching after the checkpoint,
        not before it, keeps what a data pipeline draws from the global RNG (an augmentation) in the order of a run
        fetching on demand, so that a run resumed from that checkpoint draws the same (exact up to 1 step ahead)."""
        while len(self._ahead) < self._read_ahead:
            self._ahead.append(self._fetch())

    def _fetch(self) -> tuple[Any, Position, int | None, Any]:
        """The next batch, the position after it, its global batch's rows and its pad."""
        if self._epoch_iter is None:
            self._epoch_iter = iter(self._dataset)
        for fresh_epoch in (False, True):
            try:
                batch = next(self._epoch_iter)
            except StopIteration:
                if fresh_epoch and self._cursor.offset == 0:
                    break
                self._ended = self._cursor  # the pass that ended, for NoBatch: the next may yield nothing
                self._cursor = Position(self._cursor.epoch + 1, 0)
                self._epoch_iter = iter(self._dataset)
                continue
            self._cursor = Position(self._cursor.epoch, self._cursor.offset + 1)
            if not self._checked:
                self._check_rows(batch)
            return batch, self._cursor, getattr(self._epoch_iter, "rows", None), getattr(self._epoch_iter, "pad", None)
        raise NoBatch(self._why_no_batch())

    def _why_no_batch(self) -> str:
        """With the numbers where the data says its rows (a map-style dataset's, input.files' under DATA or OFF)."""
        from launcher.config.run_rules import no_batch

        ended = self._ended
        if ended is not None and ended.offset:  # a pass gave batches; the one after gives none
            one_shot = getattr(self._dataset, "one_shot", False)
            return (f"the training data ran out: its pass {ended.epoch + 1} gave {ended.offset} batch(es), and the next "
                    f"gives none ({'an iterator, such as a generator, cannot start over' if one_shot else 'its __iter__ does not start over'}); "
                    f"make train_data re-iterable (an object whose __iter__ starts a new pass), or set trainer.steps "
                    "to the batches it has")
        why = getattr(self._dataset, "why_no_batch", None)
        if why is not None and why():
            return why()
        rows, size = getattr(self._dataset, "num_rows", None), self._configured
        if rows is not None and size and rows < size:
            return no_batch(rows, size, self._multiple, "the training data")
        of = f" ({size} rows, input.global_batch_size)" if size else ""
        return (f"the training data yields no batch: it is smaller than one global batch{of}: lower "
                "input.global_batch_size, or set input.drop_remainder=false")

    def seek_step(self, step: int) -> None:
        """Go to where the data stands after ``step`` batches: a seek, in epochs of the dataset's length; a data set of
        no known length (a stream, each worker's own part of one) is read ``step`` batches on, pass after pass."""
        try:
            per_epoch = len(self._dataset)
        except TypeError:
            log.warning("the training data has no length to seek by; reading and dropping its first %d batch(es)", step)
            said = _Replay(Position(0, step))
            for _ in range(step):
                self._fetch()
                said.tick(self._cursor.epoch)
            self._position = self._cursor
            said.done()
            return
        self.seek(Position(step // per_epoch, step % per_epoch) if per_epoch else Position())
