"""Stop signals in a worker: the flag a handler sets, and what it logs."""

from __future__ import annotations

import logging
import os
import signal

from launcher.runtime.preemption import StopRequests


def test_a_second_signal_arriving_inside_the_first_ones_log_call_logs_nothing():
    """A rank gets the terminal's SIGINT and its agent's SIGTERM at once: the second handler ran inside the first
    one's write to dlaunch.log, and logging it again re-entered the file's writer ("--- Logging error ---")."""
    stop = StopRequests(distributed=False)
    said: list[str] = []

    class SecondSignalMidWrite(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())
            if len(said) == 1:
                stop._handler(signal.SIGTERM, None)  # what the interpreter does when the signal lands here

    handler = SecondSignalMidWrite()
    logger = logging.getLogger("dlaunch")
    logger.addHandler(handler)
    try:
        stop._handler(signal.SIGINT, None)
    finally:
        logger.removeHandler(handler)
    assert said == ["SIGINT received: the ranks stop together within a step, then save"]
    assert stop.agreed() == signal.SIGINT


def test_a_stop_elsewhere_in_the_job_is_agreed_as_if_received_here():
    requested = []
    stop = StopRequests(distributed=False, elsewhere=lambda: requested[0] if requested else 0)
    assert stop.agreed() == 0
    requested.append(signal.SIGTERM)
    assert stop.agreed() == signal.SIGTERM


def test_settle_waits_for_the_agreement_in_flight_and_the_next_step_still_reads_it(tmp_path):
    """The loop settles the stop agreement before the profiler's window ends: an all-reduce still running on gloo's
    thread carries the profiler's thread state there and recorded into it while torch stopped it (a corrupted heap,
    3 aborts in 72 two-process profiled runs)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        stop = StopRequests(distributed=True)
        stop._handler(signal.SIGTERM, None)
        assert stop.agreed() == 0  # one step late: step N's flag is launched now, read after step N+1
        work = stop._pending[0]
        stop.settle()
        assert work.is_completed() and stop._pending[0] is work  # done, and still the next step's to read
        assert stop.agreed() == signal.SIGTERM
        stop.settle()
    finally:
        dist.destroy_process_group()


def test_a_process_forked_inside_ignores_the_stop_its_rank_handles():
    """A loader's workers are forked from the rank with its handler, and a Ctrl-C reaches the whole process group:
    each worker logged "SIGINT received ... then save" again (three lines per rank with input.num_workers=2) and
    noted a stop it never acts on. The rank stops them; they ignore it."""
    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger, handler = logging.getLogger("dlaunch"), Said()
    logger.addHandler(handler)
    try:
        with StopRequests(distributed=False) as stop:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.kill(os.getpid(), signal.SIGINT)
                os.write(write, f"{stop.signum} {len(said)}".encode())
                os._exit(0)
            os.close(write)
            child = os.read(read, 64).decode()
            os.waitpid(pid, 0)
            assert child == "0 0" and stop.signum == 0 and said == []
            pid = os.fork()
            if pid == 0:  # SIGTERM still ends such a process, as a rank's Process.terminate() means it to
                os.kill(os.getpid(), signal.SIGTERM)
                os._exit(0)
            assert os.waitpid(pid, 0)[1] == signal.SIGTERM  # killed by it, not exited
            os.kill(os.getpid(), signal.SIGINT)  # the rank itself still notes and says it
            assert stop.signum == signal.SIGINT
    finally:
        logger.removeHandler(handler)
    assert said == ["SIGINT received: the ranks stop together within a step, then save"]
