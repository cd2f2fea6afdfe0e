"""Shared fixtures: run ``dlaunch`` as a user would, keep the environment clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.cluster.env import quiet_cpp_variables
from launcher.launch import warm
from tests import prewarmed

# One intra-op thread in every process the suite starts (dlaunch's workers get one already), unless the
# developer chose otherwise: the suite runs several processes per core (pytest-xdist, multi-process runs,
# CI's neighbours), and torch's default of a thread per core made a run 1.5x slower under a CPU hog.
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
PROBE = FIXTURES / "probe_recipe.py"


def pytest_collection_modifyitems(config, items):
    """The costliest test files first: pytest-xdist (``--dist loadfile``) hands out files in this order, so the
    long multi-process files do not start last and leave one stream running while the others have finished.
    A file's cost is guessed from its tests: a ``slow`` one starts processes (seconds), the others take ~0.1 s,
    and one skipped here (no CUDA, say) costs nothing."""
    cost: dict[Path, float] = {}
    for item in items:
        if any(m.kwargs.get("reason") == "needs a CUDA device" for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.cuda)  # `pytest -m cuda`: the GPU machine's own tests (.ci/gpu-check)
        skipped = any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))
        cost[item.path] = cost.get(item.path, 0) + (0 if skipped else 10 if item.get_closest_marker("slow") else 0.25)
    items.sort(key=lambda item: -cost[item.path])  # stable: a file's tests keep their order


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(autouse=True)
def _no_process_group():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


SUBCOMMANDS = ("recipes", "report", "resume")


def with_overrides(args: tuple[str, ...], *overrides: str) -> tuple[str, ...]:
    """``args`` plus ``overrides``, kept before a ``--`` (what follows it belongs to the user's script)."""
    cut = args.index("--") if "--" in args else len(args)
    return (*args[:cut], *overrides, *args[cut:])


def answered_early(args: tuple[str, ...]) -> bool:
    """``--help``, ``-h`` and ``--version`` answer before torch is imported, and run nothing."""
    return any(a in ("--help", "-h", "--version") for a in args)


def pinned(args: tuple[str, ...], device: str | None = "cpu") -> tuple[str, ...]:
    """``args`` with ``cluster.device=device`` added to a run that names no device.

    Tests mean the CPU unless they say otherwise: on a GPU machine the default ``auto``
    picks cuda, and ``cluster=1x2`` would then ask for two GPUs. ``device=None`` keeps ``auto``.
    """
    is_run = not (args and args[0] in SUBCOMMANDS) and not answered_early(args)
    if device and is_run and not any(a.startswith(("cluster.device=", "+cluster.device=")) for a in args):
        return with_overrides(args, f"cluster.device={device}")
    return args


def command(*args: str, device: str | None = "cpu", warm: bool = True) -> list[str]:
    """The argv of a fresh ``dlaunch`` process, for tests that need a ``subprocess.Popen`` of their own
    (signals, kills, several nodes at once). ``warm``: the console script's path, whose workers fork from a
    warm forkserver; ``warm=False`` starts each worker as ``python -m launcher.runtime.worker_entry``, so a test
    can find a rank's process by its command line."""
    return [sys.executable, "-m", "launcher.cli.entry" if warm else "launcher.cli.main", *pinned(args, device)]


# The commands' environment as Python and torch read it at start (``dlaunch`` below adds PYTHONUNBUFFERED), which
# their workers' is too: a command's warm server is then a fork of it (``warm.prewarm``). A command of several nodes or
# parameter-server tasks quiets torch's C++ warnings before torch loads (``cli/entry.py``): it forks from an
# interpreter whose torch loaded so.
_STARTED_IN = {**os.environ, "PYTHONUNBUFFERED": "1"}
ZYGOTE = None if os.environ.get("DLAUNCH_TEST_FRESH") == "1" else prewarmed.Zygote(str(ROOT), _STARTED_IN)
QUIET_ZYGOTE = ZYGOTE and prewarmed.Zygote(str(ROOT), {**_STARTED_IN, **quiet_cpp_variables()})


def zygote_for(args) -> prewarmed.Zygote | None:
    return QUIET_ZYGOTE if warm.several_nodes(list(args)) else ZYGOTE


def pytest_sessionfinish(session):
    for zygote in (ZYGOTE, QUIET_ZYGOTE):
        if zygote is not None:
            zygote.close()


def importable_from(directory: Path) -> dict[str, str]:
    """``env`` for a command that imports a module the test wrote into ``directory`` (a Hydra callback): the console
    script never has its working directory on ``sys.path``, and ``python -m`` has not under ``PYTHONSAFEPATH=1``
    (``.ci/gpu-check``)."""
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)}


def dlaunch(*args: str, cwd: Path, timeout: float = 240, env: dict | None = None, device: str | None = "cpu") -> subprocess.CompletedProcess:
    """Run the real command line in a process of its own: forked from this test process's prewarmed
    interpreter (``tests/prewarmed.py``), or a fresh one where that is busy or ``DLAUNCH_TEST_FRESH=1``.

    A run means the CPU (``cluster.device=cpu``) unless the test says otherwise: ``device="cuda"``,
    or ``device=None`` for the default ``auto``, which picks a GPU where there is one.
    """
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", **(env or {})}
    quick = answered_early(args)  # answered before torch is imported: always fresh
    args = pinned(args, device)
    zygote = zygote_for(args)
    forked = zygote and not quick and zygote.run(list(args), cwd, full_env, timeout)
    if forked:
        return forked
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli.entry", *args],  # the console script's path, warm workers included
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env,
    )


def popen(*args: str, cwd: Path, env: dict | None = None, device: str | None = "cpu", session: bool = False):
    """Start the real command line and leave it running; stdout and stderr go to one text stream, as with
    ``subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True)``. The command is forked from this test process's
    prewarmed interpreter where it is free (``tests/prewarmed.py``; the handle has Popen's ``pid``, ``poll``,
    ``wait``, ``send_signal``, ``kill`` and ``communicate``), else a fresh process. ``session``: a process group of
    its own (``start_new_session``)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120", **(env or {})}
    args = pinned(args, device)
    zygote = zygote_for(args)
    forked = zygote and zygote.start(list(args), cwd, full_env, session=session)
    if forked:
        return forked
    return subprocess.Popen(command(*args, device=None), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=session)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture
def run_dlaunch(tmp_path):
    def run(*args: str, name: str = "run", **kw) -> tuple[subprocess.CompletedProcess, Path]:
        run_dir = tmp_path / name
        proc = dlaunch(*with_overrides(args, f"hydra.run.dir={run_dir}"), cwd=tmp_path, **kw)
        return proc, run_dir

    return run


@pytest.fixture
def strategy(monkeypatch):
    """A two-replica MirroredStrategy in this process; its replica threads are closed after the test."""
    from launcher import distribute as dl

    monkeypatch.delenv("RANK", raising=False)  # never join a process group from a unit test
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    s = dl.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    yield s
    if s.extended._threads is not None:
        s.extended._threads.close()


def train_briefly(strategy, steps: int = 4, seed: int = 0):
    """Train a small MLP (SGD with momentum) on ``steps`` global batches of 16 under ``strategy``.

    Returns the prepared model; the model's initial parameters come from ``seed``.
    """
    import torch

    torch.manual_seed(seed)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        model, opt = strategy.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(steps)]

    def step(batch):
        x, y = batch
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(batch,))
    return model


def wait_for(check, timeout_s: float = 10.0, interval_s: float = 0.05):
    """``check()``'s first truthy value, polled until ``timeout_s``; an AssertionError after that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {getattr(check, '__name__', check)}")


def process_state(pid: int) -> tuple[str, int, int] | None:
    """A process's state letter, parent and process group, from ``/proc/PID/stat``; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (comm)"
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def alive(pid: int) -> bool:
    """Running, not a zombie: where nothing reaps an orphan, it stays in the table with state Z."""
    state = process_state(pid)
    return state is not None and state[0] != "Z"
