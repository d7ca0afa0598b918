"""Compact host optimizer states in the offload engine (``offload_state_precision``), one rank:
what lives in host memory, which step path runs, and what is refused (2-rank runs: test_parity.py)."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero.config import ZeroConfig
from lightning_zero.optim.host_states import INT8_BLOCK, bytes_per_param
from tests.helpers.memory import storage_bytes
from tests.helpers.parity_model import ParityNet
from tests.offload.helpers import fit, rel


@pytest.mark.parametrize("precision", ["bf16_sr", "bf16_kahan", "int8"])
@pytest.mark.parametrize("stage,extra", [(2, {}), (3, {"offload_params": "cpu"})])
def test_compact_states_replace_the_fp32_masters(precision: str, stage: int, extra: dict) -> None:
    _, ref = fit(steps=6, stage=stage, offload_optimizer="cpu", precision="bf16-mixed", **extra)
    t, model = fit(steps=6, stage=stage, offload_optimizer="cpu", precision="bf16-mixed",
                   offload_state_precision=precision, **extra)
    e = t.strategy.engines[0]
    assert all(fg.master.untyped_storage().nbytes() == 0 for fg in e.groups)  # freed between steps
    # stage 3, bf16 layouts: the master is the 16-bit parameter partition (one copy, not two)
    master_in_params = stage == 3 and precision != "int8"
    for fg, state in zip(e.groups, e._compact):
        n = fg.layout.shard_numel
        partial_block = 8 if precision == "int8" and n % INT8_BLOCK else 0
        want = bytes_per_param(precision) * n + partial_block
        got = storage_bytes(state.tensors())  # host pool buffers are whole pages each
        assert want <= got <= want + 4096 * len(state.tensors()), (got, want)
        if getattr(fg, "shard16", None) is not None:  # stage 3: the state and the parameter partition together
            assert (state.master.data_ptr() == fg.shard16.data_ptr()) == master_in_params
            want += 0 if master_in_params else 2 * n
            got = storage_bytes(state.tensors() + [fg.shard16])
            assert want <= got <= want + 4096 * (len(state.tensors()) + 1), (got, want)
    st = t.optimizers[0].state[e.groups[0].master]
    assert set(st) == {"step"} and int(st["step"]) == 6  # no fp32 moments outside host_state()
    assert 0 < rel(model.losses, ref.losses) < 1e-2


def test_host_state_shows_the_fp32_layout_and_takes_edits_back() -> None:
    t, _ = fit(steps=3, stage=2, offload_optimizer="cpu", offload_state_precision="bf16_sr")
    e = t.strategy.engines[0]
    fg, state = e.groups[0], e._compact[0]
    with e.host_state():
        st = t.optimizers[0].state[fg.master]
        assert fg.master.dtype == torch.float32 and torch.equal(fg.master, state.master.float())
        assert st["exp_avg"].dtype == torch.float32 and torch.equal(st["exp_avg"], state.exp_avg.float())
        fg.master.fill_(0.5)  # a load writes here
    assert torch.equal(state.master, torch.full_like(state.master, 0.5))
    with e.host_state():  # read only: nothing is re-imported (the moments keep their bf16 bits)
        pass
    assert "exp_avg" not in t.optimizers[0].state[fg.master]


def test_step_during_backward_with_bf16_states_but_not_int8() -> None:
    t, _ = fit(steps=3, stage=2, clip=None, offload_optimizer="cpu", offload_state_precision="bf16_sr", nonfinite="ignore")
    assert t.strategy.engines[0].eager_steps == 3
    t, _ = fit(steps=3, stage=2, clip=None, offload_optimizer="cpu", offload_state_precision="int8", nonfinite="ignore")
    assert t.strategy.engines[0].eager_steps == 0  # int8 steps in 256-aligned chunks after backward


def test_compact_states_refuse_what_they_cannot_run() -> None:
    with pytest.raises(ValueError, match="offload_state_precision must be one of"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_state_precision="fp8")
    with pytest.raises(ValueError, match="needs offload_optimizer='cpu' and offload_ratio=1"):
        ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path="/tmp", offload_state_precision="int8")
    with pytest.raises(ValueError, match="needs offload_optimizer='cpu' and offload_ratio=1"):
        ZeroConfig(stage=2, offload_optimizer="cpu", offload_ratio=0.5, offload_state_precision="bf16_sr")
    with pytest.raises(ValueError, match="needs torch.optim.Adam/AdamW"):
        fit(steps=1, stage=2, offload_optimizer="cpu", offload_state_precision="int8", model=ParityNet(optimizer="sgd"))


@pytest.mark.parametrize("name", ["nanogpt", "llama_lora", "gan"])
def test_master_in_params_on_models_we_did_not_write(name: str) -> None:
    """nanoGPT, HF Llama + peft LoRA (frozen base) and Lightning's two-optimizer GAN under zero3_offload,
    bf16-mixed, bf16_sr host states: the master kept in the host parameter partition trains bit for bit
    as with a master of its own (parameters left on the device), every optimizer's state included."""
    from tests.zoo.models import build

    def run(params: str) -> tuple[pl.Trainer, pl.LightningModule]:
        torch.manual_seed(0)
        steps = 8 if name == "gan" else 4  # the GAN: two optimizer steps per batch
        return fit(steps=steps, model=build(name), stage=3, offload_optimizer="cpu", offload_params=params,
                   precision="bf16-mixed", offload_state_precision="bf16_sr", clip=None if name == "gan" else 0.5)

    (t_shared, shared), (_, own) = run("cpu"), run("none")
    for e in t_shared.strategy.engines:
        for fg, state in zip(e.groups, e._compact):
            assert state.master.data_ptr() == fg.shard16.data_ptr()
    keys = ("g_losses", "d_losses") if name == "gan" else ("losses",)
    for key in keys:
        got, want = getattr(shared, key), getattr(own, key)
        assert len(got) >= 4 and all(math.isfinite(v) for v in got) and got == want, (key, got, want)
