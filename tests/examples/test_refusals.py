"""Bad configurations of the example are refused before anything starts, in one line, and leave no run
directory behind (issue #28): an added unknown key, a misspelt top-level key, an unknown nested key, a
missing checkpoint, and a refusal from inside the build (a 1-bit optimizer under a stage it cannot use)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.helpers.launch import user_env  # noqa: E402
from tests.helpers.side_by_side import SideBySide

ROOT = Path(__file__).resolve().parents[2]


REFUSALS = [
    ("+unknown_key=1", "unknown config key 'unknown_key'"),
    ("seeed=1", "did you mean 'seed'?"),
    ("+trainer.max_stepz=3", "unknown config key(s) trainer.max_stepz"),
    ("ckpt_path=nowhere/last.ckpt", "does not exist"),
    ("optimizer=onebit_adam", "works with ZeRO stage(s) [0] only"),
]


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SideBySide, dict[str, Path]]]:
    """Every refused run started at once, each in an empty directory of its own (tests/helpers/side_by_side.py
    [Note: side by side])."""
    dirs = {override: tmp_path_factory.mktemp("refused") for override, _ in REFUSALS}
    env = user_env()  # a Lightning run earlier in this process leaves LOCAL_RANK... (launch.py)
    started = SideBySide({o: [sys.executable, str(ROOT / "examples" / "train.py"), o, "logger=none"] for o in dirs},
                         cwd=dirs, env=env, timeout=300)
    try:
        yield started, dirs
    finally:
        started.close()


@pytest.mark.parametrize(("override", "says"), REFUSALS)
def test_refused_in_one_line_without_a_run_directory(refusals: tuple[SideBySide, dict[str, Path]], override: str,
                                                     says: str) -> None:
    runs, dirs = refusals
    proc, tmp_path = runs.get(override), dirs[override]
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert says in proc.stderr, proc.stderr[-3000:]
    assert len([line for line in lines if says in line]) == 1
    assert len(lines) == 1, lines
    assert not any(p.is_file() or p.name == ".hydra" for p in tmp_path.rglob("*")), sorted(tmp_path.rglob("*"))


def test_a_model_the_host_cannot_hold_is_refused_before_building(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model=gpt_1b (1.3B parameters) on 2 CPU processes needs tens of GiB of model state: with 4 GiB available the
    build refuses in one line naming the need and the remedy (before any process starts or weight exists);
    under zero3 the need per process is 1/N of it."""
    sys.path.insert(0, str(ROOT / "examples"))
    from hydra import compose, initialize_config_dir

    import run_checks
    import train

    for name in [k for k in os.environ if k in ("LOCAL_RANK", "RANK", "WORLD_SIZE")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(run_checks, "host_available_bytes", lambda: 4 * run_checks.GIB)
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="config", overrides=[f"run_dir={tmp_path}", "model=gpt_1b", "logger=none"])
        refusal = r"GiB of host memory and this host has 4.0 GiB available: use strategy=zero3"
        with pytest.raises(run_checks.ConfigRefused, match=refusal) as err:
            train.build(cfg)
        assert "\n" not in str(err.value)
        monkeypatch.setattr(run_checks, "host_available_bytes", lambda: 64 * run_checks.GIB)
        overrides = [f"run_dir={tmp_path}", "model=gpt_1b", "logger=none", "strategy=zero3"]
        cfg = compose(config_name="config", overrides=overrides)
        train.build(cfg)  # zero3: each process holds its partition only, which fits


def test_every_legitimate_override_form_passes_the_check() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import run_checks
    import train

    ok = ["--cfg", "job", "-m", "strategy=zero1,zero2", "strategy.stage=3", "hydra/job_logging=disabled",
          "hydra.run.dir=x", "+callbacks.lr._target_=a.B", "~logger", "ckpt_path=last", "trainer.max_steps=3",
          "--config-name", "config", "model=gpt_tiny"]
    run_checks.check_overrides(ok, train.TrainConfig, ROOT / "conf")
    with pytest.raises(run_checks.ConfigRefused, match="'trainr'"):
        run_checks.check_overrides(["trainr.max_steps=3"], train.TrainConfig, ROOT / "conf")
