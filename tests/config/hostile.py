"""Hostile configs, generated: every one must be refused before anything starts.

Per-field wrong values come from walking the pydantic models (so a new field is
covered without a new line here); group options get edit-distance-1 typos; the
rest are the shapes, batches, addresses, recipe files and input files that can
go wrong. A case's overrides may name ``@RECIPES@`` and ``@DATA@``, the
directories that ``tests/config/hostile_files.py`` fills.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from launcher.config import compose as composer
from launcher.config import shapes
from launcher.config.pydantic_errors import annotation_members
from launcher.config.schema import RunSpec

SETUP = {  # overrides that make a section present and otherwise valid
    "cluster.task": ("strategy=mirrored", "cluster=tasks", "cluster.task={type: chief, index: 0}"),
}
WRONG_TYPE = {  # a value of another type, as Hydra parses it, per expected type
    int: ("abc", "true"),
    float: ("abc", "nan"),
    bool: ("maybe",),
    str: ("[a,b]",),
    list: ("5",),
    dict: ("5",),
    BaseModel: ("[1]",),
}


@dataclasses.dataclass(frozen=True)
class Case:
    category: str
    overrides: tuple[str, ...]
    key: str  # the dotted key the screen must name
    text: str = ""  # and this, when given

    @property
    def id(self) -> str:
        return f"{self.category}: {' '.join(self.overrides)}"


def typos(word: str, limit: int = 6) -> list[str]:
    """Edit-distance-1 misspellings of ``word``: drops, a swap, a substitution, a doubling."""
    mid = len(word) // 2
    candidates = [word[1:], word[:-1], word[:mid] + word[mid + 1 :], word + word[-1],
                  word[: mid - 1] + word[mid] + word[mid - 1] + word[mid + 1 :] if mid else word,
                  word[:mid] + ("q" if word[mid] != "q" else "z") + word[mid + 1 :]]
    out = list(dict.fromkeys(t for t in candidates if t and t != word and t[0].isalnum()))
    return out[:limit]


# ---------- walking the models ----------
def _constraints(field: FieldInfo) -> list[Any]:
    found = list(field.metadata)
    for member in typing.get_args(field.annotation):
        for extra in typing.get_args(member)[1:] if typing.get_origin(member) is typing.Annotated else ():
            found += extra.metadata if isinstance(extra, FieldInfo) else [extra]
    return found


def _model_of(annotation: Any) -> type[BaseModel] | None:
    models = [m for m in annotation_members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 else None


def sections() -> Iterator[tuple[str, type[BaseModel], tuple[str, ...]]]:
    """``(dotted path, model, set-up overrides)`` for every model of a run: strategies, recipes, nested ones."""
    for name, field in RunSpec.model_fields.items():
        if name == "strategy":
            for model in annotation_members(field.annotation):
                tag = typing.get_args(model.model_fields["name"].annotation)[0]
                yield from _walk("strategy", model, (f"strategy={tag}",))
        elif name == "recipe":  # RecipeSpec defers the section to each recipe's own Config
            for recipe in composer.recipe_files():
                config = importlib.import_module(f"launcher.recipes.{recipe}").Config
                yield from _walk("recipe", config, (f"recipe={recipe}",))
        else:
            yield from _walk(name, _model_of(field.annotation), ())


def _walk(path: str, model: type[BaseModel], setup: tuple[str, ...]) -> Iterator[tuple[str, type[BaseModel], tuple[str, ...]]]:
    yield path, model, setup
    for name, field in model.model_fields.items():
        child = _model_of(field.annotation)
        if child is not None:
            yield from _walk(f"{path}.{name}", child, setup + SETUP.get(f"{path}.{name}", ()))


def _fields() -> Iterator[tuple[str, FieldInfo, tuple[str, ...]]]:
    for path, model, setup in sections():
        for name, field in model.model_fields.items():
            yield f"{path}.{name}", field, setup


def _wrong_types(field: FieldInfo) -> list[str]:
    members = annotation_members(field.annotation)
    if type(None) in members:
        members.remove(type(None))
    kind = members[0]
    if typing.get_origin(kind) is typing.Literal:
        allowed = {str(v).lower() for m in members for v in typing.get_args(m)}
        return ["bogus", *[t for t in typos(str(typing.get_args(kind)[0]), 2) if t.lower() not in allowed][:1]]
    base = typing.get_origin(kind) or kind
    base = BaseModel if isinstance(base, type) and issubclass(base, BaseModel) else base
    return list(WRONG_TYPE.get(base, ()))


def _out_of_range(field: FieldInfo) -> list[str]:
    values: list[str] = []
    for c in _constraints(field):
        for attr, step in (("gt", 0), ("ge", -1), ("lt", 0), ("le", 1)):
            bound = getattr(c, attr, None)
            if bound is not None:  # just outside the allowed range
                values.append(str(bound + step))
        if getattr(c, "min_length", None):
            values.append("''")
    return values


def field_cases() -> Iterator[Case]:
    """Every field of every model: a value of another type (in turn), and each bound crossed."""
    for i, (key, field, setup) in enumerate(_fields()):
        wrong = _wrong_types(field)
        literal_typos = wrong[1:] if wrong[:1] == ["bogus"] else []
        for value in [wrong[i % len(wrong)], *literal_typos] if wrong else []:
            yield Case("wrong type", (*setup, f"{key}={value}"), key)
        for value in _out_of_range(field):
            yield Case("out of range", (*setup, f"{key}={value}"), key)


def unknown_key_cases() -> Iterator[Case]:
    yield Case("unknown key", ("+bogus_key=1",), "bogus_key", "unknown key")
    yield Case("unknown key", ("bogus_key=1",), "bogus_key", "unknown key")
    for section in (name for name, _, _ in sections() if "." not in name):
        for typo in typos(section, 1):
            yield Case("unknown key", (f"{typo}.x=1",), f"{typo}.x", "unknown key")
    for path, model, setup in sections():
        yield Case("unknown key", (*setup, f"+{path}.bogus_key=1"), f"{path}.bogus_key", "unknown key")
        for name in list(model.model_fields)[::3]:  # every third field, misspelled
            typo = next((t for t in typos(name) if t not in model.model_fields), None)
            if typo:
                yield Case("unknown key", (*setup, f"{path}.{typo}=1"), f"{path}.{typo}", "unknown key")


def group_cases() -> Iterator[Case]:
    """Misspelled options of every config group, and cluster shapes that are not NxM with N, M >= 1."""
    groups = {g: composer.group_options(g) for g in ("strategy", "recipe")}
    groups["cluster"] = [*composer.file_options("cluster"), "1x1", "1x2", "2x8"]
    groups["hydra/launcher"] = ["basic", "submitit_local", "submitit_slurm"]
    for group, options in groups.items():
        for option in options:
            for typo in typos(option, 2):
                if typo not in options and not (group == "cluster" and _valid_shape(typo)):
                    yield Case("group option", (f"{group}={typo}",), group)
    for shape in ("0x1", "1x0", "0x0", "-1x2", "1x-2", "1X2", "1*2", "x", "2x2x2", "1.5x2"):
        yield Case("group option", (f"cluster={shape}",), "cluster")


def _valid_shape(text: str) -> bool:
    match = shapes.SHAPE.match(text)
    return bool(match) and all(int(v) > 0 for v in match.groups())


def shape_cases() -> Iterator[Case]:
    """Clusters that cannot be run as asked."""
    for shape in ("1x2", "2x1", "2x2", "1x8"):
        yield Case("cluster shape", ("strategy=one_device", f"cluster={shape}"), "cluster", "1 replica")
    yield Case("cluster shape", ("strategy=one_device", "cluster=tasks"), "cluster", "1 replica")
    for shape, rank in (("2x2", 2), ("2x2", 7), ("3x1", 3), ("1x2", 1)):
        yield Case("cluster shape", ("strategy=mirrored", f"cluster={shape}", f"cluster.node_rank={rank}",
                                     "cluster.master_port=29500"), "cluster.node_rank", "is not a node of cluster")
    for rank in (0, 1):
        yield Case("cluster shape", ("strategy=mirrored", "cluster=2x1", f"cluster.node_rank={rank}"), "cluster.master_port", "give a port")
    for extra in ((), ("cluster.devices_per_node=2", "strategy=mirrored")):
        yield Case("cluster shape", ("cluster.device=cuda", *extra), "cluster.device", "no CUDA device")
    yield Case("cluster shape", ("cluster.backend=nccl",), "cluster.backend", "needs CUDA")
    for device in ("cuda:0", "cuda:3"):
        yield Case("cluster shape", (f"strategy.device={device}",), "strategy.device", "CUDA device")
    tasks = "strategy=mirrored", "cluster=tasks"
    yield Case("cluster shape", (*tasks, "+cluster.nodes=3"), "cluster.nodes", "lists 2 node(s)")
    yield Case("cluster shape", ("strategy=mirrored", "cluster=2x1", "cluster.tasks={worker: ['a:1', 'b:1', 'c:1']}"),
               "cluster.nodes", "lists 3 node(s)")
    yield Case("cluster shape", (*tasks, "cluster.task={type: worker, index: 1}"), "cluster.task", "not in cluster.tasks")
    yield Case("cluster shape", (*tasks, "cluster.task={type: chief, index: 1}"), "cluster.task", "not in cluster.tasks")
    yield Case("cluster shape", (*tasks, "cluster.tasks={chief: [], worker: []}"), "cluster.tasks", "no node")
    yield Case("cluster shape", (*tasks, "cluster.tasks={chief: ['a:1', 'b:1']}"), "cluster.tasks", "one chief")
    yield Case("cluster shape", ("recipe.strategies=[one_device]", "strategy=mirrored", "cluster=1x2"), "strategy", "declares")
    yield Case("cluster shape", ("input.auto_shard_policy=FILE",), "input.auto_shard_policy", "not set")
    yield Case("cluster shape", ("recipe=wide_deep", "strategy=parameter_server", "cluster.ps=1", "cluster.workers=1",
                                 "input.drop_remainder=false"), "input.drop_remainder")


def batch_cases() -> Iterator[Case]:
    """Global batches that the replicas cannot share evenly."""
    for strategy in ("mirrored", "multi_worker_mirrored"):
        for i, (nodes, devices) in enumerate(((1, 3), (1, 5), (2, 3), (3, 1), (1, 7), (2, 2), (4, 1), (1, 6))):
            n = nodes * devices
            for gbs in ((n + 1, 10 * n - 1, 1)[i % 3],):
                yield Case("indivisible batch", (f"strategy={strategy}", f"cluster={nodes}x{devices}",
                                                 f"input.global_batch_size={gbs}"), "input.global_batch_size", f"not divisible by {n}")


BAD_HOSTS = (
    "0.0.0.0", "::", "0:0:0:0:0:0:0:0", "256.1.1.1", "1.2.3", "1.2.3.4.5", "10.0.0.1:29500", "http://10.0.0.1",
    "[::1]", "host name", "-node", "node-", "a..b", ".node", "x" * 64, "a." * 127 + "b", "node/1", "node@x",
    "::g", "1::2::3", "", " node", "nöde", "node!",
)
BAD_TASKS = (
    "{chief: ['10.0.0.1']}", "{chief: ['10.0.0.1:']}", "{chief: ['10.0.0.1:abc']}", "{chief: ['10.0.0.1:0']}",
    "{chief: ['10.0.0.1:70000']}", "{chief: [':29500']}", "{chief: ['0.0.0.0:29500']}", "{chief: ['[::]:29500']}",
    "{chief: ['bad_host!:1']}", "{chief: ['10.0.0.1:1'], worker: ['10.0.0.2']}", "{chief: ['10.0.0.1:1'], worker: ['-bad:1']}",
    "{chief: ['10.0.0.1:1'], worker: ['10.0.0.2:99999']}", "{chief: '10.0.0.1:1'}", "{chief: [5]}", "{chief: 5}",
    "{ps: ['10.0.0.1:1']}", "{chief: ['http://10.0.0.1:1']}", "{chief: ['127.0.0.1:1'], worker: ['10.0.0.2:1']}",
)


def address_cases() -> Iterator[Case]:
    multi_node = ("strategy=mirrored", "cluster=2x1", "cluster.node_rank=1", "cluster.master_port=29500")
    for i, host in enumerate(BAD_HOSTS):  # one node, and node 1 of two, in turn
        yield Case("address", (*(multi_node if i % 2 else ()), f"cluster.master_addr='{host}'"), "cluster.master_addr")
    for i, port in enumerate(("-1", "65536", "2.5", "true")):
        yield Case("address", (*(multi_node if i % 2 else ()), f"cluster.master_port={port}"), "cluster.master_port")
    for i, tasks in enumerate(BAD_TASKS):  # given with cluster=tasks, and over an NxM shape, in turn
        shape = "cluster=2x1" if i % 2 else "cluster=tasks"
        yield Case("address", ("strategy=mirrored", shape, f"cluster.tasks={tasks}"), "cluster.tasks")


# (file written by hostile_files.write_recipes, text the screen must show)
BAD_RECIPES = {
    "no_build.py": "no function build", "no_train_step.py": "no function train_step",
    "build_not_callable.py": "no function build", "train_step_not_callable.py": "no function train_step",
    "build_one_arg.py": "build must take (cfg, ctx)", "build_three_args.py": "build must take (cfg, ctx)",
    "step_one_arg.py": "train_step must take", "step_four_args.py": "train_step must take",
    "step_builtin.py": "train_step must take", "evaluate_not_callable.py": "evaluate, when defined",
    "evaluate_one_arg.py": "evaluate, when defined", "syntax_error.py": "syntax_error.py:3: SyntaxError",
    "indentation_error.py": "IndentationError", "raises_at_import.py": "raises_at_import.py:2",
    "import_missing.py": "nosuch_dependency_xyz", "sys_exit.py": "sys.exit(3)", "zero_division.py": "ZeroDivisionError",
    "config_not_recipeconfig.py": "must subclass", "config_not_class.py": "must subclass", "config_plain_class.py": "must subclass",
    "config_validator_raises.py": "config_validator_raises.py", "config_required_field.py": "required key is missing",
    "null_bytes.py": "null_bytes.py", "latin1.py": "SyntaxError", "empty.py": "no function build",
    "a_directory.py": "is not a file", "missing.py": "does not exist", "recipe.txt": "neither a .py file nor a module",
}
# The recipe's own code raised at import: the user's code failed (exit 1), no config problem (exit 2).
RAISE_IN_USER_CODE = {"syntax_error.py", "indentation_error.py", "raises_at_import.py", "import_missing.py", "sys_exit.py",
                      "zero_division.py", "null_bytes.py", "latin1.py"}
BAD_RECIPE_KEYS = {"config_validator_raises.py": "recipe", "config_required_field.py": "recipe.extra_required"}
BAD_MODULES = {
    ".foo": "neither", "..": "neither", "nosuch_module_xyz": "cannot import", "launcher.cli.plan": "no function build",
    "os": "no function build", "launcher.recipes.linear.nothing": "cannot import", "launcher/recipes/linear": "neither",
    "'a b'": "neither", "tests.fixtures": "no function build", "''": "at least 1 character",
}


def recipe_cases() -> Iterator[Case]:
    for name, text in BAD_RECIPES.items():
        yield Case("recipe", (f"recipe.entry=@RECIPES@/{name}",), BAD_RECIPE_KEYS.get(name, "recipe.entry"), text)
    for module, text in BAD_MODULES.items():
        yield Case("recipe", (f"recipe.entry={module}",), "recipe.entry", text)


# (file written by hostile_files.write_inputs, its format when not the extension's)
BAD_INPUTS = (
    "empty.jsonl", "empty.csv", "empty.pt", "empty.npy", "blank.jsonl", "not_json.jsonl", "list.jsonl",
    "string_field.jsonl", "null_field.jsonl", "bool_field.jsonl", "object_field.jsonl", "empty_object.jsonl",
    "ragged.jsonl", "truncated.jsonl", "binary.jsonl", "number.jsonl", "no_header.csv", "not_numbers.csv",
    "short_row.csv", "header_only.csv", "empty_name.csv", "twice.csv", "binary.csv", "jsonl_inside.csv",
    "text.npy", "truncated.npy", "objects.npy", "scalar.npy", "pt_inside.npy", "text.pt", "npy_inside.pt",
    "other_zip.pt", "pickle.pt", "fifo.jsonl", "broken_link.jsonl", "a_directory.jsonl", "truncated_data.npy", "truncated_zip.pt",
)
MISMATCHED = (("ok.jsonl", "npy"), ("ok.jsonl", "csv"), ("ok.csv", "jsonl"), ("ok.npy", "pt"), ("ok.pt", "csv"), ("ok.pt", "npy"))
NO_MATCH = ("@DATA@/nothing-*.jsonl", "@DATA@/missing/dir/*.csv", "@DATA@/**/*.nope", "@DATA@/[", "relative/none-*.jsonl",
            "@DATA@/empty_dir", "@DATA@/empty_dir/*", "/dev/null", "''")


def input_cases() -> Iterator[Case]:
    for name in BAD_INPUTS:
        yield Case("input file", (f"input.files='@DATA@/{name}'",), "input.files", name)
    for name, fmt in MISMATCHED:
        yield Case("input file", (f"input.files='@DATA@/{name}'", f"input.format={fmt}"), "input.files", f"not a valid {fmt} file")
    for pattern in NO_MATCH:
        yield Case("input file", (f"input.files={pattern}" if pattern == "''" else f"input.files='{pattern}'",), "input.files")
    yield Case("input file", ("input.files=['@DATA@/ok.jsonl','@DATA@/empty.jsonl']",), "input.files", "empty.jsonl")
    yield Case("input file", ("input.files=['@DATA@/ok.jsonl','@DATA@/ok.csv']",), "input.format", "different extensions")
    yield Case("input file", ("input.files='@DATA@/data.txt'",), "input.format", "cannot infer")


def screen_cases() -> Iterator[Case]:
    """Values that try to break the screen: terminal escapes, newlines, markup, length, interpolations, many problems."""
    for value in ("'\x1b[31mred'", "'a\nb'", "'[bold]x[/bold]'", "'" + "9" * 5000 + "x'", "'\r\r\r'", "${nope}",
                  "${oc.env:DLAUNCH_SURELY_UNSET}", "'\u202eevil'"):
        yield Case("screen", (f"trainer.steps={value}",), "trainer.steps")
    ints = [key for key, field, setup in _fields() if not setup and _out_of_range(field) and "int" in str(field.annotation)]
    yield Case("screen", tuple(f"{key}=-5" for key in ints), ints[0], "more")
    yield Case("screen", tuple(f"+{path}.bogus_{i}=1" for i, (path, _, setup) in enumerate(sections()) if not setup), "bogus_")
    yield Case("screen", ("-m", "strategy=one_device,mirored"), "strategy", "did you mean mirrored")
    # a sweep with no valid combination is refused up front (one with some runs them: tests/cli/test_sweep.py)
    yield Case("screen", ("-m", "trainer.steps=0,-1"), "trainer.steps")
    yield Case("screen", ("-m", "cluster.master_addr=0.0.0.0,::"), "cluster.master_addr", "wildcard")
    yield Case("screen", ("strategy=one_device,mirrored",), "strategy", "Ambiguous")
    yield Case("screen", ("input.files={a: 1}",), "input.files")
    yield Case("screen", ("recipe.optimizer=5",), "recipe.optimizer")
    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        flag = ("-m",) if "sweep" in key else ()
        yield Case("run directory", (*flag, f"{key}=@DATA@/ok.jsonl"), key, "not a directory")
        yield Case("run directory", (*flag, f"{key}=@DATA@/ok.jsonl/run"), key, "not a directory")
        yield Case("run directory", (*flag, f"{key}=''"), key, "must name a directory")
    every = "trainer.checkpoint.every_steps=5"
    for where, why in (("@DATA@/ok.jsonl", "not a directory"), ("@DATA@/ok.jsonl/ckpt", "not a directory"),
                       ("/proc/dlaunch-nowhere", "cannot make a directory under /proc")):
        yield Case("run directory", (every, f"trainer.checkpoint.dir={where}"), "trainer.checkpoint.dir", why)


def invalid_cases() -> list[Case]:
    generators = (field_cases, unknown_key_cases, group_cases, shape_cases, batch_cases, address_cases,
                  recipe_cases, input_cases, screen_cases)
    return list(dict.fromkeys(case for gen in generators for case in gen()))
