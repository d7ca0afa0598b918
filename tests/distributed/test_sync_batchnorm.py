"""``Trainer(sync_batchnorm=True)`` and LayerSync plugins under the ZeRO strategy train as under ddp (2 gloo ranks;
tests/distributed/sync_batchnorm.py; lightning_zero/layer_sync.py [Note: synchronised batch norm])."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers.compare import max_rel, tensor_rel
from tests.helpers.harness import run_scenario
from tests.helpers.launch import ACCELERATOR_ENV

SPECS = ["ddp", "zero1", "zero2", "zero3", "zero2_nosync", "torch_sync"]
TOL = 1e-5


def _launch(tmp: Path, specs: list[str], env: dict[str, str]) -> list[dict]:
    run = run_scenario("distributed.sync_batchnorm", nprocs=2, params={"specs": specs}, out=tmp, timeout=600,
                       env=env).check()
    return run.ranks("result")


def _assert_as_under_ddp(ddp: dict, ours: dict) -> None:
    assert ddp["error"] is None and ours["error"] is None, (ddp["error"], ours["error"])
    assert len(ours["losses"]) == len(ddp["losses"]) == 6
    assert max_rel(ours["losses"], ddp["losses"]) < TOL, (ours["losses"], ddp["losses"])
    assert ours["norms"].keys() == ddp["norms"].keys() and ours["norms"]
    for k in ddp["norms"]:
        assert tensor_rel(ours["norms"][k], ddp["norms"][k]) < TOL, k
    for k in ddp["weights"]:
        assert tensor_rel(ours["weights"][k], ddp["weights"][k]) < 1e-4, k


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _launch(Path(tmp_path_factory.mktemp("sync_bn")), SPECS, {ACCELERATOR_ENV: "cpu"})


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_synced_batch_norm_trains_as_under_ddp(ranks: list[dict], stage: str) -> None:
    """Before the fix the strategy ignored the plugin: each rank normalised with its own batch's statistics."""
    for r in ranks:
        _assert_as_under_ddp(r["ddp"], r[stage])


def test_the_synced_runs_differ_from_an_unsynced_one(ranks: list[dict]) -> None:
    """The control: without the plugin each rank's statistics are its own, so ddp-with-sync is a real oracle."""
    for r in ranks:
        synced, alone = r["ddp"]["norms"], r["zero2_nosync"]["norms"]
        assert max(tensor_rel(alone[k], synced[k]) for k in synced) > 1e-3


def test_the_plugin_is_reverted_after_fit(ranks: list[dict]) -> None:
    """As ddp does at teardown: the module holds plain BatchNorm2d again (also under stage 3, before its guards)."""
    for r in ranks:
        for spec in ("ddp", "zero1", "zero2", "zero3"):
            assert r[spec]["kinds"] == ["BatchNorm2d"], (spec, r[spec]["kinds"])
        assert r["zero2"]["world"] == 2


def test_torch_sync_batchnorm_on_cpu_is_refused_before_any_step(ranks: list[dict]) -> None:
    for r in ranks:
        run = r["torch_sync"]
        assert run["error"] is not None and "Trainer(sync_batchnorm=True) on the CPU" in run["error"], run["error"]
        assert run["steps"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_torch_sync_batchnorm_over_nccl_trains_as_under_ddp(tmp_path: Path) -> None:
    """torch's own SyncBatchNorm (``Trainer(sync_batchnorm=True)``) on 2 GPUs: zero1-3 against ddp, and converted
    back after fit (ddp's revert gives ``_BatchNormXd``)."""
    specs = ["ddp_torch", "zero1_torch", "zero2_torch", "zero3_torch"]
    env = {ACCELERATOR_ENV: "gpu", "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES") or "0,1"}
    for r in _launch(tmp_path, specs, env):
        for spec in specs[1:]:
            _assert_as_under_ddp(r["ddp_torch"], r[spec])
            assert "SyncBatchNorm" not in r[spec]["kinds"], r[spec]["kinds"]
