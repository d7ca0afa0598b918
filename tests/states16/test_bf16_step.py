"""The device step of the 16-bit states (optim/bf16_step.py) and what ``state_precision`` refuses.

The device step runs the compact host states' reference arithmetic on the device tensors chunk by chunk
(optim/bf16_step.py [Note: one step, two places]); its independent oracle here is the compiled host op
(csrc/cpu_adam/cpu_adam_lowp*), called once on the whole range: equal bit for bit, whatever the chunking,
the gradient dtype, the loss-scale/clip coefficient or the global offset (past 2^32 included).
"""

from __future__ import annotations

import logging
from types import ModuleType

import pytest
import torch
from torch import nn

from lightning_zero.config import StatePrecisionConfig, ZeroConfig
from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.optim import bf16_step
from lightning_zero.zero.stage1 import Stage1Engine
from tests.ops.conftest import compiled

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


@pytest.fixture(scope="module")
def lowp_op() -> ModuleType:
    return compiled("cpu_adam_lowp")


@pytest.mark.parametrize("variant", ["bf16_sr", "bf16_kahan"])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g32", "gbf16"])
@pytest.mark.parametrize("offset", [0, 2**32 - 1500])
def test_device_step_equals_the_host_op(lowp_op: ModuleType, monkeypatch: pytest.MonkeyPatch, variant: str,
                                        adamw: bool, grad_dtype: torch.dtype, offset: int) -> None:
    monkeypatch.setattr(bf16_step, "CHUNK", 1000)  # 5 chunks (on a GPU 4x that: 2)
    n = 4321
    gen = torch.Generator().manual_seed(n + offset % 7)
    master = (torch.randn(n, generator=gen) * torch.logspace(-3, 1, n)).bfloat16()
    comp = torch.zeros(n, dtype=torch.bfloat16) if variant == "bf16_kahan" else None
    ours = [master, comp, torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    theirs = [None if t is None else t.clone() for t in ours]
    initial = master.clone()
    hyper = AdamHyper(HYPER["lr"], HYPER["beta1"], HYPER["beta2"], HYPER["eps"], HYPER["weight_decay"], adamw)
    for step in range(1, 5):
        grad = (torch.randn(n, generator=gen) * torch.logspace(-5, 1, n)).to(grad_dtype)
        scale = 1.0 if step % 2 else 3.7  # unscale and clip fold into grad_scale (zero/states16.py)
        bf16_step.bf16_adam_step(ours[0], ours[1], grad, ours[2], ours[3], step=step, hyper=hyper,
                                 grad_scale=scale, seed=5, offset=offset)
        lowp_op.adam_step_bf16(theirs[0], theirs[1], grad, theirs[2], theirs[3], None, step=step, adamw_mode=adamw,
                               grad_scale=scale, seed=5, offset=offset, num_threads=1, simd_tier=-1, **HYPER)
        for name, a, b in zip(("master", "comp", "exp_avg", "exp_avg_sq"), ours, theirs):
            if a is not None:
                bad = (a.view(torch.int16) != b.view(torch.int16)).sum().item()
                assert bad == 0, f"{variant} step {step}: {name} differs in {bad} of {n} elements"
    assert (ours[0] != initial).float().mean() > 0.5  # the updates were applied, not lost


@pytest.mark.parametrize("kwargs, match", [
    ({"state_precision": "bf16"}, "state_precision must be one of"),
    ({"state_precision": "bf16_sr", "stage": 0}, "needs stage 1, 2 or 3"),
    ({"state_precision": "bf16_kahan", "stage": 2, "offload_optimizer": "cpu"}, "offload_state_precision"),
])
def test_config_refuses_what_is_not_built(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize("make_opt, dtype, match", [
    (lambda p: torch.optim.SGD(p, lr=0.1), torch.bfloat16, "Adam/AdamW only"),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), torch.bfloat16, "Adam/AdamW only"),
    (lambda p: torch.optim.AdamW(p), torch.float32, "needs precision='bf16-mixed'"),
    (lambda p: torch.optim.AdamW(p), torch.float16, "needs precision='bf16-mixed'"),
], ids=["sgd", "amsgrad", "fp32", "fp16"])
def test_engine_refuses_other_optimizers_and_precisions(make_opt, dtype: torch.dtype, match: str) -> None:
    net = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=match):
        Stage1Engine(make_opt(net.parameters()), None, dtype, torch.device("cpu"), 64,
                     states=StatePrecisionConfig("bf16_sr"))


def test_loaded_weights_drop_the_old_kahan_word() -> None:
    """Weights loaded without an optimizer state (``fabric.load`` of the model alone): the Kahan word of the old
    master would be added to the new one; it is zeroed (the optimizer state's own comes with it otherwise)."""
    from lightning_zero.zero import state_dict as zsd
    from lightning_zero.zero.states16 import COMP_KEY

    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    engine = Stage1Engine(torch.optim.AdamW(net.parameters()), None, torch.bfloat16, torch.device("cpu"), 64,
                          states=StatePrecisionConfig("bf16_kahan"))
    fg = engine.groups[0]
    comp = engine.optimizer.state[fg.master][COMP_KEY]
    assert comp.abs().sum() > 0  # the fp32 initial weights' remainders
    zsd.load_master_params(engine, {id(p): torch.ones_like(p) * 0.5 for p in net.parameters()})
    assert torch.equal(comp, torch.zeros_like(comp)) and engine.optimizer.state[fg.master][COMP_KEY] is comp
    assert torch.equal(net.weight.float(), torch.full((4, 8), 0.5))


def test_setup_logs_the_state_layout(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        Stage1Engine(torch.optim.AdamW(nn.Linear(4, 3).parameters()), None, torch.bfloat16, torch.device("cpu"), 64,
                     states=StatePrecisionConfig("bf16_sr", grad_shard_precision="bf16"))
    line = next(r.getMessage() for r in caplog.records if "lightning_zero: ZeRO-1" in r.getMessage())
    assert "bf16_sr" in line and "6 bytes per parameter" in line and "reduced gradients in bf16" in line


def test_written_back_weights_drop_the_old_kahan_word() -> None:
    """Stage 3's ``gathered_params(writeback=True)``: the user set the weights, so Kahan words start again."""
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from lightning_zero.zero.states16 import COMP_KEY
    from tests.helpers.parity_model import ParityNet

    torch.manual_seed(0)
    model = ParityNet()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=2, precision="bf16-mixed", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      use_distributed_sampler=False, limit_val_batches=0, num_sanity_val_steps=0,
                      strategy=ZeroStrategy(stage=3, state_precision="bf16_kahan"))
    trainer.fit(model)
    engine = trainer.strategy.engines[0]
    comps = [engine.optimizer.state[fg.master][COMP_KEY] for fg in engine.groups]
    assert all(c.abs().sum() > 0 for c in comps)
    with engine.gathered_params(writeback=True):
        with torch.no_grad():
            model.norm.weight.fill_(2.0)
    assert all(torch.equal(c, torch.zeros_like(c)) for c in comps)
