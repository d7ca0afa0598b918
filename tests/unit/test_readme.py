"""The README cannot drift from the code (issue #28): its bytes-per-parameter table is the estimator's
formula (lightning_zero/offload/estimator.py [Note: one formula]), and every command of the blocks marked
``<!-- cpu: ... -->`` (the quick start's training command, the Hydra section) runs, with few steps and the
tiny model, in one directory, in order (so ``ckpt_path=last`` resumes the run before it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.offload.estimator import Setting, per_param_formula
from tests.helpers.launch import user_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_bytes_per_parameter_table_is_the_estimators() -> None:
    rows = dict(re.findall(r"^\| `(zero[0-3])` \| [^|]+ \| ([^|]+?) \|$", README, re.MULTILINE))
    assert sorted(rows) == ["zero0", "zero1", "zero2", "zero3"], rows
    for stage in range(4):
        assert rows[f"zero{stage}"] == per_param_formula(Setting(stage), compute_bytes=2), stage


def cpu_commands() -> list[str]:
    """The indented command lines of each block that follows a ``<!-- cpu: ...-->`` marker."""
    commands: list[str] = []
    for match in re.finditer(r"^<!-- cpu:.*?-->\n\n((?:    .*\n)+)", README, re.MULTILINE):
        commands += [line[4:].split("  #")[0].strip() for line in match.group(1).splitlines() if line.strip()]
    return commands


def _short(command: str, i: int) -> list[str]:
    """The command's ``examples/train.py`` part, run by this interpreter with few steps and the tiny model."""
    step = command.split("&&")[-1].split()
    assert step[0].endswith("python") and step[1] == "examples/train.py", command
    args = [a for a in step[2:] if not a.startswith(("trainer.max_steps=", "model="))]
    steps = 6 if any(a.startswith("ckpt_path=") for a in args) else 3  # debug: validate + checkpoint at step 3
    return [sys.executable, "examples/train.py", *args, "model=gpt_tiny", "trainer=debug", f"trainer.max_steps={steps}",
            "logger=none", f"hydra.run.dir={{root}}/runs/{i:02d}"]


def test_cpu_blocks_are_found() -> None:
    commands = cpu_commands()
    assert len(commands) >= 7, commands
    assert any("&&" in c for c in commands) and any("ckpt_path=last" in c for c in commands)


@pytest.mark.slow
def test_every_cpu_command_runs(tmp_path: Path) -> None:
    env = user_env()  # a Lightning run earlier in this process leaves LOCAL_RANK... (launch.py)
    for i, command in enumerate(cpu_commands()):
        argv = [a.replace("{root}", str(tmp_path)) for a in _short(command, i)]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (command, shlex.join(argv), proc.stdout[-2000:], proc.stderr[-3000:])
        if "ckpt_path=last" in command:
            assert f"resume from {tmp_path}/runs/{i - 1:02d}/checkpoints" in proc.stdout + proc.stderr, proc.stderr[-2000:]
