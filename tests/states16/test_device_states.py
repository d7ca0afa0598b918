"""16-bit master weights and Adam states on the device (``state_precision``, zero/states16.py), on 2 gloo ranks.

One launch (scenario ``states16.runs``, tests/states16/runs.py) trains ParityNet (two param groups, tied
weights, a frozen layer, clipping, accumulation, an LR schedule) under bf16-mixed and checks, per rank:

- the bytes of the partition's master and Adam state, counted by storage: 6 (bf16_sr) and 8 (bf16_kahan)
  per parameter against fp32 states' 12; under stage 3 the whole persistent partition (with the 16-bit
  shard the gathers read) 6 and 8 against 14;
- with ``grad_shard_precision='bf16'`` the reduced gradients take 2 bytes instead of 4, and without accumulation
  train bit for bit as fp32 shards;
- with ZeRO++'s quantized gathers and reductions (qwZ + qgZ) the 16-bit states step as without them;
- every step of stages 1-3 equals the reference (optim/reference_lowp.py) replayed from the model's initial
  weights, bit for bit (master, moments, Kahan word), also when a parameter unused on every rank leaves
  pieces unstepped (zero/unused.py);
- checkpoints (sharded and full format): a Kahan run resumes bit for bit; an fp32-state run loads its
  checkpoint with the moments widened and the Kahan word folded into the master; a bf16_sr run loads an
  fp32-state checkpoint rounded to nearest.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.harness import run_scenario

TRAIN = {f"s{stage}_{sp}": f"train:stage={stage},sp={sp}"
         for stage in (1, 2, 3) for sp in ("fp32", "bf16_sr", "bf16_kahan")}
TRAIN["s2_unused"] = "train:stage=2,sp=bf16_sr,every=4"
TRAIN.update({"s2_g16": "train:stage=2,sp=bf16_sr,gs=bf16", "s3_g16": "train:stage=3,sp=bf16_kahan,gs=bf16",
              "a1_g32": "train:stage=1,sp=bf16_sr,acc=1", "a1_g16": "train:stage=1,sp=bf16_sr,acc=1,gs=bf16",
              "s3_zpp": "train:stage=3,sp=bf16_sr,zpp=1"})
CKPT = {}
for stage, fmt in ((3, "sharded"), (2, "full")):
    c = f"stage={stage},ckpt={fmt},val=2"
    CKPT.update({
        f"k{stage}": f"save:{c},sp=bf16_kahan", f"k{stage}_resume": f"load:{c},sp=bf16_kahan,from=k{stage}",
        f"k{stage}_to_fp32": f"load:{c},sp=fp32,from=k{stage}",
        f"f{stage}": f"save:{c},sp=fp32", f"f{stage}_to_sr": f"load:{c},sp=bf16_sr,from=f{stage}",
    })


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out: Path = tmp_path_factory.mktemp("states16")
    run = run_scenario("states16.runs", nprocs=2, params={"runs": {**TRAIN, **CKPT}}, out=out, timeout=900).check()
    return {name: run.ranks(name) for name in {**TRAIN, **CKPT}}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16) if a.element_size() == 2 else a,
                                              b.view(torch.int16) if b.element_size() == 2 else b)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_bytes_per_parameter_by_storage(runs: dict, stage: int) -> None:
    for rank in range(2):
        fp32, sr, kahan = (runs[f"s{stage}_{sp}"][rank]["bytes"] for sp in ("fp32", "bf16_sr", "bf16_kahan"))
        assert (fp32["states"], sr["states"], kahan["states"]) == (12.0, 6.0, 8.0)
        assert sr["state_dtypes"] == kahan["state_dtypes"] == ["torch.bfloat16"]
        if stage == 3:  # the bf16 master is what the gathers read: no separate 16-bit partition
            assert (fp32["partition"], sr["partition"], kahan["partition"]) == (14.0, 6.0, 8.0)
        assert fp32["grads"] == sr["grads"] == kahan["grads"] == 4.0


def test_bf16_gradient_shards(runs: dict) -> None:
    """``grad_shard_precision='bf16'``: 2 bytes per parameter of reduced gradients; without accumulation the same
    training bit for bit as fp32 shards (the reduction runs in bf16 either way)."""
    for rank in range(2):
        for name in ("s2_g16", "s3_g16", "a1_g16"):
            assert runs[name][rank]["bytes"]["grads"] == 2.0
        assert runs["a1_g32"][rank]["bytes"]["grads"] == 4.0
        g32, g16 = runs["a1_g32"][rank], runs["a1_g16"][rank]
        assert g16["losses"] == g32["losses"] and len(g16["losses"]) == 6
        for a, b in zip(g32["end_states"], g16["end_states"]):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert _same(a[key], b[key]), (rank, key)


@pytest.mark.parametrize("name", [n for n in TRAIN if "fp32" not in n])
def test_every_step_equals_the_reference(runs: dict, name: str) -> None:
    for rank in range(2):
        r = runs[name][rank]
        assert len(r["mismatches"]) == 6 and r["mismatches"] == [0] * 6, r["mismatches"]
    if name == "s2_unused":  # the plan left pieces unstepped on some steps (and they matched: not stepped)
        assert all(runs[name][rank]["kept_pieces"] > 0 for rank in range(2))


def test_16bit_runs_track_fp32_states(runs: dict) -> None:
    """Not bitwise (another rounding), but the same training: losses within 2 % over 6 steps."""
    for stage in (1, 2, 3):
        ref = runs[f"s{stage}_fp32"][0]["losses"]
        for sp in ("bf16_sr", "bf16_kahan"):
            ours = runs[f"s{stage}_{sp}"][0]["losses"]
            assert len(ours) == len(ref) == 12
            assert max(abs(a / b - 1) for a, b in zip(ours, ref)) < 0.02, (stage, sp, ours, ref)


@pytest.mark.parametrize("stage", [3, 2], ids=["sharded_s3", "full_s2"])
def test_kahan_checkpoint_resumes_bit_for_bit(runs: dict, stage: int) -> None:
    for rank in range(2):
        src, again = runs[f"k{stage}"][rank], runs[f"k{stage}_resume"][rank]
        assert again["losses"] == src["losses"][len(src["losses"]) // 2 :]
        for g_src, g_again in zip(src["end_states"], again["end_states"]):
            assert set(g_src) == set(g_again) == {"master", "step", "exp_avg", "exp_avg_sq", "master_comp"}
            for key in ("master", "exp_avg", "exp_avg_sq", "master_comp"):
                assert _same(g_src[key], g_again[key]), (rank, key)


@pytest.mark.parametrize("stage", [3, 2], ids=["sharded_s3", "full_s2"])
def test_fp32_run_loads_a_kahan_checkpoint(runs: dict, stage: int) -> None:
    for rank in range(2):
        saved = runs[f"k{stage}"][rank]["epoch_states"][0]
        loaded = runs[f"k{stage}_to_fp32"][rank]["start_states"]
        for s, l in zip(saved, loaded):
            assert "master_comp" not in l and l["master"].dtype == torch.float32
            assert torch.equal(l["master"], s["master"].float() + s["master_comp"].float())
            assert (l["master"] != s["master"].float()).any()  # the Kahan word carried something
            for key in ("exp_avg", "exp_avg_sq"):
                assert l[key].dtype == torch.float32 and torch.equal(l[key], s[key].float())
            assert l["step"] == s["step"] == 2
        assert len(runs[f"k{stage}_to_fp32"][rank]["losses"]) == 4  # and it trains on


@pytest.mark.parametrize("stage", [3, 2], ids=["sharded_s3", "full_s2"])
def test_bf16_run_loads_an_fp32_checkpoint(runs: dict, stage: int) -> None:
    for rank in range(2):
        saved = runs[f"f{stage}"][rank]["epoch_states"][0]
        loaded = runs[f"f{stage}_to_sr"][rank]["start_states"]
        for s, l in zip(saved, loaded):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                assert _same(l[key], s[key].bfloat16()), (rank, key)
            assert l["step"] == s["step"] == 2


def test_zeropp_composes(runs: dict) -> None:
    """qwZ + qgZ were on (the quantized gathers change the losses, within 2 % over 6 steps) and the 16-bit
    states stepped from the gradients they reduced exactly as the reference does (test above)."""
    plain, zpp = runs["s3_bf16_sr"][0]["losses"], runs["s3_zpp"][0]["losses"]
    assert zpp != plain and max(abs(a / b - 1) for a, b in zip(zpp, plain)) < 0.02
