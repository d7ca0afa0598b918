"""The README's quick start and CI agree, and the quick start works on a stock Python (issue #14).

A stock Debian/Ubuntu Python refuses ``pip install`` outside a virtual environment
(``externally-managed-environment``), so both quick-start commands create ``.venv`` and run everything
from it, still one command each. ``.ci/run`` must run the README's test command verbatim, so that what
CI proves is what a user types.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV = ".venv"
CI_MARKER = "# --- the README's test command ---"


def _quickstart_commands() -> list[str]:
    """The indented command lines of the README's "Quick start" section, in order."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Quick start.*?$(.*?)^## ", text, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## Quick start' section"
    return [line[4:] for line in match.group(1).splitlines() if line.startswith("    ") and line.strip()]


def _ci_command() -> str:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert CI_MARKER in lines, f".ci/run lost its marker line {CI_MARKER!r}"
    after = [line for line in lines[lines.index(CI_MARKER) + 1:] if line.strip()]
    assert len(after) == 1, f".ci/run runs more than the README's test command after the marker: {after}"
    return after[0]


def _commands() -> dict[str, str]:
    commands = _quickstart_commands()
    assert len(commands) == 2, f"the quick start is two commands, found {commands}"
    train = [c for c in commands if "examples/train.py" in c]
    test = [c for c in commands if "pytest" in c]
    assert len(train) == 1 and len(test) == 1, commands
    return {"train": train[0], "test": test[0]}


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    assert _ci_command() == _commands()["test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "activate" not in ci  # no environment the README's command does not create itself
    proc = subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("which", ["train", "test"])
def test_each_quickstart_command_creates_and_uses_a_venv(which: str) -> None:
    command = _commands()[which]
    steps = [step.strip() for step in command.split("&&")]
    assert steps[0] == f"python3 -m venv {VENV}", steps  # python3: stock Debian has no `python`
    for step in steps[1:]:  # everything after runs the venv's interpreter, never the system's
        assert step.startswith(f"{VENV}/bin/python "), step
    install = steps[1]
    assert "-m pip install torch==2.13.0 -e " in install  # the CPU wheel pin stays
    assert install.endswith('-e ".[test]"' if which == "test" else "-e .")
    assert steps[-1] == (f"{VENV}/bin/python -m pytest -q" if which == "test" else f"{VENV}/bin/python examples/train.py")
    assert (ROOT / ".gitignore").read_text().count(f"{VENV}/") >= 1  # the venv never shows up in git status


def test_the_venv_step_works_here(tmp_path: Path) -> None:
    """The quick start's first step, as written, gives an interpreter with pip (no package installed)."""
    step = _commands()["test"].split("&&")[0].split()
    python3 = shutil.which(step[0])
    if python3 is None:
        pytest.skip(f"{step[0]} is not on PATH here")
    proc = subprocess.run([python3, *step[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "ensurepip" in proc.stdout + proc.stderr:
        pytest.skip("this Python lacks ensurepip (Debian: apt install python3-venv, as the README says)")
    assert proc.returncode == 0, proc.stderr
    pip = subprocess.run([str(tmp_path / VENV / "bin" / "python"), "-m", "pip", "--version"],
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0 and str(tmp_path / VENV) in pip.stdout, pip.stdout + pip.stderr
