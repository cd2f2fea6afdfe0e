"""Stop signals in a worker: the flag a handler sets, and what it logs."""

from __future__ import annotations

import logging
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
