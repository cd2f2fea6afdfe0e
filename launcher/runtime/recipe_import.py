"""Importing a recipe's module, by name or by file path: what its own code raises at import is a ``RecipeError``
naming the file and line (exit 1), what is missing or malformed one naming the key (exit 2)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import re
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator


class RecipeError(Exception):
    """The recipe cannot be loaded; ``key`` names the config key at fault."""

    def __init__(self, key: str, value: Any, message: str, in_user_code: bool = False):
        super().__init__(f"{key}: {message}")
        self.key, self.value, self.message = key, value, message
        self.in_user_code = in_user_code  # the recipe's own code raised (exit 1), rather than being missing or malformed (exit 2)


MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def import_entry(entry: str) -> ModuleType:
    """Import a recipe by module name (``launcher.recipes.linear``) or by file path.

    Whatever goes wrong while the recipe's own code runs (a SyntaxError, an
    exception or ``sys.exit`` at import) is a ``RecipeError`` naming the file and line.
    """
    if entry.endswith(".py"):
        return _import_file(entry)
    if not MODULE_NAME.match(entry):
        raise RecipeError("recipe.entry", entry, f"{entry!r} is neither a .py file nor a module name (package.module)")
    fresh = entry not in sys.modules  # a module the caller imported itself (a notebook's) is the caller's to keep
    try:
        module = _guarded(entry, importlib.import_module, entry)
    except RecipeError as exc:
        return _taken_back(entry, exc)
    if fresh:
        _ENTRIES.add(entry)
    return module


_FILES: dict[Path, tuple[int, ModuleType]] = {}  # a recipe file -> (its mtime, the module), as sys.modules for names
_ENTRIES: set[str] = set()  # the recipe modules imported in this process, by their names in sys.modules
_PREVIOUS: dict[str, ModuleType] = {}  # forgotten ones, taken back where importing one again fails
_MTIMES: dict[str, int] = {}  # a file recipe's module name -> the version of the file it was imported from


def forget() -> None:
    """After a job that ran in this process (a sweep's jobs under one_device, one after another): the next job
    imports its recipe afresh, as a job in processes of its own does, so the state a recipe module keeps (a counter,
    a cache, a list of what it built) is not the next job's. The modules the recipe imports itself stay imported,
    as Python keeps them (CLI.md)."""
    for name in _ENTRIES:
        module = sys.modules.pop(name, None)
        if module is not None:
            _PREVIOUS[name] = module
    _ENTRIES.clear()
    _FILES.clear()


def _taken_back(name: str, exc: RecipeError) -> ModuleType:
    """A recipe whose own code fails when imported again in this process (a registration that may happen once: a
    custom op, a model type): the module as an earlier job imported it, with a warning; else ``exc``."""
    previous = _PREVIOUS.get(name)
    if previous is None or not exc.in_user_code:
        raise exc
    sys.modules[name] = previous
    _ENTRIES.add(name)
    logging.getLogger("dlaunch").warning(
        "%s; imported again for this job, it fails (an import that may run once per process: a registration), so this "
        "job uses the module as an earlier job imported it, its module-level state included", exc.message)
    return previous


def _import_file(entry: str) -> ModuleType:
    """The recipe at path ``entry``, executed once per version of the file in this process (validation, the plan and
    a run in this process share it, as they share a module imported by name)."""
    path = Path(entry)
    if not path.is_file():
        missing = "is not a file" if path.exists() else "does not exist"
        raise RecipeError("recipe.entry", entry, f"recipe file {entry} {missing}")
    name = f"dlaunch_recipe_{path.stem}"
    mtime, (seen, loaded) = path.stat().st_mtime_ns, _FILES.get(path.resolve(), (None, None))
    if seen == mtime and sys.modules.get(name) is loaded:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with _folder_importable(path):
            _guarded(entry, spec.loader.exec_module, module)
    except RecipeError as exc:
        sys.modules.pop(name, None)
        if _MTIMES.get(name) != mtime:  # a new version of the file (or none before) failed: its own error
            raise
        module = _taken_back(name, exc)
        _FILES[path.resolve()] = (mtime, module)
        return module
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _FILES[path.resolve()] = (mtime, module)
    _ENTRIES.add(name)
    _MTIMES[name] = mtime
    return module


@contextlib.contextmanager
def _folder_importable(path: Path) -> Iterator[None]:
    """The recipe's own folder first on ``sys.path`` while it imports, as ``python mine.py`` puts it (its sibling
    modules import); then last, so that a function importing a sibling later still finds it, and a sibling
    whose name is an installed package's (``yaml.py``) cannot replace that package for dlaunch."""
    folder = str(path.resolve().parent)
    sys.path.insert(0, folder)
    entry = sys.path[0]
    try:
        yield
    finally:
        at = next((i for i, p in enumerate(sys.path) if p is entry), None)  # ours, not one the recipe put there itself
        if at is not None:
            del sys.path[at]
        if folder not in sys.path:
            sys.path.append(folder)


def _guarded(entry: str, run: Callable[..., Any], *args: Any) -> Any:
    """``run(*args)``, with what the recipe's code raises turned into a ``RecipeError``."""
    try:
        return run(*args)
    except (KeyboardInterrupt, RecipeError):
        raise
    except ModuleNotFoundError as exc:
        if exc.name and (entry == exc.name or entry.startswith(exc.name + ".")):  # the recipe itself is missing
            raise RecipeError("recipe.entry", entry, f"cannot import recipe module {entry}: {exc}") from None
        raise RecipeError("recipe.entry", entry, f"recipe {entry} raised {one_line(exc)} at import{where_raised(exc)}"
                          f"{_beside_the_command(exc.name)}", True) from None
    except SyntaxError as exc:
        where = f"{exc.filename}:{exc.lineno}" if exc.filename else entry
        raise RecipeError("recipe.entry", entry, f"{where}: {type(exc).__name__}: {exc.msg}", True) from None
    except SystemExit as exc:
        raise RecipeError("recipe.entry", entry, f"recipe {entry} called sys.exit({exc.code!r}) at import{where_raised(exc)}", True) from None
    except BaseException as exc:  # noqa: BLE001 - the recipe's own code failed: one line, no traceback
        raise RecipeError("recipe.entry", entry, f"recipe {entry} raised {one_line(exc)} at import{where_raised(exc)}", True) from None


def _beside_the_command(name: str | None) -> str:
    """A module the recipe imports from the user's own project (``mymodels/`` where dlaunch was started), which is
    not on the import path: a recipe in a subfolder (``cfg/tiny.py``) puts only its own folder there."""
    top, _, below = (name or "").partition(".")
    here = Path.cwd()
    if not top or below or not ((here / top / "__init__.py").is_file() or (here / f"{top}.py").is_file()):
        # the package imported and a module under it is missing (``mymodels.layrs``): a typo, not the import path
        return ""
    return (f"; {top} is in {here}, where dlaunch was started, which is not on the import path (a recipe's own folder "
            f"is): PYTHONPATH={here} dlaunch ..., or `pip install -e .` for a project with a pyproject.toml "
            "(docs/RECIPES.md)")


def where_raised(exc: BaseException) -> str:
    """`` (file:line)`` of the innermost frame outside importlib, or nothing."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames and frames[-1].filename != __file__ else ""


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
