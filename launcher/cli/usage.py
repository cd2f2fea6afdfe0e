"""What ``dlaunch`` answers before it imports torch: ``--help``, ``--version`` and torchrun-style flags.

These come back in well under a second: the help text is built from
``launcher/cli/help_data.py``, which ``python -m launcher.cli.helpgen`` writes
from the pydantic schema (``tests/cli/test_usage.py`` checks it is current).

    dlaunch --help
    dlaunch --version
    dlaunch --nproc_per_node=2    # exit 2: "use cluster=1x2"
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from launcher.cli import help_data

# Flags Hydra's own parser accepts (hydra/_internal/utils.py get_args_parser), with or without a value.
INFO = ("--info", "-i")  # Hydra's one flag whose value is optional (const "all")
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
_HYDRA_VALUED = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--cfg", "-c", "--package", "-p",
                 "--experimental-rerun"}
HYDRA_FLAGS = {
    "--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p", "--run", "-r",
    "--multirun", "-m", "--shell-completion", "-sc", "--config-path", "-cp", "--config-name", "-cn",
    "--config-dir", "-cd", "--experimental-rerun", "--info", "-i",
}

COMMANDS = (
    ("dlaunch [KEY=VALUE ...]", "run one job, e.g. dlaunch recipe=linear strategy=mirrored cluster=1x2"),
    ("dlaunch script=train.py [KEY=VALUE ...] -- ARGS", "run your own training script on every rank, as torchrun "
     "would (docs/SCRIPTS.md)"),
    ("dlaunch -m KEY=A,B ...", "a sweep: one job per combination, then one table (sweep_summary.json)"),
    ("dlaunch recipes ls | cp NAME DEST | validate PATH", "the recipe templates: list, copy, check"),
    ("dlaunch report RUN_OR_SWEEP_DIR", "PNG curves and report.html beside a run's or sweep's data"),
    ("dlaunch resume RUN_OR_SWEEP_DIR [KEY=VALUE ...]", "continue a stopped run (or every job of a sweep) from its newest checkpoint, in its directory"),
)

OPTIONS = (
    ("--help, -h", "this text"),
    ("--version", "dlaunch's version"),
    ("--cfg job", "print the composed config (a recipe's Config defaults join it as a run starts) and start nothing"),
    ("launch.dry_run=true", "print the plan and start nothing"),
    ("--config-dir DIR", "your own config groups (DIR/recipe/NAME.yaml, ...), searched first"),
    ("-m, --multirun", "sweep over comma-separated values"),
    ("--hydra-help", "Hydra's own options"),
)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("dlaunch")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _table(rows, indent: int = 2) -> list[str]:
    width = max(len(left) for left, _ in rows)
    return [f"{' ' * indent}{left.ljust(width)}  {right}".rstrip() for left, right in rows]


def help_text() -> str:
    lines = ["dlaunch: train a PyTorch recipe, or your own script, on a planned cluster with tf.distribute-style "
             "strategies.", "",
             "Commands:", *_table(COMMANDS), "", "Options:", *_table(OPTIONS), "",
             "Config groups (pick one option each, e.g. strategy=mirrored):"]
    for group, options in help_data.GROUPS.items():
        lines.append(f"{group}: {', '.join(name for name, _ in options)}")
        lines += _table(options, indent=4)
    lines += ["", "Settings (KEY=VALUE; dlaunch's default in brackets, which a recipe's YAML may set otherwise: --cfg job shows the run's):"]
    for section, keys in help_data.SECTIONS.items():
        lines.append(f"{section}:")
        lines += _table([(f"{section}.{key} [{default}]", text) for key, default, text in keys], indent=4)
    lines += ["", "Exit codes: 0 done, 1 training failure, 2 config error, 128+N stopped by signal N.",
              "Results (the plan, the result table) go to stdout; logs and errors go to stderr. More: docs/CLI.md"]
    return "\n".join(lines) + "\n"


# torchrun's and Accelerate's flags, and the dlaunch overrides that say the same.
_FLAG = re.compile(r"^--?([A-Za-z][\w-]*)(?:=(.*))?$")
_SAME_AS = {
    "nproc_per_node": "cluster=NODESx{v} (devices per node)",
    "num_processes": "strategy=mirrored cluster=1x{v} (a process per device on one machine)",
    "nnodes": "cluster={v}xDEVICES (nodes)",
    "num_machines": "cluster={v}xDEVICES (nodes)",
    "node_rank": "cluster.node_rank={v}",
    "machine_rank": "cluster.node_rank={v}",
    "master_addr": "cluster.master_addr={v}",
    "main_process_ip": "cluster.master_addr={v}",
    "master_port": "cluster.master_port={v}",
    "main_process_port": "cluster.master_port={v}",
    "rdzv_endpoint": "cluster.master_addr={host} cluster.master_port={port}",
    "max_restarts": "launch.max_restarts={v}",
    "monitor_interval": "launch.monitor_interval_s={v}",
    "mixed_precision": "trainer.precision=bf16-mixed (or fp16-mixed, fp32)",
    "standalone": "nothing: one machine is the default (cluster=1xM)",
    "rdzv_backend": "nothing: dlaunch always uses c10d",
    "rdzv_id": "nothing: dlaunch names each run itself",
    "multi_gpu": "strategy=mirrored cluster=1xM",
    "cpu": "cluster.device=cpu",
    "log_dir": "nothing: each rank keeps its output in RUN_DIR/logs/",
    "redirects": "nothing: each rank keeps its output in RUN_DIR/logs/",
    "tee": "nothing: each rank keeps its output in RUN_DIR/logs/",
    "gradient_accumulation_steps": "trainer.grad_accum_steps={v} (a recipe's loop; a script accumulates under "
                                   "strategy.no_sync(model), docs/SCRIPTS.md)",
}
# The flags whose value "the same run" gives as the override above
_KEPT = ("node_rank", "machine_rank", "master_addr", "main_process_ip", "master_port", "main_process_port", "max_restarts",
         "monitor_interval")
_PRECISIONS = {"bf16": "bf16-mixed", "fp16": "fp16-mixed"}  # Accelerate's --mixed_precision, as trainer.precision
# What a flag means for a script, where that differs: a script runs its own loop (docs/SCRIPTS.md).
_FOR_A_SCRIPT = {
    "mixed_precision": "trainer.precision=bf16-mixed (or fp16-mixed), which the script's own loop takes by "
                       "entering `with strategy.autocast():` (and strategy.grad_scaler() under fp16; docs/SCRIPTS.md)",
}


def _script_at(argv: list[str]) -> int | None:
    """Where a torchrun-style command names its script (``train.py``): what follows is the script's arguments. A
    Hydra option's value (``-cd tools.py``, ``--experimental-rerun x.py``) is none."""
    values = _hydra_options(argv)[1]
    return next((i for i, a in enumerate(argv)
                 if i not in values and a.endswith(".py") and "=" not in a and not a.startswith("-")), None)


def _unknown_flags(argv: list[str]) -> list[tuple[str, str | None, list[str]]]:
    """``--name[=value]`` arguments (before ``--``) that Hydra's parser would refuse, with their values and the
    arguments they were typed as."""
    found, i = [], 0
    head = argv[: argv.index("--")] if "--" in argv else argv
    at = _script_at(head)
    head = head if at is None else head[:at]  # torchrun's form: the script's own arguments follow it
    while i < len(head):
        arg = head[i]
        match = _FLAG.match(arg)
        if match and arg.split("=")[0] not in HYDRA_FLAGS:
            name, value, typed = match.group(1).replace("-", "_"), match.group(2), [arg]
            if value is None and i + 1 < len(head) and not head[i + 1].startswith("-") and "=" not in head[i + 1]:
                value, i = head[i + 1], i + 1
                typed.append(value)
            found.append((name, value, typed))
        i += 1
    return found


_MODULE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")  # pkg.train: not an override (~recipe, a=b), not a flag


def _module_as_script(argv: list[str]) -> tuple[list[str], str | None]:
    """torchrun's ``-m NAME`` / ``--module NAME`` (python's ``-m``): ``argv`` with the module in the script's place
    (as the file it names, ``NAME/WITH/SLASHES.py``), and the module; Hydra's ``-m`` (a sweep) is followed by
    overrides instead."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    script = _script_at(head)
    head = head if script is None else head[:script]  # a script's own `-m NAME` is its argument
    for i, arg in enumerate(head):
        name = arg.partition("=")[2] if arg.startswith("--module=") else (
            head[i + 1] if arg in ("-m", "--module") and i + 1 < len(head) else "")
        if _MODULE.match(name):
            taken = 1 if "=" in arg else 2
            return [*argv[:i], name.replace(".", "/") + ".py", *argv[i + taken:]], name
    return argv, None


def flag_message(argv: list[str]) -> str | None:
    """One screen mapping torchrun-style flags to dlaunch overrides; None when there are none."""
    argv, module = _module_as_script(argv)
    spans = _unknown_flags(argv)
    flags = [(name, value) for name, value, _ in spans]
    head = argv[: argv.index("--")] if "--" in argv else argv  # after --: the script's own arguments
    at = _script_at(head)
    # `dlaunch train.py --epochs 1`, as python or accelerate launch takes it: Hydra's parser would refuse the flags
    if not flags and module is None and (at is None or not any(a.startswith("-") for a in head[at + 1:])):
        return None
    rows = []  # (what was given, what to use): one column, as wide as the longest given
    script = next((a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("script=")), None)
    unknown = f"unknown option; a script's own arguments go after --: dlaunch script={script} -- ARGS" if script else \
        "unknown option; dlaunch --help lists the options and settings"
    for name, value in flags:
        given = f"--{name}" + (f"={value}" if value is not None else "")
        if name in _FOR_A_SCRIPT and (script or at is not None):
            rows.append((given, f"use {_FOR_A_SCRIPT[name]}"))
        elif name in _SAME_AS:
            host, _, port = (value or "").rpartition(":") if ":" in (value or "") else (value, "", "")  # host:port
            rows.append((given, "use " + _SAME_AS[name].format(v=_count(value), host=host or "HOST", port=port or "PORT")))
        else:
            rows.append((given, unknown))
    before = head if at is None else head[:at]  # a script's own arguments follow it
    options, taken = _hydra_options(before)  # -m, --config-dir DIR: the same run keeps them, and the overrides typed
    typed = [*options, *(a for i, a in enumerate(before) if i not in taken and "=" in a and not a.startswith("-"))]
    if at is not None:
        run = f"script.module={module}" if module else f"script={argv[at]}"
        rows.append((f"-m {module}" if module else argv[at], f"a {'module' if module else 'script'} runs as {run} (docs/SCRIPTS.md)"))
        # dlaunch's settings typed after the script (`train.py --epochs 1 cluster.device=cpu`) are dlaunch's still
        settings = [a for a in argv[at + 1:] if _is_setting(a)]
        same = _same_run(dict(flags), run, [a for a in argv[at + 1:] if a not in settings], typed + settings)
    else:  # a recipe's run: the overrides typed beside the flags, and what the flags say; script=PATH's own flags
        own = [t for name, _, given in spans if script and name not in _SAME_AS for t in given]
        same = _same_run(dict(flags), None, own, typed)
    after = [f"the same run: {same}", *(["  (TOKEN: the one node 0's plan shows; docs/OPERATIONS.md)"]
                                         if "cluster.token=TOKEN" in same else [])] if same else \
        ["e.g. torchrun --nnodes=2 --nproc_per_node=8 is dlaunch cluster=2x8 (docs/CLI.md: torchrun flags)"]
    width = max(28, *(len(given) for given, _ in rows))
    title = "not launcher flags" if flags else "and a script as script=PATH, its own arguments after --"
    return "\n".join([f"dlaunch takes KEY=VALUE overrides, {title}:",
                      *(f"  {given:<{width}} {use}" for given, use in rows), *after])


def _is_setting(arg: str) -> bool:
    """``cluster.device=cpu``, ``strategy=mirrored``, ``+trainer.x=1``, ``hydra.run.dir=D``: a dlaunch override, not a
    script's own argument. A script's Hydra may have sections of the same names (``trainer.max_epochs=3``,
    ``input.path=D``): under dlaunch's sections only dlaunch's own keys are its, unless ``+``/``~`` asks for it."""
    if "=" not in arg or arg.startswith("-"):
        return False
    key = arg.partition("=")[0]
    head, _, rest = key.lstrip("+~").partition(".")
    if head in help_data.SECTIONS and head not in help_data.GROUPS and rest and key[0] not in "+~":
        return rest.split(".")[0] in {k.split(".")[0] for k, *_ in help_data.SECTIONS[head]}
    return head in {*help_data.GROUPS, *help_data.SECTIONS, "hydra"}


def _hydra_options(head: list[str]) -> tuple[list[str], set[int]]:
    """Hydra's own options in ``head`` (``-m``, ``--config-dir DIR``, ``--info config``), each with its value, and the
    positions they take: what "the same run" keeps of them, as typed."""
    found, taken, i = [], set(), 0
    while i < len(head):
        name = head[i].split("=")[0]
        if name in HYDRA_FLAGS:
            after = head[i + 1] if i + 1 < len(head) and "=" not in head[i] else None
            if name in INFO:
                takes = after in INFO_CHOICES
            else:
                takes = name in _HYDRA_VALUED and after is not None and not after.startswith("-")
            found += head[i:i + 1 + takes]
            taken.update(range(i, i + 1 + takes))
            i += takes
        i += 1
    return found, taken


def _count(value: str | None) -> str:
    """A flag's number; torchrun's ``gpu``/``auto`` (every GPU here) as this machine's GPU count, which a cluster shape
    names explicitly."""
    if value in ("gpu", "auto"):
        from launcher.cluster import gpus

        return str(gpus.count() or "N")
    return value or "N"


def _same_run(flags: dict[str, str | None], run: str | None, args: list[str], typed: list[str] = ()) -> str | None:
    """The dlaunch command of a torchrun or Accelerate command line: its cluster, a strategy with a process per
    device, where the nodes meet, the script (or the overrides ``typed`` beside the flags, for a recipe), and the
    script's own arguments after ``--``; ``run``: the script's override (``script=PATH``). None where the sizes are not plain numbers (``--nnodes=1:4``,
    ``--nproc_per_node=gpu``), or where no flag says anything a recipe's run would take."""
    nodes = flags.get("nnodes") or flags.get("num_machines") or "1"
    per_node = flags.get("nproc_per_node") or flags.get("num_processes") or "1"
    if not (nodes.isdigit() and per_node.isdigit()):
        return None
    words = ["dlaunch", run or "", *typed]
    if f"{nodes}x{per_node}" != "1x1":
        words += ["strategy=" + ("mirrored" if nodes == "1" else "multi_worker_mirrored"), f"cluster={nodes}x{per_node}"]
    words += [_SAME_AS[name].format(v=value) for name, value in flags.items() if value and name in _KEPT]
    host, _, port = (flags.get("rdzv_endpoint") or "").rpartition(":")
    words += [f"cluster.master_addr={host}", f"cluster.master_port={port}"] if host and port.isdigit() else []
    rank = flags.get("node_rank") or flags.get("machine_rank") or "0"
    words += ["cluster.token=TOKEN"] if rank != "0" else []  # node 0 admits the nodes that give its token
    precision = _PRECISIONS.get(flags.get("mixed_precision") or "")
    words += [f"trainer.precision={precision}"] if precision else []
    words += ["cluster.device=cpu"] if "cpu" in flags else []  # Accelerate's --cpu
    args = [a for a in args if a != "--"]
    words = [w for w in words if w]
    if run is None and len(words) == 1 + len(typed) and not args:
        return None
    return shlex.join([*words, *(["--", *args] if args else [])])


def early_exit(argv: list[str]) -> int | None:
    """The exit code when ``argv`` is answered here (help, version, launcher flags); None: go on to the run."""
    if argv and argv[0] in SUBCOMMANDS:
        return None
    head = argv[: argv.index("--")] if "--" in argv else argv
    if "--help" in head or "-h" in head:
        sys.stdout.write(help_text())
        return 0
    if "--version" in head:
        sys.stdout.write(f"dlaunch {version()}\n")
        return 0
    message = flag_message(argv) or command_message(argv)
    if message:
        sys.stderr.write(message + "\n")
        return 2
    return None


SUBCOMMANDS = ("recipes", "report", "resume")  # cli/main.py runs each


def command_message(argv: list[str]) -> str | None:
    """A first word that is no override, flag, file or command (``dlaunch reprot DIR``, ``dlaunch train``): the
    commands there are, and the one meant."""
    first = argv[0] if argv else ""
    if not re.fullmatch(r"[A-Za-z][\w-]*", first) or os.path.exists(first):
        return None
    from launcher.config.errors import did_you_mean  # rich: not for --help

    meant = did_you_mean(first, list(SUBCOMMANDS))
    rest = " ".join(argv[1:])
    said = f"; did you mean `dlaunch {meant}{' ' + rest if rest else ''}`?" if meant else "."
    return (f"dlaunch: unknown command {first!r}{said} The commands are {', '.join(SUBCOMMANDS)}; a run is "
            "`dlaunch KEY=VALUE ...` (e.g. dlaunch recipe=linear)")
