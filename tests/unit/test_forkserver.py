"""Ranks forked from a zygote (tests/helpers/forkserver.py [Note: forked ranks]) are the processes a fresh
``python -m tests.helpers.run_scenario`` would be: the same environment, entry, argv, process group and stdin, the
same records and output, and the same exit codes and log lines when a rank raises, exits or is killed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import forkserver, harness

PER_LAUNCH = ("RANK", "LOCAL_RANK", "ROLE_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PYTEST_CURRENT_TEST",
              "LZ_TEST_FORK")
"""Variables that differ between two launches (the rank's own, the port, the test's name, the switch)."""


def _probe(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, fork: bool, end: str = "return"):
    monkeypatch.setenv("LZ_TEST_FORK", "1" if fork else "0")
    return harness.run_scenario("unit.probe", nprocs=2, params={"end": end}, out=tmp_path / name, timeout=240,
                                env={"CUDA_VISIBLE_DEVICES": ""})


def test_forkable_only_where_a_fork_is_the_same_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LZ_TEST_FORK", raising=False)
    monkeypatch.delenv("LZ_TEST_TORCHRUN", raising=False)
    monkeypatch.delenv("LZ_TEST_ACCELERATOR", raising=False)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    cpu = {"CUDA_VISIBLE_DEVICES": ""}
    assert forkserver.forkable({**cpu, "A": "1"}, nodes=1, launcher="direct")
    assert not forkserver.forkable(cpu, nodes=2, launcher="direct")
    assert not forkserver.forkable(cpu, nodes=1, launcher="torchrun")
    assert not forkserver.forkable({**cpu, "MALLOC_MMAP_THRESHOLD_": "65536"}, nodes=1, launcher="direct")
    # a launch that sees a GPU (CUDA after fork): the GPU twins set both variables in the launch's env
    assert not forkserver.forkable({"CUDA_VISIBLE_DEVICES": "0"}, nodes=1, launcher="direct")
    assert not forkserver.forkable({}, nodes=1, launcher="direct")
    assert not forkserver.forkable({**cpu, "LZ_TEST_ACCELERATOR": "gpu"}, nodes=1, launcher="direct")
    monkeypatch.setenv("LZ_TEST_FORK", "0")
    assert not forkserver.forkable(cpu, nodes=1, launcher="direct")


def test_a_forked_rank_sees_what_a_fresh_one_sees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _probe(tmp_path, "fresh", monkeypatch, fork=False).check()
    forked = _probe(tmp_path, "forked", monkeypatch, fork=True).check()
    for run in (fresh, forked):
        assert run.ranks("result") == [{"rank": 0}, {"rank": 1}]
        assert "[probe rank 0] says hello" in run.log and "[probe rank 1] says hello" in run.log
        views = run.ranks("view")
        assert views[0]["pgid"] == views[0]["pid"] and views[1]["pgid"] == views[0]["pid"]  # one group, rank 0's
        for view in views:
            assert view["stdin"] == "/dev/null" and view["name"] == "__main__"
            assert view["main"].endswith("tests/helpers/run_scenario.py")
            assert view["argv"][1:] == ["unit.probe", view["argv"][2], str(run.out)]
    for r in (0, 1):
        a, b = fresh.ranks("view")[r], forked.ranks("view")[r]
        assert a["argv"][0] == b["argv"][0]
        same = {k for k in a["env"] if k not in PER_LAUNCH}
        assert {k: a["env"][k] for k in same} == {k: b["env"].get(k) for k in same}
        assert set(b["env"]) - set(a["env"]) <= set(PER_LAUNCH)
        assert a["env"]["RANK"] == b["env"]["RANK"] == str(r)
    # the fresh ranks are this process's children, the forked ones the zygote's (one for both ranks)
    assert {v["ppid"] for v in fresh.ranks("view")} == {os.getpid()}
    zygote = {v["ppid"] for v in forked.ranks("view")}
    assert len(zygote) == 1 and os.getpid() not in zygote


@pytest.mark.parametrize(("end", "code", "line"), [
    ("raise", 1, "RuntimeError: probe raised on purpose"),
    ("exit3", 3, "[harness] rank 1"),
    ("sigkill", -9, "died of SIGKILL"),
])
def test_a_forked_rank_ends_as_a_fresh_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str, code: int,
                                           line: str) -> None:
    run = _probe(tmp_path, end, monkeypatch, fork=True, end=end)
    assert run.returncode == code and not run.timed_out, run.log
    assert line in run.log, run.log
    assert run.ranks("result")[0] == {"rank": 0} and run.ranks("result")[1] is None
