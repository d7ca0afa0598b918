"""``benchmarks/sequence.py`` (issue #30's long-context figures) keeps running: its CPU smoke mode, our rows
only (DeepSpeed is not installed here), once per subcommand, and the arithmetic its search and plan rest on
(benchmarks/sequence_plan.py [Note: the long-sequence ceiling of one machine])."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from benchmarks.sequence import next_length, tokens
from benchmarks.sequence_plan import GIB, ceiling, host_ckpt_bytes_per_layer, offload_state_bytes, pinned_block, plan
from benchmarks.presets import llama_preset
from tests.helpers.launch import ROOT, user_env
from tests.helpers.side_by_side import SideBySide

VOCAB = 1024  # llama_tiny


def _command(tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "benchmarks/sequence.py", *args, "--out-dir", str(tmp_path)]


def _bench(tmp_path: Path, runs: SideBySide, name: str) -> tuple[list[dict], str]:
    """The rows and table of run ``name`` once it has ended."""
    proc = runs.get(name)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines() if line.strip()]
    return rows, (tmp_path / "table.md").read_text()


def test_cpu_smoke_longest_and_sp(tmp_path: Path) -> None:
    # both runs at once (tests/helpers/side_by_side.py [Note: side by side])
    runs = SideBySide({
        "longest": _command(tmp_path / "longest", "longest", "--device", "cpu", "--model", "tiny", "--seq-lens", "512",
                            "--gpu-ckpt-layers", "1"),
        "sp": _command(tmp_path / "sp", "sp", "--device", "cpu", "--model", "tiny", "--gpus", "2", "--configs", "ours",
                       "--seq-lens", "1024", "--steps", "2", "--profile"),
    }, cwd=ROOT, env=user_env(), timeout=900)
    try:
        # one GPU's search, one length: of the 2 layers, one keeps its checkpoint on the device, one offloads it
        rows, table = _bench(tmp_path / "longest", runs, "longest")
        (rank,) = [r for r in rows if r["kind"] == "rank"]
        # read back from the modules; the host holds exactly what the plan counts: one layer's 2 x hidden bytes
        # per token
        host_bytes = host_ckpt_bytes_per_layer(llama_preset("tiny")[1], 512, False)
        assert rank["applied"] == {"checkpointed": 2, "offloaded": 1, "tiled_mlp": 2,
                                   "host_ckpt_peak_bytes": host_bytes}
        assert rank["applied"]["host_ckpt_peak_bytes"] == 2 * 256 * 512
        assert rank["tiles"] == 2 and rank["seq_len"] == 512 and rank["tokens_per_s"] > 0
        assert abs(rank["loss"] - math.log(VOCAB)) < 0.5  # the token mean of the chunked loss, random weights
        assert "| 512 | ok (step 1) |" in table and "Longest sequence that trained: 512 tokens" in table
        assert "Command: `python3 benchmarks/sequence.py longest" in table and "Device: CPU" in table

        # sequence parallel 2 through the strategy (tiled_mlp, sequence_parallel), profiled: our row only
        rows, table = _bench(tmp_path / "sp", runs, "sp")
        ranks = [r for r in rows if r["kind"] == "rank"]
        assert sorted(r["rank"] for r in ranks) == [0, 1] and all(r["world_size"] == 2 for r in ranks)
        assert all(r["applied"] == {"checkpointed": 2, "offloaded": 0, "tiled_mlp": 2, "host_ckpt_peak_bytes": 0}
                   for r in ranks)
        assert all(len(r["step_times_s"]) == 2 for r in ranks)  # the profiled third step is not timed
        # the ranks' shares average to the global mean
        assert abs(sum(r["loss"] for r in ranks) / 2 - math.log(VOCAB)) < 0.5
        assert all("CPU run" in r["comm"]["note"] for r in ranks)
        assert "| 1K | ours |" in table and "not run" not in table
    finally:  # an assertion on the first run leaves no second one running
        runs.close()


def test_search_grows_then_bisects_within_the_bound() -> None:
    res = tokens("16K")
    assert tokens("128K") == 131072 and tokens("1M") == 2**20 and tokens("300") == 300
    assert next_length([256 * 1024], [], 256 * 1024, 1.125, res, 10**7) == 288 * 1024  # grows while tries pass
    assert next_length([256 * 1024], [], 256 * 1024, 1.125, res, 260 * 1024) is None  # never past the bound
    assert next_length([], [256 * 1024], 256 * 1024, 1.125, res, 10**7) == 224 * 1024  # shrinks while they fail
    assert next_length([256 * 1024], [320 * 1024], 320 * 1024, 1.125, res, 10**7) == 288 * 1024  # then bisects
    assert next_length([256 * 1024], [272 * 1024], 272 * 1024, 1.125, res, 10**7) is None  # gap at the resolution


def test_plan_ceiling_is_the_last_length_that_fits() -> None:
    _, dims = llama_preset("8b")
    assert host_ckpt_bytes_per_layer(dims, 256 * 1024, pow2=False) == 2 * GIB  # 2 x 4096 bytes per token
    assert host_ckpt_bytes_per_layer(dims, 320 * 1024, pow2=True) == 4 * GIB  # 2.5 GiB rounded up
    assert pinned_block(3 * 2**20, pow2=False) == 4 * 2**20  # small blocks round either way
    assert offload_state_bytes(dims, "bf16_sr") < offload_state_bytes(dims, "fp32") / 1.5
    free, gpu = 58 * GIB, 79 * GIB
    for pow2 in (False, True):
        best = ceiling(dims, free, gpu, pow2)
        assert best.fits and best.host_layers + best.gpu_layers == 32
        assert not plan(dims, best.seq_len + 4096, free, gpu, pow2).fits
    assert ceiling(dims, free, gpu, True).seq_len <= ceiling(dims, free, gpu, False).seq_len
    more_gpu = ceiling(dims, free, 139 * GIB, False)
    assert more_gpu.seq_len > ceiling(dims, free, gpu, False).seq_len and more_gpu.gpu_layers > 0
