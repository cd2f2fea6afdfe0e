"""A chaos soak: one mirrored 1x2 run, interrupted N times at random, must end as if it never was.

The harness runs ``dlaunch`` (the probe recipe, deterministic, checkpoints every
``every`` steps, ``launch.max_restarts``) and, at steps drawn from a seeded RNG,
does one of:

- ``kill_worker``: SIGKILL one rank (the agent restarts the workers, or gives up
  once ``launch.max_restarts`` is spent);
- ``kill_agent``: SIGKILL the ``dlaunch`` process (its workers must follow it);
- ``kill_group``: SIGKILL its whole process group;
- ``term_in_save``: SIGTERM to ``dlaunch`` or to its group while rank 0 is in
  the middle of a save (its files written, not committed; the probe's ``hold_saves``).

After an interruption that ends the command, the same command runs again with
``trainer.resume=auto``. Each injection waits for a step no attempt has reached
before, so the run always moves on. ``Soak.run()`` returns what happened; the
test compares the run with an uninterrupted one.

Replay a failure with the seed it printed: ``SOAK_SEED=... SOAK_N=... pytest tests/launch/test_chaos.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from launcher.checkpoint import layout
from tests.conftest import PROBE, command
from tests.launch.test_worker_processes import workers_of

FAULTS = ("kill_worker", "kill_agent", "kill_group", "term_in_save")
ENDS_COMMAND = {"kill_agent", "kill_group", "term_in_save"}
EXIT_TIMEOUT_S = 180  # a command's end after its interruption; generous for a busy machine, never reached when well


def soak_args(steps: int, every: int, max_restarts: int) -> tuple[str, ...]:
    return ("strategy=mirrored", "cluster=1x2", "cluster.device=cpu", f"recipe.entry={PROBE}", "recipe.examples=640",
            f"trainer.steps={steps}", "trainer.log_every=1", f"trainer.checkpoint.every_steps={every}",
            f"launch.max_restarts={max_restarts}", "trainer.resume=auto", "+recipe.step_sleep=0.03",
            "+recipe.hold_saves=true", "+recipe.record_attempts=true")


def start(args: tuple[str, ...], run_dir: Path, log: Path) -> subprocess.Popen:
    """``dlaunch args`` in its own session (its process group is the session), output to ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            command(*args, f"hydra.run.dir={run_dir}"), cwd=run_dir.parent,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "120"},
        )


def last_step(run_dir: Path) -> int:
    """The last step metrics.jsonl records (0: none yet); a torn last line is skipped."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def session_processes(sid: int) -> list[str]:
    """Live (not zombie) processes of session ``sid``: what a command started, wherever it was reparented."""
    out = subprocess.run(["ps", "-eww", "-o", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()
            if len(line.split()) >= 3 and line.split()[1] == str(sid) and not line.split()[2].startswith("Z")]


def leftovers(run_dir: Path, sid: int) -> list[str]:
    return session_processes(sid) + workers_of(run_dir)


def attempts_of(run_dir: Path, rank: int) -> list[int]:
    """The pids of ``rank``'s attempts so far (the probe's ``record_attempts`` appends one line per start)."""
    try:
        return [int(pid) for pid in (run_dir / f"attempts-rank{rank}.txt").read_text().split()]
    except OSError:
        return []


@dataclasses.dataclass
class Command:
    """One ``dlaunch`` command of the soak: the faults it met, how it ended."""

    faults: list[str] = dataclasses.field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0
    resumable: bool = False  # a checkpoint existed when it started

    def expected_exit(self, max_restarts: int) -> int:
        """How the command must end after its faults: completed, stopped by its signal, or out of restarts."""
        if not self.faults:
            return 0
        if self.faults[-1] == "term_in_save":
            return 128 + signal.SIGTERM  # the workers saved, then stopped
        if self.faults[-1] in ENDS_COMMAND:
            return -signal.SIGKILL
        if self.faults.count("kill_worker") > max_restarts:
            return 1  # restarts exhausted
        return 0  # the n-th fault killed a worker: the agent restarted the workers and the run completed


@dataclasses.dataclass
class Soak:
    run_dir: Path
    n: int
    seed: int
    every: int = 4
    max_restarts: int = 2
    commands: list[Command] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        # Room for n faults: each lands at most 2*every steps past the furthest step seen, and a stopped command
        # may log some steps past that before it ends (a stop is agreed between the ranks): twice that, for slack.
        self.steps = self.n * (4 * self.every + 4) + self.every
        self.args = soak_args(self.steps, self.every, self.max_restarts)
        self.plan = self.rng.sample(FAULTS, len(FAULTS)) + [self.rng.choice(FAULTS) for _ in range(self.n)]
        self.plan = self.plan[: self.n]  # every kind once (when n >= 4), then at random
        self.seen = 0  # the furthest step any attempt logged

    @property
    def faults(self) -> list[str]:
        return [f for c in self.commands for f in c.faults]

    def run(self) -> None:
        """Interrupt the run ``n`` times, then let the last command complete."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            command = Command(resumable=layout.latest(self.run_dir / "checkpoints") is not None)
            # a stopped command may log steps past the one the harness saw: the next fault waits for new progress
            self.seen = max(self.seen, last_step(self.run_dir))
            self.commands.append(command)
            log = self.run_dir.parent / f"{self.run_dir.name}-command-{len(self.commands)}.log"
            started = time.monotonic()
            proc = start(self.args, self.run_dir, log)
            try:
                while len(self.faults) < self.n and proc.poll() is None:
                    if not self._interrupt(proc, command):
                        break
                    if command.faults[-1] in ENDS_COMMAND:
                        break
                command.exit_code = proc.wait(timeout=EXIT_TIMEOUT_S if len(self.faults) < self.n else 600)
            finally:
                if proc.poll() is None:  # a hang: never leave it behind, the test fails on the exit code
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                (self.run_dir / "hold-save").unlink(missing_ok=True)
            command.seconds = time.monotonic() - started
            self._check_nothing_left(proc.pid, log)
            assert command.exit_code == command.expected_exit(self.max_restarts), \
                f"{self}: command {len(self.commands)} met {command.faults}, exited {command.exit_code}:\n{log.read_text()[-3000:]}"
            if command.exit_code == 0:
                return
            assert len(self.commands) <= 3 * self.n + 2, f"{self}: too many commands; last log:\n{log.read_text()[-3000:]}"

    def _interrupt(self, proc: subprocess.Popen, command: Command) -> bool:
        """Inject the next planned fault into ``proc``; False if it exited first (completed, or gave up)."""
        fault = self.plan[len(self.faults)]
        if fault == "term_in_save":
            target = (self.seen // self.every + self.rng.randint(1, 2)) * self.every
            if target >= self.steps:
                fault = "kill_agent"
        if fault == "term_in_save":
            return self._term_in_save(proc, command, target)
        target = min(self.seen + self.rng.randint(1, 2 * self.every), self.steps - 1)  # never past the run's end
        if not self._reach(proc, target):
            return False
        time.sleep(self.rng.uniform(0, 0.05))  # anywhere within a step (0.03 s), the save after it included
        if fault == "kill_worker":
            attempts = len(attempts_of(self.run_dir, 0))
            if not self._kill_rank(proc, self.rng.randrange(2)):
                return False
            self._await_restart(proc, attempts)
        elif fault == "kill_agent":
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        command.faults.append(fault)
        return True

    def _kill_rank(self, proc: subprocess.Popen, rank: int) -> bool:
        """SIGKILL ``rank``'s live attempt; False if the command ended first.

        The attempts file can name an attempt that has just ended (a restart under way, its
        successor not yet recorded): the newest line is read again until a live one is killed.
        """
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while proc.poll() is None:
            try:
                os.kill(attempts_of(self.run_dir, rank)[-1], signal.SIGKILL)
                return True
            except ProcessLookupError:
                assert time.monotonic() < deadline, f"{self}: rank {rank} has no live attempt (a hang?)"
                time.sleep(0.05)
        return False

    def _await_restart(self, proc: subprocess.Popen, attempts: int) -> None:
        """After a worker's kill: wait for rank 0's next attempt (or the command's end), then note the furthest step.

        The agent stops every worker before it starts the next attempt, so from then on only the new
        attempt logs, and only after it recorded its start: the next fault, which waits for a step past
        ``seen``, lands on a restart the run's history counts (it once landed on one still loading).
        """
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while len(attempts_of(self.run_dir, 0)) == attempts and proc.poll() is None:
            assert time.monotonic() < deadline, f"{self}: no restart after a worker's kill (a hang?)"
            time.sleep(0.01)
        self.seen = max(self.seen, last_step(self.run_dir))

    def _term_in_save(self, proc: subprocess.Popen, command: Command, step: int) -> bool:
        gate, marker = self.run_dir / "hold-save", self.run_dir / "saving"
        marker.unlink(missing_ok=True)
        gate.write_text(str(step))
        try:
            deadline = time.monotonic() + EXIT_TIMEOUT_S
            while not marker.exists():
                if proc.poll() is not None:
                    return False
                assert time.monotonic() < deadline, f"{self}: the save of step {step} never began (a hang?)"
                time.sleep(0.01)
            if self.rng.random() < 0.5:
                os.kill(proc.pid, signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGTERM)
        finally:
            gate.unlink(missing_ok=True)  # the save goes on, the stop follows it
        self.seen = max(self.seen, step)
        command.faults.append("term_in_save")
        return True

    def _reach(self, proc: subprocess.Popen, step: int) -> bool:
        """Wait until the run logs ``step`` (past anything logged before); False if the command exits first."""
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while (now := last_step(self.run_dir)) < step:
            if proc.poll() is not None:
                return False
            assert time.monotonic() < deadline, f"{self}: step {step} not reached in {EXIT_TIMEOUT_S} s (a hang?)"
            time.sleep(0.005)
        self.seen = max(self.seen, now)
        return True

    def _check_nothing_left(self, sid: int, log: Path) -> None:
        deadline = time.monotonic() + 60  # a killed launcher's workers die on their parent's death: asynchronously
        while (left := leftovers(self.run_dir, sid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not left, f"{self}: processes left after command {len(self.commands)}: {left}\n{log.read_text()[-3000:]}"

    def __str__(self) -> str:
        return f"chaos soak seed={self.seed} n={self.n} (replay: SOAK_SEED={self.seed} SOAK_N={self.n})"

    def expected_history(self) -> dict[str, int]:
        """summary.json's history, from what the harness did since the run last began afresh."""
        fresh = max(i for i, c in enumerate(self.commands) if not c.resumable)
        counted = self.commands[fresh:]
        restarts = sum(min(c.faults.count("kill_worker"), self.max_restarts) for c in counted)
        return {"commands": len(counted), "restarts": restarts}

    def figures(self) -> dict:
        return {"seed": self.seed, "n": self.n, "steps": self.steps, "every": self.every, "faults": self.faults,
                "commands": [dataclasses.asdict(c) for c in self.commands],
                "seconds": sum(c.seconds for c in self.commands)}
