"""Every dlaunch command shown in README.md and docs/ runs as written (a run gets a short run: 30 steps, on the CPU).

The commands of one page run in the order they appear, in one empty directory per page, so a page can show
``dlaunch report outputs/first`` after the run that wrote it. A block preceded by ``<!-- docs-file: PATH -->`` is
written to PATH in that directory first: a page can show the files its commands use. Commands that cannot run on
one CPU machine (several machines, SLURM, a GPU) go in ``console`` or ``text`` blocks, with a sentence naming the
test that covers them.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SUBCOMMANDS, answered_early, dlaunch

pytestmark = pytest.mark.slow
SHORT = {"trainer.steps": "30", "trainer.log_every": "10"}
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FILE_MARK = re.compile(r"<!-- docs-file: (\S+) -->\s*```\w*\n(.*?)```", re.S)


def commands(page: Path) -> list[str]:
    found = []
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.S):
        found += [line.strip() for line in block.splitlines() if line.strip().startswith(("dlaunch ", "python -m launcher."))]
    return found


def files(page: Path) -> dict[str, str]:
    return dict(FILE_MARK.findall(page.read_text()))


def arguments(command: str, work: Path, index: int) -> list[str]:
    """The command's arguments; a run gets the short settings it does not set itself, and a run directory in ``work``."""
    args = shlex.split(command, comments=True)[1:]
    if args[0] in SUBCOMMANDS or answered_early(args):
        return args
    keys = {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a}
    if "script" not in keys and "script.path" not in keys:  # a script runs its own loop: trainer keys exit 2 for it
        args += [f"{k}={v}" for k, v in SHORT.items() if k not in keys]
    where = "hydra.sweep.dir" if "-m" in args or "--multirun" in args else "hydra.run.dir"
    if where not in keys:
        args.append(f"{where}={work / 'runs' / str(index)}")
    return args


CASES = [(page, i, command) for page in PAGES for i, command in enumerate(commands(page))]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory) -> dict[str, Path]:
    """One directory per page, holding the page's files before its first command runs."""
    made: dict[str, Path] = {}
    for page in PAGES:
        work = made[page.name] = tmp_path_factory.mktemp(page.stem)
        for name, text in files(page).items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_text(text)
    return made


@pytest.mark.parametrize("page,index,command", CASES, ids=[f"{p.name}:{c}" for p, _, c in CASES])
def test_the_command_runs(page, index, command, workdirs):
    work = workdirs[page.name]
    if command.startswith("python "):  # a helper the page's runs need, e.g. writing data files
        proc = subprocess.run([sys.executable, *shlex.split(command, comments=True)[1:]], cwd=work, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{page.name}: {command}\n{proc.stderr[-3000:]}"
        return
    proc = dlaunch(*arguments(command, work, index), cwd=work, timeout=300)
    assert proc.returncode == 0, f"{page.name}: {command}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def test_the_pages_show_few_runs():
    """Each documented run costs CI 5-10 s: the pages together show a few dozen at most."""
    runs = [c for _, _, c in CASES if c.startswith("dlaunch ") and shlex.split(c)[1] not in SUBCOMMANDS]
    assert 0 < len(runs) <= 43, len(runs)


def test_every_page_the_readme_links_to_is_kept():
    """The README links each docs page; a page that exists is linked from it (pages of other work may come later)."""
    readme = (ROOT / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
