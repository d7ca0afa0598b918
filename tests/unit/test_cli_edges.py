"""Small CLI edges (issue #28): ``ops build`` skips CUDA ops where no CUDA device could run them (one line),
``checkpoint inspect`` on a missing path says it does not exist, and a closed pipe (``inspect | head``)
ends the command quietly."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from lightning_zero.checkpoint import __main__ as ckpt_cli
from lightning_zero.ops import __main__ as ops_cli
from lightning_zero.ops.registry import OPS


def test_ops_build_skips_cuda_ops_without_a_cuda_device(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    cuda = [name for name, op in OPS.items() if op.device == "cuda"]
    assert cuda
    for name in cuda:
        monkeypatch.setattr(OPS[name], "device_present", lambda: False)
    built: list[str] = []
    def build_all(ops: list, verbose: bool = False) -> list[tuple[str, str]]:
        built.extend(op.name for op in ops)
        return [(op.name, "ok") for op in ops]

    monkeypatch.setattr(ops_cli, "build_all", build_all)
    monkeypatch.setattr(ops_cli, "_print_table", lambda ops: None)
    assert ops_cli.main(["build", "--ops", ",".join(cuda)]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("skipping the CUDA ops")] == [
        f"skipping the CUDA ops {', '.join(cuda)}: no usable CUDA device here (--with-cuda builds them anyway)"]
    assert built == []
    assert ops_cli.main(["build", "--ops", ",".join(cuda), "--with-cuda"]) == 0
    assert built == cuda


def test_inspect_of_a_missing_path_says_it_does_not_exist(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere.ckpt"
    assert ckpt_cli.main(["inspect", str(missing)]) == 1
    assert capsys.readouterr().err.strip() == f"error: {missing} does not exist"


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ckpt").mkdir()
    sink = open(tmp_path / "out", "w")  # a real descriptor for the devnull redirection

    class ClosedPipe(io.TextIOWrapper):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return sink.fileno()

    monkeypatch.setattr(ckpt_cli, "describe", lambda src, list_tensors=False: "line\n" * 1000)
    monkeypatch.setattr("sys.stdout", ClosedPipe(io.BytesIO()))
    assert ckpt_cli.main(["inspect", str(tmp_path / "ckpt")]) == 1  # no traceback
    sink.close()
    assert os.path.getsize(tmp_path / "out") == 0
