"""ZeRO-3 in one process: user-facing behaviour around partitioned parameters."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.model_summary import ModelSummary

from lightning_zero import ZeroStrategy
from tests.helpers.parity_model import Block, ParityNet, RandomTokens


def _trainer(**strategy_kw) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
        strategy=ZeroStrategy(stage=3, param_persistence_threshold=0, **strategy_kw),
    )


def _plain_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_fit_then_summary_state_dict_gather_and_eval() -> None:
    torch.manual_seed(0)
    model = ParityNet()
    count = _plain_count(model)
    trainer = _trainer()
    trainer.fit(model)
    # the sharded model still reports true shapes
    assert ModelSummary(model).total_parameters == count
    # one rank: the blocks' weights are views into the partition itself, nothing else holds them
    # (sharded_group.py [Note: one rank aliases its partition]); the bookkeeping still has them released
    engine = trainer.strategy.engines[0]
    partitions = {t.untyped_storage().data_ptr() for t in engine.param_shards()}
    assert all(p.untyped_storage().data_ptr() in partitions for p in model.blocks.parameters())
    assert not any(engine.is_gathered(u) for u in engine.units if u.name.startswith("blocks."))
    # full weights come out as a plain state dict a plain model loads
    state = trainer.strategy.full_state_dict()
    plain = ParityNet()
    plain.load_state_dict(state)
    x, _ = RandomTokens(4)[0]
    plain.eval()
    model.eval()
    with torch.no_grad():
        expected = plain(x[None])
        # calling the partitioned model outside the strategy is a clear error ...
        with pytest.raises(RuntimeError, match="partitioned by ZeRO stage 3"):
            model(x[None])
        # ... and works inside gathered_params
        with trainer.strategy.gathered_params():
            got = model(x[None])
    torch.testing.assert_close(got, expected)
    # validate/test/predict after fit gather unit by unit again
    result = trainer.validate(model, verbose=False)
    assert result and "val_loss" in result[0]
    loader = torch.utils.data.DataLoader(RandomTokens(8), batch_size=4)
    predictions = trainer.predict(model, dataloaders=loader)
    with torch.no_grad():
        expected_tokens = [plain(x).argmax(-1) for x, _ in loader]
    assert all(torch.equal(a, b) for a, b in zip(predictions, expected_tokens))


def test_unit_policy_matching_nothing() -> None:
    with pytest.raises(ValueError, match="matches no module.*Block"):
        _trainer(unit_policy=["Transformer*Layer"]).fit(ParityNet())


def test_unit_policy_by_class_name_trains() -> None:
    model = ParityNet()
    trainer = _trainer(unit_policy=["Block", "LayerNorm"])
    trainer.fit(model)
    names = [u.name for u in trainer.strategy.engines[0].units]
    assert "blocks.0" in names and "norm" in names and "blocks.0.norm" not in names  # outermost only


class InPlaceBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.up.weight.mul_(1.0)  # in place, outside the optimizer
        return super().forward(x)


def test_in_place_modification_outside_the_optimizer_is_an_error() -> None:
    model = ParityNet(checkpointing=False)
    model.blocks[0] = InPlaceBlock(model.blocks[0].norm.normalized_shape[0])
    with pytest.raises(RuntimeError, match="modified in place outside the optimizer"):
        _trainer().fit(model)


class ReadsWeightInHook(ParityNet):
    """Logs a block's weight norm in ``on_train_batch_start``: outside every step method, where no unit
    is gathered and nothing can gather it automatically."""

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self.log("w_norm", self.blocks[0].up.weight.norm())


def test_read_outside_the_step_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError) as info:
        _trainer().fit(ReadsWeightInHook(checkpointing=False))
    message = str(info.value)
    assert "not allocated yet" not in message.split("(torch:")[0]  # torch's words only as the cause
    assert "'blocks.0.up.weight'" in message  # the parameter, by name
    assert "on_train_batch_start" in message and "self.blocks[0].up.weight.norm()" in message  # where
    assert "gathered_params" in message and "unit_policy" in message  # the fixes


class ReadsOutsideUnits(ParityNet):
    """Reads block parameters outside the blocks' forward inside training_step (an L2 penalty on one
    block): found by the first step's ReadWatch, which keeps that unit gathered."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss + 1e-3 * sum(p.pow(2).sum() for p in self.blocks[0].parameters())


def test_reads_outside_a_unit_make_it_resident_and_train_like_the_plain_model() -> None:
    torch.manual_seed(0)
    model = ReadsOutsideUnits(checkpointing=False)
    plain = ReadsOutsideUnits(checkpointing=False)
    plain.load_state_dict(model.state_dict())
    trainer = _trainer()
    trainer.fit(model)
    engine = trainer.strategy.engines[0]
    assert [u.name for u in engine.units if u.resident] == ["blocks.0"]
    assert not any(u.resident for u in engine.units if u.name == "blocks.1")
    ref = Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                  limit_val_batches=1, val_check_interval=2, num_sanity_val_steps=0,
                  strategy=ZeroStrategy(stage=0))  # one rank: plain training (stage 0 is ddp-exact elsewhere)
    ref.fit(plain)
    torch.testing.assert_close(torch.tensor(model.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
