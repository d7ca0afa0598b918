"""tests/helpers/harness.py without a launch (the suites launch it): names, the environment the ranks get, the
command line, and the records a run reads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import harness
from tests.helpers.launch import ACCELERATOR_ENV
from tests.helpers.worker_io import save_atomic


def test_a_scenario_name_names_its_suite() -> None:
    with pytest.raises(ValueError, match="<suite>.<what>"):
        harness.scenario("nosuite")
    fn = harness.resolve("distributed.parity")  # imports tests/distributed/scenarios.py
    assert fn.__name__ == "parity"
    with pytest.raises(KeyError, match="no scenario 'distributed.nothing'"):
        harness.resolve("distributed.nothing")


def test_the_ranks_get_no_launcher_leftovers(monkeypatch: pytest.MonkeyPatch) -> None:
    for leaked in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_TRAINER_GPUS"):
        monkeypatch.setenv(leaked, "1")
    monkeypatch.delenv(ACCELERATOR_ENV, raising=False)
    env = harness.scenario_env({"EXTRA": "x"})
    assert not {"LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT"} & set(env)
    assert not [k for k in env if k.startswith("PL_")]
    assert env["OMP_NUM_THREADS"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "" and env["EXTRA"] == "x"
    assert env["PYTHONPATH"].split(":")[0] == str(harness.ROOT)
    monkeypatch.setenv(ACCELERATOR_ENV, "gpu")  # the NCCL runs of the parity suites keep their GPUs
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert "CUDA_VISIBLE_DEVICES" not in harness.scenario_env()


def test_command_lines(tmp_path: Path) -> None:
    params = harness.write_params(tmp_path, "x.y", {"a": [1, 2]})
    assert params.read_text() == '{"a": [1, 2]}'
    tr = harness.scenario_command("x.y", params, tmp_path, 3, port=1234, nodes=2, node=1)
    assert tr[1:3] == ["-m", "torch.distributed.run"] and "--nproc-per-node=3" in tr and "--node-rank=1" in tr
    assert tr[-5:] == ["-m", harness.ENTRY, "x.y", str(params), str(tmp_path)]
    py = harness.scenario_command("x.y", params, tmp_path, 2, launcher="python")
    assert py[1:] == ["-m", harness.ENTRY, "x.y", str(params), str(tmp_path)]


def test_records_are_read_per_rank(tmp_path: Path) -> None:
    ctx = harness.ScenarioContext("x.y", {}, tmp_path, rank=1, world_size=2)
    ctx.record("step", {"loss": 1.5})
    save_atomic({"per_rank": []}, str(tmp_path / "named.pt"))
    run = harness.ScenarioRun("x.y", 2, tmp_path, returncode=0)
    assert run.ranks("step") == [None, {"loss": 1.5}]
    assert run.saved("named") == {"per_rank": []} and run.saved("absent") is None
    with pytest.raises(AssertionError, match="no record 'step' from rank 0"):
        run.rank0("step")
    assert run.check() is run
    with pytest.raises(AssertionError, match="timed out"):
        harness.ScenarioRun("x.y", 2, tmp_path, returncode=-9, timed_out=True, log="tail").check()
