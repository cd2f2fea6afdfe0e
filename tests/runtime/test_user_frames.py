"""Where a rank's own code is, for the heartbeat's record of a rank that hangs."""

import threading

from launcher.runtime import user_frames


def _blocked_in_user_code(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()


def test_where_is_the_innermost_frame_of_user_code():
    ready, release = threading.Event(), threading.Event()
    thread = threading.Thread(target=_blocked_in_user_code, args=(ready, release))
    thread.start()
    try:
        ready.wait(5)
        assert user_frames.where(thread.ident).startswith("_blocked_in_user_code (test_user_frames.py:")
    finally:
        release.set()
        thread.join()


def _calls_a_collective():
    raise RuntimeError("Timed out waiting 20000ms for recv operation")


def test_in_traceback_is_the_innermost_frame_of_user_code_an_exception_passed_through():
    import json

    try:
        json.loads("[1]", object_hook=None, parse_int=lambda _: _calls_a_collective())
    except RuntimeError as exc:
        found = user_frames.in_traceback(exc.__traceback__)
    line = _calls_a_collective.__code__.co_firstlineno + 1
    assert found == f"_calls_a_collective (test_user_frames.py:{line})"  # json's own frames (the stdlib) are passed over
    assert user_frames.in_traceback(None) == ""
