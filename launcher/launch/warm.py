"""Warm workers: fork them from a process that has already imported them.

A worker spends most of its start-up importing torch and dlaunch (about 1.2 s on
this project's 2-core machine), and a fresh interpreter per worker pays it again
for each one, after the launcher has composed, planned and started its agent.
``torchrun`` pays it too, but its parent does less before that.

dlaunch therefore starts a ``multiprocessing`` forkserver as the command starts
(``launcher/cli/entry.py``), unless the command line rules out a run (help, a
dry run, a subcommand, a sweep run by joblib or SLURM) or a run of more than one process (``may_ask_for_workers``:
a plain ``dlaunch recipe=charlm`` trains in dlaunch, and the server would cost it about
2 s of CPU). The forkserver imports ``launcher.runtime.worker``
(and ``torch._dynamo``, which the first optimizer step would import) on another
core while the launcher imports, composes, validates, plans and starts
torch.distributed.elastic. Once the job is validated, a job that is not local CPU
processes (one process, CUDA, a node of several machines) stops it. A sweep's jobs, run one
after the other in dlaunch, share it: each job asks as it starts (``fits``). ``dlaunch resume DIR``
starts it once it has read the run's own command line (``start_for_resume``). The elastic agent
then starts each worker as a function (``start_method="forkserver"``): a fork of
an interpreter whose imports are done. Monitoring, restarts, output tagging and
failure files stay the agent's. Emulated nodes and parameter-server tasks fork
their agents from it instead (``launch/agents.py``); each forks its workers from a server of its own
(``launch/agent_server.py``).

The forkserver inherits the workers' environment (``worker_environment``): it is
started inside it, because torch reads some variables (``OMP_NUM_THREADS``) when it
is imported. It dies with dlaunch, however dlaunch ends (``forkserver_guard``), and
its children follow it (``die_with_launcher``). ``launch.warm_workers=false`` starts every worker as a
fresh interpreter instead (``python -m launcher.runtime.worker_entry``). A command forked from an
interpreter that ``prewarm`` prepared (the test suite's) has those imports already, and forks its server
from itself (``launch/forked_server.py``) where torch loaded as the workers' environment would load it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.resources
import multiprocessing
import os
import signal
import sys
import time
from multiprocessing import forkserver, resource_tracker
from typing import Any, Iterator

from launcher.cluster.env import import_time_settings, quiet_cpp_variables, torch_settings, worker_environment, worker_env_set
from launcher.config import shapes
from launcher.config.overrides import key_of
from launcher.launch import forked_server

# torch._dynamo (with sympy, about 0.9 s here) is imported by a process's first optimizer step: in the
# server it is imported once, off the workers' critical path. The server stays single-threaded.
PRELOAD = ["launcher.launch.forkserver_guard", "launcher.runtime.worker", "torch._dynamo", "launcher.launch.agents",
           "launcher.launch.tasks", "launcher.launch.emulate"]
_prewarmed: dict[str, str] | None = None  # the environment torch loaded with in this process, where prewarm imported it
_started = False
_resume_may_warm = False  # the console script runs `dlaunch resume`, which warms up once it knows the run's command
_kept = False  # the job that runs now forks its workers, or its agents, from it (fits)
_server_environ: dict[str, str] = {}  # the server's whole environment, which its forks inherit (torch loaded in it)


def eligible(spec: Any, cuda_devices: int) -> bool:
    """A local CPU job of more than one process: the workers of one node that this dlaunch starts with its own agent,
    or the agents of emulated nodes or parameter-server tasks (``launch/agents.py``), with their own servers."""
    c = spec.cluster
    launcher = spec.strategy.launcher(spec)
    return (
        spec.launch.warm_workers
        and sys.platform == "linux"
        and spec.device_type(cuda_devices) == "cpu"
        and (launcher in ("emulated", "tasks")
             or launcher == "elastic" and c.nodes == 1 and c.task is None and spec.num_processes > 1)
    )


# Command lines that never start local workers: no warming before they are parsed properly. A sweep (-m) warms too:
# its jobs run one after the other in this process (Hydra's basic launcher), each forking from the one server.
_NOT_A_RUN = ("-h", "--help", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc",
              "launch.dry_run=true", "launch.warm_workers=false", "recipes", "report")


# A --config-dir, --config-name or --config-path may change the default shape (dlaunch's own is one process).
_OTHER_CONFIG = ("--config-dir", "-cd", "--config-name", "-cn", "--config-path", "-cp")


def start_early(argv: list[str]) -> bool:
    """At the command's very start, before torch is imported: warm up if the command line can ask for workers.

    Whether the job needs workers is known only once its config is validated (a
    second later); ``keep_if_useful`` then keeps the server, or stops it. A command
    line that cannot ask for more than one local process starts none: the server
    would cost a second or two of CPU for nothing.
    """
    global _resume_may_warm
    if argv[:1] == ["resume"]:  # its command line is the run's own, read from its directory: start_for_resume
        _resume_may_warm = True
        return False
    if sys.platform != "linux" or any(arg in _NOT_A_RUN or _jobs_elsewhere(arg) for arg in argv):
        return False
    if not may_ask_for_workers(argv):
        return False
    _launch(several_nodes(argv))
    return True


def start_for_resume(argv: list[str]) -> bool:
    """``dlaunch resume DIR``, once it has read the run's own command line ``argv``: warm up as that command did
    (``start_early``), where the console script runs it."""
    if not _resume_may_warm:
        return False
    if several_nodes(argv):  # as the console script does before torch loads
        from launcher.cluster import env

        env.quiet_cpp_warnings()
    return start_early(argv)


def _jobs_elsewhere(arg: str) -> bool:
    """A launcher that runs the jobs in other processes (joblib's, SLURM's): none forks from this one's server."""
    return key_of(arg) == "hydra/launcher" and arg.partition("=")[2].strip() not in ("", "basic")


def may_ask_for_workers(argv: list[str]) -> bool:
    """Whether ``argv`` can make a run of more than one local process.

    With dlaunch's own config (cluster 1x1) and a shipped recipe (none sets a shape), only
    the cluster's shape keys and ``strategy=parameter_server`` (its tasks) can; another primary
    config or a user's recipe YAML may set them too.
    """
    recipes = importlib.resources.files("launcher.recipes").iterdir()
    shipped = {f.name.removesuffix(".yaml") for f in recipes if f.name.endswith(".yaml")}
    for arg in argv:
        key = key_of(arg)
        if key in _OTHER_CONFIG or key in ("cluster.nodes", "cluster.devices_per_node"):
            return True
        for value in (c.strip() for c in arg.partition("=")[2].split(",")):  # a sweep's choices: any of them
            shape = shapes.SHAPE.match(value) if key == "cluster" else None
            if key == "cluster" and (not shape or int(shape[1]) * int(shape[2]) > 1):
                return True
            if key == "recipe" and value not in shipped or key == "strategy" and value == "parameter_server":
                return True
    return False


def several_nodes(argv: list[str]) -> bool:
    """Whether ``argv`` likely sets a shape of more than one node, or parameter-server tasks (``quiets_cpp``): dlaunch
    will quiet torch's C++ store warnings (``env.quiet_cpp_warnings``), which torch reads as it loads, so the server
    must load it so too. A wrong guess costs only the server: ``keep_if_useful`` stops one that loaded torch otherwise
    than the validated job needs."""
    for arg in argv:
        key, choices = key_of(arg), arg.partition("=")[2].split(",")  # a sweep's choices: any of them
        for value in (c.strip() for c in choices):
            if key == "strategy" and value == "parameter_server":
                return True
            shape = shapes.SHAPE.match(value) if key == "cluster" else None
            if (shape and int(shape[1]) > 1 or key == "cluster.nodes" and value not in ("", "1")
                    or key == "cluster" and value == "tasks" or key == "cluster.tasks"):  # a task list: a node per task
                return True
    return False


def keep_if_useful(spec: Any, cuda_devices: int) -> bool:
    """Once the job is validated: keep the early forkserver if the job can use it, else stop it.

    Only the console script starts one (``start_early``): a ``main()`` called in
    another program (a test, a notebook) starts its workers as fresh interpreters,
    which see that program's environment as it is at launch.
    """
    if fits(spec, cuda_devices):
        return True
    stop()
    return False


def keep_for_sweep(specs: list[Any], cuda_devices: int, undecided: bool) -> bool:
    """Once a sweep's jobs are validated: keep the server if any of them can use it (``undecided``: a job validated
    only when it runs, which may), else stop it. Each job then asks ``fits`` as it starts."""
    if _started and (undecided or any(_usable(spec, cuda_devices) for spec in specs)):
        return True
    stop()
    return False


def fits(spec: Any, cuda_devices: int) -> bool:
    """Whether this job forks its workers (or agents) from the server: it is running, the job is local CPU processes
    (``eligible``), and torch loaded in it as the job's workers will load it. A lone run asks once
    (``keep_if_useful``), each job of a sweep as it starts; ``serves`` answers for the job that asked last."""
    global _kept
    _kept = _usable(spec, cuda_devices)
    return _kept


def _usable(spec: Any, cuda_devices: int) -> bool:
    """Eligible, and every variable read as a process starts and imports torch (``TORCH*``, ``OMP_*``, ``PYTHON*``:
    ``env.import_time_settings``) is as in the server: a sweep job's ``hydra.job.env_set`` may change them."""
    if not (_started and eligible(spec, cuda_devices)):
        return False
    job = _job_environment(spec)
    workers = {**job, **worker_environment(single_node=True, environ=job)}
    return import_time_settings(workers) == import_time_settings(_server_environ)


def quiets_cpp(spec: Any) -> bool:
    """Whether dlaunch quiets torch's C++ warnings for this job (``launcher/cli/main.py``), before torch loads: one of
    several nodes (a store gone away), or of parameter-server tasks (TensorPipe's per-connection warnings, which each
    task's workers are quieted of anyway: ``env.task_environment``). The job's agents, and the servers their workers
    fork from, then load torch as its workers do."""
    return spec.cluster.nodes > 1 or spec.strategy.launcher(spec) == "tasks"


def _job_environment(spec: Any) -> dict[str, str]:
    """This process's environment once the job starts: a job that ``quiets_cpp``, the server's torch must have
    loaded so too."""
    return {**os.environ, **(quiet_cpp_variables() if quiets_cpp(spec) else {})}


def forks_agents() -> bool:
    """Whether the validated job forks its agents (emulated nodes', tasks') from the server: it kept it, and torch
    loaded there with the ``TORCH*`` variables a fresh agent would load it with now (its C++ log level, say)."""
    return _kept and _started and torch_settings(os.environ) == torch_settings(_server_environ)


def stop() -> None:
    """Stop the forkserver (its imports too, if they are still running)."""
    global _started
    if _started:
        server = forkserver._forkserver
        if server._forkserver_pid is not None:
            os.kill(server._forkserver_pid, signal.SIGKILL)  # at once: it would finish its imports before reading a stop
        server._stop()
        _started = False


def shutdown(wait_s: float = 10.0) -> None:
    """At the command's end: once the server has reaped every worker it forked (their CPU time is then this
    process's), kill it and reap it.

    Left to exit by itself (the end of its keep-alive pipe), the server shuts a whole interpreter down with torch
    imported, before dlaunch could end: 5.3 s from a stop signal to the end under one CPU hog (3.5 s killed),
    15.3 s under five test streams and the hog. It holds nothing to save. A server no job kept (a config error,
    say) is stopped at once: it would finish importing torch first, seconds after the error was shown.
    """
    if not _started:
        return
    if not _kept:
        stop()
        return
    pid = forkserver._forkserver._forkserver_pid
    deadline = time.monotonic() + wait_s
    while pid is not None and time.monotonic() < deadline and has_children(pid):  # None: gone, or unreadable
        time.sleep(0.01)
    stop()


def has_children(pid: int) -> bool | None:
    """Whether process ``pid`` (a forkserver) has a child still running or unreaped; None where that cannot be read
    (it is gone, or the kernel has no ``children`` file)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return bool(f.read().split())
    except OSError:
        return None


def _launch(quiet_cpp: bool = False) -> None:
    global _started, _server_environ
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    env = worker_environment(single_node=True)
    if quiet_cpp:
        env.update(quiet_cpp_variables())
    with worker_env_set(env), sigint_blocked():
        _server_environ = dict(os.environ)
        # a process that has imported what the server would forks it (where torch loaded as the workers' would)
        if not (_prewarmed is not None and forked_server.possible()
                and import_time_settings(_prewarmed) == import_time_settings(os.environ) and forked_server.fork(_prepare_forked)):
            forkserver.ensure_running()  # returns at once; the server imports while dlaunch goes on
    _started = True


def prewarm() -> bool:
    """For a program that runs many dlaunch commands, each in a fork of itself (the test suite's ``tests/prewarmed.py``):
    import now, before torch is imported, what the warm server would import, and note the environment torch loads in.
    A command forked from it later then forks its warm server from itself, in a moment and without a second copy of
    those imports, where this process started and torch loaded as the workers' environment would have them; a
    fresh server otherwise. Whether torch was imported here (it was not if something had imported it before).
    Compared are the variables read as a process starts and imports torch (``env.import_time_settings``: ``TORCH*``,
    ``OMP_*``, ``PYTHON*`` such as ``PYTHONUNBUFFERED``, which the workers' environment sets)."""
    global _prewarmed
    if "torch" in sys.modules:
        return False
    environment = dict(os.environ)
    for module in PRELOAD[1:]:  # not the guard, whose import guards the process that imports it
        importlib.import_module(module)
    _prewarmed = environment
    return True


def _prepare_forked() -> None:
    """In a server forked from dlaunch: the stop signals as they were before dlaunch noted them, then guarded as a
    fresh server is (its first import)."""
    from launcher.cli import interrupts

    interrupts.forget()
    from launcher.launch import forkserver_guard  # noqa: F401 - its import (the first: dlaunch never imports it) guards


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT held back in this thread while it starts the server, which inherits the block through ``exec``.

    A Ctrl-C reaches the server too (it shares dlaunch's process group). In the interpreter's own start-up, before
    ``forkserver_guard`` handles SIGINT, it printed ``Fatal Python error: init_import_site`` on the terminal. Held
    back, it waits until the guard's handler takes it and ends the server quietly. Here it is delivered when the
    block is lifted, so dlaunch still sees every Ctrl-C.
    """
    resource_tracker.ensure_running()  # first: starting it lifts this same block (CPython's bpo-33613 guard)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def started() -> bool:
    """Whether this process has a warm forkserver for its workers."""
    return _started


def environments() -> tuple[dict[str, str], dict[str, str]]:
    """For the workers the job forks now: dlaunch's environment, which a fresh worker would copy (a sweep job's
    ``hydra.job.env_set`` is set in it by now), and the server's, which a fork inherits (``worker.run_job``)."""
    return dict(os.environ), _server_environ


def serves() -> bool:
    """Whether the job that runs now forks its workers from the warm server (``fits``)."""
    return _started and _kept
