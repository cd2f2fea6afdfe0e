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


def test_the_collective_a_thread_waits_in_is_the_outermost_of_torch_distributed_that_the_users_code_called():
    """Frames as a collective blocked in C++ leaves them: functions of torch's distributed_c10d.py (compiled from
    that file's name, since no collective can block in a one-process test), under the user's own frame."""
    import time

    ready, release = [], []  # list.append: C, no frame of its own to be seen in
    c10d = {"ready": ready, "release": release, "sleep": time.sleep}
    exec(compile("def wait():\n    ready.append(1)\n    while not release:\n        sleep(0.005)\n"  # C, as gloo's wait
                 "def all_gather(): wait()\ndef all_gather_object(): all_gather()\ndef get_rank(): wait()",
                 user_frames._C10D, "exec"), c10d)
    for called, seen in (("all_gather_object", "all_gather_object"), ("all_gather", "all_gather"), ("get_rank", "")):
        ready.clear(), release.clear()
        thread = threading.Thread(target=lambda f=c10d[called]: f())
        thread.start()
        try:
            while not ready:
                time.sleep(0.001)
            assert user_frames.collective(thread.ident) == seen, called
            assert user_frames.collective(threading.get_ident()) == ""  # this thread: in no collective
        finally:
            release.append(True)
            thread.join()
