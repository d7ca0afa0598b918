"""The CPU step run during backward (offload/eager.py) is the step after backward, bit for bit, and runs
only when nothing needs all the gradients first."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.offload.helpers import fit


def masters(t: Any) -> list[torch.Tensor]:
    engine = t.strategy.engines[0]
    with engine.host_state():
        return [fg.master.clone() for fg in engine.groups]


def both_ways(accelerator: str = "cpu", **kwargs: Any) -> dict[bool, tuple[Any, Any]]:
    return {eager: fit(steps=6, clip=None, accelerator=accelerator, offload_step_in_backward=eager, nonfinite="ignore",
                       **kwargs)
            for eager in (True, False)}


@pytest.mark.parametrize("stage,offload,precision", [
    (1, dict(offload_optimizer="cpu"), "32-true"),
    (2, dict(offload_optimizer="cpu"), "bf16-mixed"),
    (3, dict(offload_optimizer="cpu"), "32-true"),
    (3, dict(offload_optimizer="cpu", offload_params="cpu"), "bf16-mixed"),  # writes the partitions in place
])
def test_step_in_backward_equals_the_step_after_backward(stage: int, offload: dict, precision: str) -> None:
    runs = both_ways(stage=stage, precision=precision, **offload)
    (t_on, m_on), (t_off, m_off) = runs[True], runs[False]
    assert t_on.strategy.engines[0].eager_steps == 6 and t_off.strategy.engines[0].eager_steps == 0
    assert m_on.losses == m_off.losses and len(m_on.losses) == 6
    assert all(torch.equal(a, b) for a, b in zip(masters(t_on), masters(t_off)))
    state_on, state_off = (list(t.optimizers[0].state.values())[0] for t in (t_on, t_off))
    assert torch.equal(state_on["exp_avg_sq"], state_off["exp_avg_sq"]) and float(state_on["step"]) == 6
    for p_on, p_off in zip(m_on.parameters(), m_off.parameters()):  # what the device computes with
        assert p_on.dtype == p_off.dtype


@pytest.mark.parametrize("case", ["clip", "accumulate", "fp16", "sgd", "delayed", "nvme", "nonfinite_skip"])
def test_steps_after_backward_when_the_step_needs_every_gradient(case: str, tmp_path) -> None:
    """``nonfinite_skip``: the default nonfinite='skip' decides after backward whether the step runs."""
    kwargs: dict[str, Any] = dict(stage=2, offload_optimizer="cpu", steps=4)
    if case != "nonfinite_skip":
        kwargs["nonfinite"] = "ignore"
    if case == "clip":
        kwargs["clip"] = 0.5
    else:
        kwargs["clip"] = None
    if case == "accumulate":
        kwargs["accumulate"] = 2
    if case == "fp16":
        from lightning_zero import ZeroPrecision  # Lightning maps "16-mixed" to bf16 on CPU; the plugin keeps fp16

        kwargs["plugins"] = [ZeroPrecision("16-mixed")]
    if case == "delayed":
        kwargs.update(delayed_param_update=True, delayed_param_update_warmup=0)
    if case == "nvme":
        kwargs.update(offload_optimizer="nvme", nvme_path=str(tmp_path))
    if case == "sgd":
        from tests.helpers.parity_model import ParityNet

        class SGDNet(ParityNet):
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

        kwargs["model"] = SGDNet()
    t, model = fit(**kwargs)
    engine = t.strategy.engines[0]
    assert engine.eager_steps == 0 and len(model.losses) == 4 * kwargs.get("accumulate", 1)
    assert engine.step_in_backward == (case in ("sgd", "delayed", "nvme"))  # the strategy's part of the decision


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage,offload", [(2, dict(offload_optimizer="cpu")),
                                           (3, dict(offload_optimizer="cpu", offload_params="cpu"))])
def test_step_in_backward_on_cuda_equals_the_step_after_backward(stage: int, offload: dict) -> None:
    """On a GPU each range waits for its device-to-host copy's event while backward goes on."""
    runs = both_ways(accelerator="gpu", stage=stage, precision="bf16-mixed", **offload)
    (t_on, m_on), (t_off, m_off) = runs[True], runs[False]
    assert t_on.strategy.engines[0].eager_steps == 6
    assert m_on.losses == m_off.losses
    assert all(torch.equal(a, b) for a, b in zip(masters(t_on), masters(t_off)))
