"""Script mode keeps a torchrun script's own habits: its logging set-up, its own @hydra.main, init_process_group
imported from distributed_c10d, and says which of its own settings dlaunch's process group does not take."""

from __future__ import annotations

import pytest

from tests.conftest import dlaunch

LOGS = """\
import logging
import torch.distributed as dist
logging.basicConfig(level=logging.INFO, format="MINE %(levelname)s %(message)s")
dist.init_process_group("gloo")
logging.getLogger("app").info("info from rank %d", dist.get_rank())
dist.destroy_process_group()
"""

C10D = """\
from datetime import timedelta
from torch.distributed.distributed_c10d import destroy_process_group, get_rank, init_process_group
init_process_group(backend="gloo", timeout=timedelta(seconds=3))
print("joined on rank", get_rank())
destroy_process_group()
"""

HYDRA_APP = """\
import logging
import hydra
from omegaconf import DictConfig

@hydra.main(version_base=None, config_path=None)
def main(cfg: DictConfig) -> None:
    print("the app's config:", dict(cfg))
    logging.getLogger(__name__).info("the app logs")

main()
"""


def _run(tmp_path, name: str, text: str, *overrides: str):
    (tmp_path / name).write_text(text)
    run_dir = tmp_path / "run"
    proc = dlaunch(f"script={name}", *overrides, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    return proc, " ".join((proc.stdout + proc.stderr).split()), run_dir


def test_the_scripts_basic_config_takes_effect_on_every_rank(tmp_path):
    """torchrun leaves the root logger to the script: its format and its INFO lines, on rank 1 too (in logs/)."""
    proc, out, run_dir = _run(tmp_path, "logs.py", LOGS, "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 0, out[-3000:]
    assert "MINE INFO info from rank 0" in out and "[rank1] MINE INFO info from rank 1" in out
    kept = "".join(p.read_text() for p in (run_dir / "logs").rglob("*.log"))
    assert "MINE INFO info from rank 1" in kept
    assert "status completed" in out  # dlaunch's own lines come back after the script


def test_init_process_group_from_distributed_c10d_joins_and_its_timeout_is_said(tmp_path):
    proc, out, _ = _run(tmp_path, "c10d.py", C10D, "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 0, out[-3000:]
    assert "joined on rank 0" in out and "joined on rank 1" in out
    said = ("the script's init_process_group(timeout=0:00:03) does not apply: the group dlaunch set up waits "
            "launch.collective_timeout_s=300 s for a collective; give launch.collective_timeout_s=3 for the script's")
    assert out.count(said) == 1, out[-3000:]  # rank 0's line only


@pytest.mark.parametrize("shape", [(), ("strategy=mirrored", "cluster=1x2")])
def test_a_script_with_its_own_hydra_main_runs_as_under_python(tmp_path, shape):
    """In one process the script runs inside dlaunch's own Hydra job: its app gets Hydra to itself, then dlaunch
    finishes its run (summary, result lines, its log file) as for any script."""
    (tmp_path / "app.py").write_text(HYDRA_APP)
    run_dir = tmp_path / "run"
    proc = dlaunch("script=app.py", *shape, f"hydra.run.dir={run_dir}", "--", "+lr=0.1", cwd=tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, out[-3000:]
    assert "the app's config: {'lr': 0.1}" in out and "the app logs" in out
    assert "GlobalHydra is already initialized" not in out and "status completed" in out
    assert (run_dir / "summary.json").is_file() and "running app.py +lr=0.1" in (run_dir / "dlaunch.log").read_text()
