"""The evaluation-only stage-3 engine in one process (issue #31; lightning_zero/inference/engine.py): under
``bf16-mixed`` the partitions are bf16 (2 bytes per parameter, no fp32 copy anywhere) and the predictions
equal the plain bf16 model's, on the device and in host memory; its placeholder optimizer refuses to step.
Two ranks, fp32, NVMe and the GPT: tests/inference/test_predict.py."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_zero import ZeroStrategy
from lightning_zero.inference import NoOptimizer
from tests.inference.predict_runs import EvalModule, build, loader, logits_of


@pytest.mark.parametrize("where", ["none", "cpu"])
def test_bf16_partitions(where: str) -> None:
    options = {"offload_params": where, "offload_optimizer": where} if where != "none" else {}
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=3, param_persistence_threshold=0, **options), accelerator="cpu",
                         devices=1, precision="bf16-mixed", logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    module = EvalModule("llama")
    predictions = trainer.predict(module, loader())
    (engine,) = trainer.strategy.engines
    assert not engine.groups and all(fg.master.dtype == torch.bfloat16 for fg in engine.frozen_groups)
    numel = sum(p.numel() for p in module.model.parameters())
    assert sum(fg.master.numel() for fg in engine.frozen_groups) <= numel + 256  # one rank: the whole model, once
    plain = build("llama").to(torch.bfloat16)
    with torch.no_grad():
        for x, logits in predictions:
            assert logits.dtype == torch.bfloat16
            assert torch.equal(logits, logits_of("llama", plain, x))


def test_no_optimizer_refuses_to_step() -> None:
    opt = NoOptimizer()
    assert opt.param_groups == [] and not opt.state
    with pytest.raises(RuntimeError, match="trainer.fit"):
        opt.step()


def test_inference_partitions_off() -> None:
    """``inference_partitions=False``: no evaluation engine; the whole model on the device, as below stage 3."""
    trainer = pl.Trainer(strategy=ZeroStrategy(stage=3, inference_partitions=False), accelerator="cpu", devices=1,
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False)
    module = EvalModule("gpt")
    predictions = trainer.predict(module, loader())
    assert trainer.strategy.engines == []
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in module.model.parameters())
    plain = build("gpt")
    with torch.no_grad():
        assert all(torch.equal(logits, logits_of("gpt", plain, x)) for x, logits in predictions)
    with pytest.raises(ValueError, match="inference_partitions"):
        ZeroStrategy(stage=3, inference_partitions="no")


@pytest.mark.parametrize("where", ["none", "cpu"])
def test_fabric_stage3_without_an_optimizer(where: str) -> None:
    """Fabric: a stage-3 module set up without optimizers whose first forward runs under ``no_grad`` gets the
    evaluation engine (with grad enabled it is refused, tests/fabric/test_bad_input.py)."""
    from lightning.fabric import Fabric

    from lightning_zero import ZeroFabricStrategy

    options = {"offload_params": where, "offload_optimizer": where} if where != "none" else {}
    fabric = Fabric(accelerator="cpu", devices=1, strategy=ZeroFabricStrategy(stage=3, param_persistence_threshold=0,
                                                                              **options))
    fabric.launch()
    module = build("llama")
    model = fabric.setup_module(module)
    plain = build("llama")
    with torch.no_grad():
        for (x,) in loader():
            assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
    (engine,) = fabric.strategy._zero.engines
    assert type(engine).__name__ == "InferenceEngine" and not engine.groups and engine.state_bytes() == 0
    units = [u for u in engine.units[1:] if u.buckets]
    assert units and not any(engine.is_gathered(u) for u in units)  # released after each forward
    if where == "cpu":  # (one rank on the device aliases its partition: sharded_group.py [Note: one rank ...])
        assert all(p.untyped_storage().nbytes() == 0 for u in units for p in u.params)


def test_module_released_by_another_trainer_is_refused() -> None:
    """After ``fit`` under one Trainer's stage 3, the module's weights live in that strategy's partitions: a
    second Trainer's evaluation says so instead of failing on empty storage."""
    options = {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu", "param_persistence_threshold": 0}

    def trainer(steps: int = -1) -> pl.Trainer:
        return pl.Trainer(strategy=ZeroStrategy(**options), accelerator="cpu", devices=1, max_steps=steps,
                          logger=False, enable_progress_bar=False, enable_checkpointing=False,
                          enable_model_summary=False)

    module = EvalModule("gpt")
    first = trainer(steps=1)
    first.fit(module, loader())
    says = r"another strategy's ZeRO stage 3 \(an earlier Trainer's fit or predict\).*Go on with that Trainer"
    with pytest.raises(RuntimeError, match=says):
        trainer().predict(module, loader())
    assert len(first.predict(module, loader())) == len(loader())  # the first Trainer still evaluates it


def test_full_state_dict_and_full_checkpoint_after_predict(tmp_path) -> None:
    """The full state dict (and a ``checkpoint_format="full"`` file) of an evaluation-only run under NVMe: the
    plain model's weights, read back from the swap files."""
    strategy = ZeroStrategy(stage=3, offload_params="nvme", offload_optimizer="nvme", nvme_path=str(tmp_path),
                            param_persistence_threshold=0, checkpoint_format="full")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.predict(EvalModule("llama"), loader())
    expected = {"model." + k: v for k, v in build("llama").state_dict().items()}
    state = trainer.strategy.full_state_dict()
    assert set(state) == set(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    saved = torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"]
    assert all(torch.equal(saved[k], expected[k]) for k in expected)
