"""How a script's ranks end: one that finishes early does not hold the others, and one's threads finish first."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("warm", [True, False])
def test_a_rank_whose_script_ends_early_is_named_when_the_others_wait_for_it(run_dlaunch, tmp_path, warm):
    """As under torchrun, the other rank fails in its next collective; dlaunch says which rank had left. The rank
    that left waits for the others 10 s at the end, not launch.collective_timeout_s (a forked worker was held until
    every rank had returned, so its peer's collective only timed out)."""
    (tmp_path / "leaves.py").write_text(
        "import sys\n\nimport torch\nimport torch.distributed as dist\n\n"
        "if dist.get_rank() == 1:\n    sys.exit(0)\n"
        "dist.all_reduce(torch.ones(1))\n")
    proc, _ = run_dlaunch("script=leaves.py", "strategy=mirrored", "cluster=1x2", "launch.collective_timeout_s=600",
                          f"launch.warm_workers={str(warm).lower()}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    text = " ".join(proc.stderr.split())
    assert "rank(s) 1 had completed (their loop or script had ended) while rank 0 waited for them" in text, text[-3000:]
    assert "Connection closed by peer" in text and "Timed out" not in text, text[-3000:]


@pytest.mark.parametrize("warm", [True, False])
def test_a_thread_the_script_leaves_running_finishes_before_its_rank_exits(run_dlaunch, tmp_path, warm):
    """As under python and torchrun: a non-daemon thread (an async save, a metrics writer) is waited for at the
    rank's exit; the worker's os._exit had cut it off, losing what it would have written."""
    (tmp_path / "writes_late.py").write_text(
        "import os\nimport threading\nimport time\n\nimport torch.distributed as dist\n\n"
        "path = os.path.join(os.environ['DLAUNCH_RUN_DIR'], f'late-{dist.get_rank()}.txt')\n\n"
        "def write():\n    time.sleep(1)\n"
        "    with open(path, 'w') as f:\n"
        "        f.write('written')\n\n"
        "threading.Thread(target=write).start()\n")
    proc, run_dir = run_dlaunch("script=writes_late.py", "strategy=mirrored", "cluster=1x2",
                                f"launch.warm_workers={str(warm).lower()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(run_dir / f"late-{rank}.txt").read_text() for rank in (0, 1)] == ["written"] * 2
