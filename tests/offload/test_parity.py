"""Every offload setting that runs without a GPU against Lightning's ``ddp`` on 2 gloo ranks, 10 steps.

One ``torchrun`` trains all configurations (start-up dominates on 2 cores); the tests only read the
results. ``oopt``/``oparams`` are offload_optimizer/offload_params; ``nvme=1`` gives the run a fresh
``nvme_path``; ``chunk_mb=0.004`` cuts each shard into several NVMe chunks so the swap pipeline
(read next / step this / write previous) runs across chunk boundaries.

[Note: 10 steps are enough for parity] A parity run's cost is its steps (about 0.07 s a step against 0.2 s
of Trainer set-up on CI's 2 cores; 40 runs): 10 steps of 2 accumulated micro-batches still cross the
accumulation boundary, clip, validate (every 10 batches), run ParityNet's whole LR warm-up (5 steps) into
its decay, and swap every NVMe chunk in and out 10 times; a wrong update is off by far more than 1e-4 at
its first step. The runs that need a trajectory keep theirs: the delayed update (30 steps, against
``ddp30``: its convergence checks read the first and last 10 losses) and the resumes (20 steps, 160 samples
an epoch: the resume starts from the first epoch's checkpoint).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_zero_stages import _rel, _weights_rel
from tests.helpers.launch import run_worker

STEPS = 10
"""Steps of every parity run but the delayed update and the resumes: [Note: 10 steps are enough for parity]."""

PARITY = {
    "zero1_offload": f"zero1:oopt=cpu,steps={STEPS}",  # one reduction per step: the device-side norm path
    "zero2_offload": f"zero2:oopt=cpu,steps={STEPS}",  # reduces every micro-batch: host accumulation, host norm
    "zero3_offload_optimizer": f"zero3:oopt=cpu,steps={STEPS}",  # gather source on the device, masters on the host
    "zero3_offload": f"zero3:oopt=cpu,oparams=cpu,steps={STEPS}",
    "zero2_offload_nvme": f"zero2:oopt=nvme,nvme=1,chunk_mb=0.004,steps={STEPS}",
    "zero3_offload_nvme": f"zero3:oopt=nvme,oparams=nvme,nvme=1,chunk_mb=0.004,steps={STEPS}",
    "zero3_nvme_half_in_memory": f"zero3:oopt=nvme,oparams=cpu,nvme=1,chunk_mb=0.004,frac=0.5,steps={STEPS}",
    "zero3_dpu_in_warmup": f"zero3:oopt=cpu,oparams=cpu,dpu=1000,steps={STEPS}",  # delayed update never starts: exact
}
STEP_IN_BACKWARD = {  # no clipping, one micro-batch per step, nonfinite='ignore': the CPU step runs during backward
    "zero2_offload_step_in_backward": f"zero2:oopt=cpu,clip=0,accumulate=1,nonfinite=ignore,steps={STEPS}",
    "zero3_offload_step_in_backward": f"zero3:oopt=cpu,oparams=cpu,clip=0,accumulate=1,nonfinite=ignore,steps={STEPS}",
}
PARTIAL = {  # offload_ratio: the leading share of each partition on the host, the rest on the "device"
    "zero1_ratio0": f"zero1:oopt=cpu,ratio=0,steps={STEPS}",
    "zero1_ratio_half": f"zero1:oopt=cpu,ratio=0.5,steps={STEPS}",
    "zero2_ratio0": f"zero2:oopt=cpu,ratio=0,steps={STEPS}",
    "zero2_ratio_half": f"zero2:oopt=cpu,ratio=0.5,steps={STEPS}",
    "zero3_ratio0": f"zero3:oopt=cpu,ratio=0,steps={STEPS}",
    "zero3_ratio_half": f"zero3:oopt=cpu,oparams=cpu,ratio=0.5,steps={STEPS}",
    "zero2_nvme_ratio_half": f"zero2:oopt=nvme,nvme=1,chunk_mb=0.004,ratio=0.5,steps={STEPS}",
    "zero3_nvme_ratio_half": f"zero3:oopt=nvme,oparams=nvme,nvme=1,chunk_mb=0.004,ratio=0.5,steps={STEPS}",
}
MASTER_IN_PARAMS = {
    # bf16 compute, bf16 host states: with the parameters on the host the master is their partition
    "zero3_bf16_sr_master_in_params": f"zero3:oopt=cpu,oparams=cpu,hsp=bf16_sr,precision=bf16-mixed,steps={STEPS}",
    "zero3_bf16_kahan_master_in_params": f"zero3:oopt=cpu,oparams=cpu,hsp=bf16_kahan,precision=bf16-mixed,steps={STEPS}",
    # ... and a separate master where the parameters stay on the device
    "zero3_bf16_sr_own_master": f"zero3:oopt=cpu,hsp=bf16_sr,precision=bf16-mixed,steps={STEPS}",
    "zero3_bf16_kahan_own_master": f"zero3:oopt=cpu,hsp=bf16_kahan,precision=bf16-mixed,steps={STEPS}",
    "zero3_bf16_sr_master_in_params_resume":
        "zero3:oopt=cpu,oparams=cpu,hsp=bf16_sr,precision=bf16-mixed,n_train=160,steps=20,resume=1",
}
SGD = {"zero2_offload_sgd": f"zero2:oopt=cpu,opt=sgd,steps={STEPS}", "zero3_offload_nvme_sgd": f"zero3:oopt=nvme,oparams=nvme,nvme=1,opt=sgd,steps={STEPS}"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    specs = {"ddp": f"ddp:steps={STEPS}", "ddp_sgd": f"ddp:opt=sgd,steps={STEPS}",
             "ddp_bf16": f"ddp:precision=bf16-mixed,steps={STEPS}", "ddp_noclip": f"ddp:clip=0,accumulate=1,steps={STEPS}",
             "ddp30": "ddp", **PARITY, **SGD,
             **STEP_IN_BACKWARD, **PARTIAL,
             "zero2_ratio_one": f"zero2:oopt=cpu,ratio=1,steps={STEPS}",
             "zero2_ratio_half_step_in_backward": f"zero2:oopt=cpu,clip=0,accumulate=1,ratio=0.5,nonfinite=ignore,steps={STEPS}",
             "zero2_ratio_half_resume": "zero2:oopt=cpu,ratio=0.5,n_train=160,steps=20,resume=1",
             "zero2_bf16_sr": f"zero2:oopt=cpu,hsp=bf16_sr,steps={STEPS}",
             "zero3_int8": f"zero3:oopt=cpu,oparams=cpu,hsp=int8,steps={STEPS}",
             "zero2_bf16_sr_resume": "zero2:oopt=cpu,hsp=bf16_sr,n_train=160,steps=20,resume=1",
             **MASTER_IN_PARAMS,
             "zero3_dpu": "zero3:oopt=cpu,oparams=cpu,dpu=3",  # 30 steps, against ddp30
             "zero3_nvme_resume": "zero3:oopt=nvme,oparams=nvme,nvme=1,chunk_mb=0.004,n_train=160,steps=20,resume=1"}
    return run_worker(tmp_path_factory.mktemp("offload"), 2, specs, timeout=1200)


@pytest.mark.parametrize("name", sorted(PARITY))
def test_matches_ddp(runs: dict[str, dict], name: str) -> None:
    got, ref = runs[name], runs["ddp"]
    assert len(got["losses"]) == len(ref["losses"]) == 2 * STEPS  # 2 accumulated micro-batches a step
    assert _rel(got["losses"], ref["losses"]) < 1e-4
    bad = {k: v for k, v in _weights_rel(got["weights"], ref["weights"]).items() if v > 1e-4}
    assert not bad, bad
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):  # rank 1 too
        assert _rel(r_got["losses"], r_ref["losses"]) < 1e-4


@pytest.mark.parametrize("name", sorted(STEP_IN_BACKWARD))
def test_step_in_backward_matches_ddp(runs: dict[str, dict], name: str) -> None:
    got, ref = runs[name], runs["ddp_noclip"]
    assert got["eager_steps"] == [STEPS] and len(got["losses"]) == len(ref["losses"]) == STEPS
    assert _rel(got["losses"], ref["losses"]) < 1e-4
    assert max(_weights_rel(got["weights"], ref["weights"]).values()) < 1e-4
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):
        assert _rel(r_got["losses"], r_ref["losses"]) < 1e-4


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_partial_offload_matches_ddp(runs: dict[str, dict], name: str) -> None:
    """Clipped, 2 accumulated micro-batches: host norm + device norm, host and device Adam on one step count."""
    got, ref = runs[name], runs["ddp"]
    assert len(got["losses"]) == len(ref["losses"]) == 2 * STEPS
    assert _rel(got["losses"], ref["losses"]) < 1e-4
    bad = {k: v for k, v in _weights_rel(got["weights"], ref["weights"]).items() if v > 1e-4}
    assert not bad, bad
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):
        assert _rel(r_got["losses"], r_ref["losses"]) < 1e-4


def test_ratio_one_is_todays_path_bitwise(runs: dict[str, dict]) -> None:
    got, ref = runs["zero2_ratio_one"], runs["zero2_offload"]
    assert got["losses"] == ref["losses"]
    assert got["weights"].keys() == ref["weights"].keys()
    assert all(torch.equal(got["weights"][k], ref["weights"][k]) for k in ref["weights"])


def test_partial_offload_steps_in_backward(runs: dict[str, dict]) -> None:
    got, ref = runs["zero2_ratio_half_step_in_backward"], runs["ddp_noclip"]
    assert got["eager_steps"] == [STEPS]
    assert _rel(got["losses"], ref["losses"]) < 1e-4
    assert max(_weights_rel(got["weights"], ref["weights"]).values()) < 1e-4


def test_partial_offload_checkpoint_resume(runs: dict[str, dict]) -> None:
    """The device share's states go through the host mirror into the checkpoint and back."""
    run = runs["zero2_ratio_half_resume"]
    assert _rel(run["resumed_losses"], run["losses"][-20:]) < 1e-6


@pytest.mark.parametrize("name", ["zero2_bf16_sr", "zero3_int8"])
def test_compact_host_states_follow_ddp(runs: dict[str, dict], name: str) -> None:
    """Compact host states change the algorithm slightly (bf16 master / 8-bit moments): close, not equal."""
    got, ref = runs[name], runs["ddp"]
    assert len(got["losses"]) == len(ref["losses"])
    assert 1e-7 < _rel(got["losses"], ref["losses"]) < 2e-2
    for r_got, r_ref in zip(got["per_rank"], ref["per_rank"]):
        assert _rel(r_got["losses"], r_ref["losses"]) < 2e-2


def test_compact_host_state_checkpoint_resume(runs: dict[str, dict]) -> None:
    """bf16_sr exports exactly to fp32 and back; the step count keeps the stochastic-rounding bits in sync."""
    run = runs["zero2_bf16_sr_resume"]
    assert _rel(run["resumed_losses"], run["losses"][-20:]) < 1e-6


@pytest.mark.parametrize("layout", ["bf16_sr", "bf16_kahan"])
def test_master_in_the_parameter_partition_changes_nothing(runs: dict[str, dict], layout: str) -> None:
    """A bf16 layout's master kept in the host parameter partition (one copy, compact_state.py) trains
    bit for bit as with a master of its own: same losses on every rank, same final weights."""
    shared, own = runs[f"zero3_{layout}_master_in_params"], runs[f"zero3_{layout}_own_master"]
    for r_shared, r_own in zip(shared["per_rank"], own["per_rank"]):
        assert r_shared["losses"] == r_own["losses"]
    assert all(torch.equal(shared["weights"][k], own["weights"][k]) for k in own["weights"])
    assert 1e-7 < _rel(shared["losses"], runs["ddp_bf16"]["losses"]) < 2e-2  # bf16 states: close to ddp, not equal


def test_master_in_the_parameter_partition_resumes_exactly(runs: dict[str, dict]) -> None:
    run = runs["zero3_bf16_sr_master_in_params_resume"]
    assert _rel(run["resumed_losses"], run["losses"][-20:]) < 1e-6


def test_clipped_accumulated_runs_step_after_backward(runs: dict[str, dict]) -> None:
    assert runs["zero2_offload"]["eager_steps"] == [0]


@pytest.mark.parametrize("name", sorted(SGD))
def test_other_optimizer_runs_its_own_step_on_the_host(runs: dict[str, dict], name: str) -> None:
    assert _rel(runs[name]["losses"], runs["ddp_sgd"]["losses"]) < 1e-4
    assert max(_weights_rel(runs[name]["weights"], runs["ddp_sgd"]["weights"]).values()) < 1e-4


def test_delayed_update_trains_but_is_not_ddp(runs: dict[str, dict]) -> None:
    """One-step-stale parameters after 3 synchronous steps: same start, a different but converging run."""
    got, ref = runs["zero3_dpu"]["losses"], runs["ddp30"]["losses"]
    assert len(got) == len(ref) == 60  # 30 steps x 2 accumulated micro-batches
    assert _rel(got[:8], ref[:8]) < 1e-4  # 3 synchronous steps + the first delayed one use the same parameters
    assert _rel(got, ref) > 1e-3
    assert sum(got[-10:]) / 10 < 0.8 * sum(got[:10]) / 10
    assert abs(sum(got[-10:]) - sum(ref[-10:])) / sum(ref[-10:]) < 0.25


def test_nvme_checkpoint_resume(runs: dict[str, dict]) -> None:
    """Lightning checkpoints of an NVMe run (states swapped in, gathered, then resumed into swap files)."""
    run = runs["zero3_nvme_resume"]
    assert _rel(run["resumed_losses"], run["losses"][-20:]) < 1e-6


@pytest.mark.parametrize("name", ["zero2_offload_nvme", "zero3_offload_nvme", "zero3_offload_nvme_sgd", "zero3_nvme_resume",
                                  "zero3_nvme_ratio_half"])
def test_swap_files_removed_after_fit(runs: dict[str, dict], name: str) -> None:
    assert runs[name]["nvme_left"] == ["lightning_zero_swap", "lightning_zero_swap/README.txt"]
