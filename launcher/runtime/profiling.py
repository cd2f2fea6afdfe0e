"""``trainer.profile``: ``torch.profiler`` over a window of steps; a trace and an op table per rank.

The window counts from the first step this command runs: ``wait`` steps pass unprofiled (compilation and
the allocator's warm-up out of the way), ``warmup`` steps are profiled and thrown away, then ``active``
steps are recorded. Each rank then writes, under ``RUN_DIR/profile/``:

- ``rank{R}.trace.json`` (a parameter-server worker: ``worker{I}.trace.json``): the timeline, for https://ui.perfetto.dev or ``chrome://tracing``. The loop's own
  phases are labelled regions (``dlaunch.data``, ``dlaunch.step``, ``dlaunch.log``, ``dlaunch.eval``,
  ``dlaunch.checkpoint``), so what dlaunch does between the user's kernels is visible.
- ``rank{R}-ops.txt``: torch's table of the ops with the most self time (on the GPU where one was
  profiled, else on the CPU), and the host time per step of each dlaunch region.

The profiler stops once the window is recorded: later steps, and every step when profiling is off, pay
one attribute test per region. A window cut short (a resumed command with fewer steps left, a
parameter-server worker whose chief finished, an error or a stop signal inside it) writes nothing: a
trace of fewer steps than it says would mislead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

log = logging.getLogger("dlaunch")

DIR = "profile"
REGIONS = ("dlaunch.data", "dlaunch.step", "dlaunch.log", "dlaunch.eval", "dlaunch.checkpoint")
_NOTHING = contextlib.nullcontext()


class StepProfiler:
    """``with StepProfiler(spec, run_dir, "rank0", device_type) as prof:`` around the loop; ``prof.region(name)``
    around each phase of a step; ``prof.step()`` after each step. ``who`` names the files (a rank, or a
    parameter-server task such as ``worker0``)."""

    def __init__(self, spec: Any, run_dir: Path | None, who: str, device_type: str):
        self.spec, self.who, self.device_type = spec, who, device_type
        self.dir = (run_dir / DIR) if run_dir is not None else None
        self.enabled = bool(spec.enabled) and self.dir is not None
        self.written: Path | None = None  # the trace, once the window has been recorded
        self._prof: Any = None
        self._steps = 0

    @property
    def trace(self) -> Path | None:
        return None if self.dir is None else self.dir / f"{self.who}.trace.json"

    @property
    def table(self) -> Path | None:
        return None if self.dir is None else self.dir / f"{self.who}-ops.txt"

    def __enter__(self) -> "StepProfiler":
        if not self.enabled:
            return self
        import torch.profiler as tp

        activities = [tp.ProfilerActivity.CPU]
        if self.device_type == "cuda" and tp.ProfilerActivity.CUDA in tp.supported_activities():
            activities.append(tp.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # warmup=0 was asked for: torch's "won't be using warmup" says nothing new
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            self._prof = self._profile(tp, activities)
        self._prof.__enter__()
        return self

    def _profile(self, tp: Any, activities: list[Any]) -> Any:
        s = self.spec
        return tp.profile(
            activities=activities, schedule=tp.schedule(wait=s.wait, warmup=s.warmup, active=s.active, repeat=1),
            on_trace_ready=self._write, record_shapes=s.record_shapes, profile_memory=s.memory, with_stack=s.with_stack,
        )

    def region(self, name: str) -> contextlib.AbstractContextManager:
        """``torch.profiler.record_function(name)`` while the profiler runs; nothing otherwise."""
        if self._prof is None:
            return _NOTHING
        import torch.profiler as tp

        return tp.record_function(name)

    @property
    def ending(self) -> bool:
        """The next ``step()`` ends the window: torch stops and reads its events then. A collective still running on
        a backend thread (gloo's) carries the profiler's thread state there and records into it meanwhile; that
        race corrupted the heap (an async all-reduce of step N, waited at step N+1), so the loop settles it first."""
        return self._prof is not None and self._steps + 1 >= self.spec.window

    def step(self) -> None:
        if self._prof is None:
            return
        self._steps += 1
        self._prof.step()  # at the window's last step torch calls _write
        if self._steps >= self.spec.window:
            self._stop()

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if self._prof is None:
            return False
        self._stop()
        if kind is None:
            log.warning("profile: %s ran %d step(s) in this command, fewer than the %d the window needs "
                        "(trainer.profile.wait + warmup + active); no trace was written", self.who, self._steps, self.spec.window)
        return False

    def _stop(self) -> None:
        prof, self._prof = self._prof, None
        try:
            prof.__exit__(None, None, None)
        except Exception as problem:  # noqa: BLE001 - a profiler that cannot stop must not hide the run's own outcome
            log.warning("profile: torch.profiler did not stop cleanly: %s", problem)

    def _write(self, prof: Any) -> None:
        """torch's ``on_trace_ready``: called when the window ends, and when the profiler stops inside it (skipped)."""
        if self._steps < self.spec.window:
            return
        try:
            self._export(prof)
        except Exception as problem:  # noqa: BLE001 - a trace that cannot be written must not end the training
            log.warning("profile: %s's trace could not be written to %s: %s", self.who, self.dir, problem)

    def _export(self, prof: Any) -> None:
        assert self.dir is not None and self.trace is not None and self.table is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        partial = self.trace.with_name(self.trace.name + ".partial")  # a process stopped mid-export leaves no half trace
        prof.export_chrome_trace(str(partial))
        os.replace(partial, self.trace)
        events = prof.key_averages()
        on_device = any(getattr(e, "self_device_time_total", 0) > 0 for e in events)
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        first = self.spec.wait + self.spec.warmup + 1
        head = (f"trainer.profile: steps {first}-{first + self.spec.active - 1} of this command, {self.who}, "
                f"sorted by {sort}\n\n")
        self.table.write_text(head + region_lines(events, self.spec.active) + "\n\n" + events.table(sort_by=sort, row_limit=40) + "\n")
        self.written = self.trace
        # INFO reaches the terminal from rank 0 only (setup_logging)
        log.info("profile: %s (open it in https://ui.perfetto.dev); the top ops and dlaunch's host time per step: %s",
                 self.trace, self.table)


def region_lines(events: Any, steps: int) -> str:
    """Host time per step of each dlaunch region that ran in the window."""
    rows = [(e.key, e.cpu_time_total / 1000 / steps, e.count / steps) for e in events if e.key in REGIONS]
    if not rows:
        return "dlaunch regions: none ran in the window"
    lines = ["dlaunch regions, host (CPU) time per step:"]
    lines += [f"  {name:<20} {ms:9.3f} ms  ({calls:g} per step)" for name, ms, calls in sorted(rows, key=lambda r: REGIONS.index(r[0]))]
    return "\n".join(lines)
