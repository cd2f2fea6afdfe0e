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


OWN_HANDLER = """\
import signal, sys, time
from pathlib import Path
import torch.distributed as dist

out = Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # torchrun habit: save, then end cleanly
dist.init_process_group("gloo")
rank = dist.get_rank()
(out / f"rank{rank}").touch()
while not stop:
    time.sleep(0.05)
(out / f"saved{rank}").touch()
sys.exit(0)
"""


@pytest.mark.slow
def test_a_script_that_handles_sigterm_itself_and_ends_is_a_stop_not_a_completed_run(tmp_path):
    """It saved and exited 0 on its own SIGTERM handler: dlaunch called the run completed ("the SIGTERM came in the
    run's last step"), exit 0, no resume hint; torchrun ends such a run as stopped."""
    from tests.launch.test_restarts import STARTUP_S, finish, run_processes, start, wait_for
    import json
    import signal

    (tmp_path / "own.py").write_text(OWN_HANDLER)
    run_dir = tmp_path / "run"
    proc = start(run_dir, f"script={tmp_path / 'own.py'}", "strategy=mirrored", "cluster=1x2", "--", str(tmp_path), common=())
    try:
        wait_for(lambda: (tmp_path / "rank0").exists() and (tmp_path / "rank1").exists(), STARTUP_S, "both ranks in the script")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not run_processes(run_dir) and proc.poll() is not None, 30, "every process to end (no orphans)")
    finally:
        out = finish(proc, timeout=30)
    assert proc.returncode == 143, out[-3000:]
    assert (tmp_path / "saved0").exists() and (tmp_path / "saved1").exists()  # its handler ran, as it wrote it
    assert "stopped by SIGTERM in the script's own handler, after which it ended" in out, out[-3000:]
    assert "the run completed, nothing was cut short" not in out
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "stopped"


def test_a_native_crash_in_one_process_shows_the_scripts_stack(tmp_path):
    """The script runs in dlaunch's own process there, and a segfault ended both with nothing said (exit 139)."""
    proc, out, _ = _run(tmp_path, "segv.py", "import ctypes\nprint('before', flush=True)\nctypes.string_at(0)\n")
    assert proc.returncode in (-11, 139), out[-3000:]
    assert "Fatal Python error: Segmentation fault" in out and 'segv.py", line 3 in <module>' in out, out[-3000:]


def test_scripts_that_end_their_processes_with_os_exit_0_still_get_a_summary(tmp_path):
    """rank 0 writes the summary after the script returns; os._exit(0) on every rank left none (`dlaunch report`
    then said the run has no metrics): the launcher writes it from what the script logged."""
    text = "import os\nimport torch.distributed as dist\ndist.init_process_group('gloo')\nos._exit(0)\n"
    proc, out, run_dir = _run(tmp_path, "quick.py", text, "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 0, out[-3000:]
    assert "the script ended its processes itself (os._exit) before dlaunch wrote the run's summary" in out
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["script"] == "quick.py" and "os._exit" in summary["note"]


def test_a_rank_that_ends_itself_with_os_exit_n_is_named_and_dlaunch_exits_n_as_for_sys_exit(tmp_path):
    """sys.exit(3) gave exit 3 and a ScriptExit line; os._exit(7) on rank 1 gave exit 1 and a bare `exit code 7`."""
    text = ("import os, time\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
            "if dist.get_rank() == 1:\n    os._exit(7)\ntime.sleep(60)\n")
    proc, out, _ = _run(tmp_path, "quits.py", text, "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 7, out[-3000:]
    assert "the process ended itself with exit code 7 and no Python exception (os._exit(), or exit() in native code)" in out


def test_rank_0s_prints_are_kept_in_its_log_directory_as_the_other_ranks_are(tmp_path):
    """torchrun's --tee keeps every rank's output; rank 0's was on the terminal only (its progress bar needs it)."""
    text = ("import logging\nimport torch.distributed as dist\nlogging.basicConfig(level=logging.INFO)\n"
            "dist.init_process_group('gloo')\nprint('hello from', dist.get_rank())\n"
            "logging.getLogger('app').info('logged on %d', dist.get_rank())\n")
    proc, out, run_dir = _run(tmp_path, "hello.py", text, "strategy=mirrored", "cluster=1x2")
    assert proc.returncode == 0, out[-3000:]
    assert "hello from 0" in out and "[rank1] hello from 1" in out  # the terminal as before
    kept = {p.parent.name: p.read_text() for p in (run_dir / "logs").rglob("stdout.log")}
    assert kept == {"0": "hello from 0\n", "1": "hello from 1\n"}, kept
    logged = {p.parent.name: p.read_text() for p in (run_dir / "logs").rglob("stderr.log")}
    assert "INFO:app:logged on 0" in logged["0"] and "INFO:app:logged on 1" in logged["1"], logged


STORED_APP = """\
from dataclasses import dataclass
import hydra
from hydra.core.config_store import ConfigStore

@dataclass
class Config:
    lr: float = 0.1

ConfigStore.instance().store(name="config", node=Config)

@hydra.main(version_base=None, config_name="config")
def main(cfg: Config) -> None:
    print("the app's lr:", cfg.lr)

main()
"""


def test_a_sweep_of_a_hydra_app_that_stores_its_config_runs_every_job(tmp_path):
    """The app's ConfigStore entry `config` outlived job 0 and was merged into dlaunch's own config for job 1
    (`Key 'trainer' not in 'Config'`), and the sweep ended without its summary (a diff review)."""
    (tmp_path / "app.py").write_text(STORED_APP)
    proc = dlaunch("-m", "script=app.py", "trainer.seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 0, out[-3000:]
    assert out.count("the app's lr: 0.1") == 2 and (tmp_path / "sweep" / "sweep_summary.json").is_file()


HANDLED = """\
import signal, sys, logging.config
seen = []
def note(signum, frame):
    seen.append(signum)
signal.signal(signal.SIGTERM, note)
print("the handler given back:", signal.getsignal(signal.SIGTERM) is note)
signal.raise_signal(signal.SIGTERM)
logging.config.dictConfig({"version": 1})  # disables the loggers that exist: dlaunch's too, until the script ends
print("handled", seen, "and finished")
"""


def test_one_process_keeps_pythons_word_on_a_handled_signal_and_dlaunchs_logger_comes_back(tmp_path):
    """As under python: a handler that notes a signal and lets the script finish ends it as completed (exit 0);
    getsignal gives the handler back as written; dlaunch's warnings after the script are not lost to dictConfig."""
    proc, out, run_dir = _run(tmp_path, "handled.py", HANDLED, "trainer.precision=bf16-mixed")
    assert proc.returncode == 0, out[-3000:]
    assert "the handler given back: True" in out and "handled [15] and finished" in out
    assert "has not entered strategy.autocast()" in out  # dlaunch's warning at the end, after the script's dictConfig
    import json

    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
