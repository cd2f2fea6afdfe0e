"""Device prefetch (launcher.input.prefetch): order and values kept, read ahead by `depth`."""

import pytest
import torch

from launcher.input.prefetch import Prefetcher

CPU = [torch.device("cpu"), torch.device("cpu")]


class CountingSteps:
    """Steps of two per-replica pieces that record how far they have been read."""

    def __init__(self, n):
        self.n, self.read = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.read = i + 1
            yield [{"x": torch.full((2,), float(i))}, (torch.tensor([i]), torch.tensor([10 * i]))]


@pytest.mark.parametrize("depth", [0, 1, 3, 10])
def test_cpu_prefetch_keeps_order_and_values(depth):
    expected = list(CountingSteps(5))
    got = list(Prefetcher(CountingSteps(5), CPU, depth))
    assert len(got) == 5
    for a, b in zip(got, expected):
        assert torch.equal(a[0]["x"], b[0]["x"]) and torch.equal(a[1][0], b[1][0]) and torch.equal(a[1][1], b[1][1])
        assert a[0]["x"].device.type == "cpu"


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_cpu_prefetch_reads_depth_steps_ahead(depth):
    steps = CountingSteps(6)
    it = iter(Prefetcher(steps, CPU, depth))
    first = next(it)
    assert first[1][0].item() == 0
    assert steps.read == 1 + depth  # the step in use, plus `depth` in flight


def test_an_empty_source_a_negative_depth_and_an_unknown_stream():
    assert list(Prefetcher([], CPU, 2)) == []
    with pytest.raises(ValueError, match=">= 0"):
        Prefetcher([], CPU, -1)
    with pytest.raises(ValueError, match="`copy_stream` must be one of"):
        Prefetcher([], CPU, 1, "default")


@pytest.mark.parametrize("copy_stream", ["compute", "side"])
def test_the_loops_input_options_carry_input_copy_stream(copy_stream):
    from launcher.config.schema import InputSpec
    from launcher.distribute.input_context import InputOptions
    from launcher.runtime.train_input import input_options

    spec = type("Spec", (), {"input": InputSpec(copy_stream=copy_stream)})()
    assert input_options(spec).copy_stream == copy_stream
    with pytest.raises(ValueError, match="`copy_stream` must be one of"):
        InputOptions(copy_stream="default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("copy_stream", ["compute", "side"])
@pytest.mark.parametrize("depth", [0, 2])
def test_cuda_prefetch_copies_from_pinned_memory_in_order(depth, copy_stream):
    device = torch.device("cuda", 0)
    big = [[torch.arange(i, i + (1 << 20), dtype=torch.float32)] for i in range(4)]
    got = list(Prefetcher(big, [device], depth, copy_stream))
    assert len(got) == 4
    for (piece,), (src,) in zip(got, big):
        assert piece.device == device
        torch.cuda.current_stream(device).synchronize()
        assert torch.equal(piece.cpu(), src)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("copy_stream", ["compute", "side"])
def test_cuda_prefetch_is_safe_to_use_on_the_consumer_stream(copy_stream):
    device = torch.device("cuda", 0)
    steps = [[torch.full((1 << 22,), float(i))] for i in range(6)]
    totals = [float(p.sum()) for (p,) in Prefetcher(steps, [device], 3, copy_stream)]  # used while later copies run
    assert totals == [float(i * (1 << 22)) for i in range(6)]

