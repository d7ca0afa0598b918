"""Bad input fails at once, before training, with one message naming the valid choices."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Callback, Trainer

import lightning_zero
from lightning_zero import ZeroPrecision, ZeroStrategy
from tests.helpers.parity_model import ParityNet
from tests.zoo.fno import FNO


def _trainer(strategy, **kw) -> Trainer:
    return Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, **kw,
    )


def test_invalid_stage() -> None:
    with pytest.raises(ValueError, match=r"stage must be one of \[0, 1, 2, 3\]"):
        ZeroStrategy(stage=5)


def test_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(TypeError, match="bucket_size_mb"):
        ZeroStrategy(stage=2, bucket_size=3)


def test_unknown_strategy_name_fails_at_construction() -> None:
    # Lightning's own message (it lists only its own names; Hydra's strategy group lists ours)
    with pytest.raises(Exception, match="invalid strategy name"):
        Trainer(strategy="zero9", accelerator="cpu", devices=1)


def test_names_are_registered_idempotently() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    lightning_zero.register_everywhere()
    lightning_zero.register_everywhere()
    for name, kwargs in lightning_zero.PRESETS.items():
        assert StrategyRegistry[name]["init_params"] == kwargs
    trainer = Trainer(strategy="zero1", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy) and trainer.strategy.config.stage == 1


class LBFGSNet(ParityNet):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


def test_optimizer_zero_cannot_wrap() -> None:
    with pytest.raises(TypeError, match="cannot wrap LBFGS.*Supported"):
        _trainer(ZeroStrategy(stage=2)).fit(LBFGSNet(checkpointing=False))


def test_pipeline_needs_enough_ranks() -> None:
    with pytest.raises(ValueError, match="not divisible by pipeline_stages=2"):
        _trainer(ZeroStrategy(stage=1, pipeline_stages=2)).fit(ParityNet(checkpointing=False))


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_unsupported_precision(precision: str) -> None:
    with pytest.raises(ValueError, match="32-true"):
        Trainer(strategy=ZeroStrategy(stage=2), precision=precision, accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="32-true"):
        ZeroPrecision(precision)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_single_process_trains(stage: int) -> None:
    model = ParityNet(checkpointing=False)
    before = model.blocks[0].up.weight.detach().clone()
    trainer = _trainer(ZeroStrategy(stage=stage), precision="bf16-mixed", limit_val_batches=0)
    trainer.fit(model)
    assert model.blocks[0].up.weight.dtype == torch.float32  # handed back as built (lightning_zero/after_fit.py)
    assert not torch.equal(model.blocks[0].up.weight.float(), before)
    assert trainer.strategy.grad_norm is not None and trainer.strategy.grad_norm > 0


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_fp32_weights_survive_the_cast_layout_exactly(stage: int) -> None:
    """The cast layout computes a frozen fp32 parameter in bf16 but keeps its exact value (lightning_zero/
    frozen_fp32.py): before, the weights came back rounded to bf16 (4.8e-4 off) with a warning saying so. Under
    both layouts the module after fit (stages 0-2) and full_state_dict() hold the values as built, unwarned."""
    for layout in ("cast", "autocast"):
        model = ParityNet(checkpointing=False)
        built = {k: v.detach().clone() for k, v in model.frozen.state_dict().items()}
        trainer = _trainer(ZeroStrategy(stage=stage, mixed_precision=layout), precision="bf16-mixed",
                           limit_val_batches=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
        assert not [str(w.message) for w in caught if "frozen fp32 parameters" in str(w.message)]
        full = trainer.strategy.full_state_dict()
        for k, v in built.items():
            assert full[f"frozen.{k}"].dtype == torch.float32 and torch.equal(full[f"frozen.{k}"], v), (layout, k)
            if stage < 3:
                assert torch.equal(model.frozen.state_dict()[k], v), (layout, k)


def test_frozen_fp32_copies_that_do_not_fit_the_host_are_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the exact shares would take over half the host's free memory, none is kept (one answer for all ranks)
    and the one warning says the frozen weights come back rounded, which they do."""
    monkeypatch.setattr("lightning_zero.frozen_fp32.available_host_bytes", lambda: 1024)
    model = ParityNet(checkpointing=False)
    built = model.frozen.weight.detach().clone()
    trainer = _trainer(ZeroStrategy(stage=2), precision="bf16-mixed", limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    said = [str(w.message) for w in caught if "frozen fp32 parameters" in str(w.message)]
    assert len(said) == 1 and "would not fit in host memory" in said[0], said
    assert trainer.strategy._zero.frozen_fp32 is None
    assert torch.equal(model.frozen.weight, built.to(torch.bfloat16).float())  # rounded, as the warning says


class MastersAtStart(Callback):
    def __init__(self) -> None:
        self.masters: dict = {}

    def on_train_start(self, trainer: Trainer, pl_module) -> None:
        self.masters = trainer.strategy.full_state_dict()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_second_fit_with_the_same_trainer_starts_from_the_fp32_masters(stage: int) -> None:
    """``trainer.fit`` again with more steps, as ddp continues from its fp32 weights. Stage 3 refused it (the
    released parameters' cast dtype was taken for the user's), and before that started from weights ungathered in
    bf16, i.e. rounded masters."""
    probe = MastersAtStart()
    model = ParityNet(checkpointing=False)
    trainer = _trainer(ZeroStrategy(stage=stage), precision="bf16-mixed", limit_val_batches=0, callbacks=[probe])
    trainer.fit(model)
    after_first = trainer.strategy.full_state_dict()
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model)
    assert trainer.global_step == 4
    assert sorted(k for k, v in after_first.items() if torch.equal(probe.masters[k], v)) == sorted(after_first)


def test_a_second_fit_from_a_module_left_in_16_bits_is_refused_unless_resuming(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path) -> None:
    """No room to hand the masters back (after_fit.py warns): the module keeps bf16 copies, and new masters taken
    from them would be rounded. Refused at the first step, before any update; a resume from a checkpoint replaces
    them and is fine."""
    monkeypatch.setattr("lightning_zero.after_fit.available_host_bytes", lambda: 1024)
    model = ParityNet(checkpointing=False)
    trainer = _trainer(ZeroStrategy(stage=2), precision="bf16-mixed", limit_val_batches=0)
    trainer.fit(model)
    assert model.blocks[0].up.weight.dtype == torch.bfloat16  # kept, as warned
    ckpt = str(tmp_path / "last.ckpt")
    trainer.save_checkpoint(ckpt)
    trainer.fit_loop.epoch_loop.max_steps = 4
    with pytest.raises(RuntimeError, match=r"held the previous fit's 16-bit training copy when this fit set up"):
        trainer.fit(model)
    assert trainer.global_step == 2
    trainer.fit(model, ckpt_path=ckpt)
    assert trainer.global_step == 4


def test_a_new_trainer_on_a_module_stage_3_still_partitions_is_refused_at_setup() -> None:
    """Stage 3 does not hand the module back (after_fit.py). A new Trainer on it failed at the first forward
    naming a gather (one rank: the first fit's forward guard) or read zero-byte storage (2+ ranks, released
    parameters: tests/distributed/test_released_state.py): now one error before any step says what to do, and
    doing it (the full weights into a fresh model) trains."""
    model = ParityNet(checkpointing=False)
    first = _trainer(ZeroStrategy(stage=3), limit_val_batches=0)
    first.fit(model)
    second = _trainer(ZeroStrategy(stage=3), limit_val_batches=0)
    with pytest.raises(RuntimeError, match=r"partitioned by another strategy's ZeRO stage 3 \(an earlier Trainer's fit"):
        second.fit(model)
    assert second.global_step == 0
    fresh = ParityNet(checkpointing=False)
    fresh.load_state_dict(first.strategy.full_state_dict())
    second = _trainer(ZeroStrategy(stage=3), limit_val_batches=0)
    second.fit(fresh)
    assert second.global_step == 2


class EmbeddingNet(ParityNet):
    """An embedding beside the dense parameters, built with ``embedding_kwargs``."""

    def __init__(self, **embedding_kwargs) -> None:
        super().__init__(checkpointing=False)
        self.tokens = torch.nn.Embedding(8, self.blocks[0].up.in_features, **embedding_kwargs)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("kwargs,says", [
    ({"sparse": True}, "has sparse=True: ZeRO partitions dense gradients"),
    ({"max_norm": 1.0}, "has max_norm=1.0: it renormalises its weight in place"),
])
def test_embedding_zero_cannot_follow_is_refused_up_front(stage: int, kwargs: dict, says: str) -> None:
    """Before the first step: sparse gradients failed in the first backward with torch's copy_() error
    naming no module; max_norm's in-place renormalisation was silently undone at stages 1 and 2."""
    trainer = _trainer(ZeroStrategy(stage=stage))
    with pytest.raises(ValueError, match=rf"^'tokens' \(Embedding\) {says}"):
        trainer.fit(EmbeddingNet(**kwargs))
    assert trainer.global_step == 0


def test_frozen_sparse_embedding_is_accepted() -> None:
    """No gradient, nothing to reduce: a frozen sparse embedding trains as under ddp."""
    model = EmbeddingNet(sparse=True)
    model.tokens.requires_grad_(False)
    trainer = _trainer(ZeroStrategy(stage=2))
    trainer.fit(model)
    assert trainer.global_step == 2



@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize(("dtype", "precision"), [(torch.bfloat16, "32-true"), (torch.float16, "bf16-mixed"),
                                                  (torch.float64, "32-true")], ids=["bf16", "fp16_mixed", "fp64"])
def test_trainable_parameter_built_in_another_dtype_is_refused_up_front(stage: int, dtype: torch.dtype,
                                                                         precision: str) -> None:
    """ddp steps a parameter the user built in bf16/fp16/fp64 in that dtype (autocast leaves parameter dtypes
    alone); every stage stepped an fp32 master instead: a bf16 embedding under ``32-true`` trained 0.5% apart from
    ddp's in 6 AdamW steps at stages 1 and 2, silently. Now fit stops before the first step naming it."""
    model = EmbeddingNet()
    model.tokens.to(dtype)
    trainer = _trainer(ZeroStrategy(stage=stage), precision=precision)
    with pytest.raises(ValueError, match=rf"^Parameter 'tokens\.weight' is trainable in {dtype}: ZeRO keeps an fp32 "
                                         r"master.*module\.float\(\)"):
        trainer.fit(model)
    assert trainer.global_step == 0


@pytest.mark.parametrize("stage", [2, 3])
def test_frozen_parameter_in_another_dtype_is_accepted(stage: int) -> None:
    """A frozen bf16 table (a bf16 base model under fp32 adapters) is never stepped: it stays as built."""
    model = EmbeddingNet()
    model.tokens.to(torch.bfloat16).requires_grad_(False)
    before = model.tokens.weight.detach().clone()
    trainer = _trainer(ZeroStrategy(stage=stage))
    trainer.fit(model)
    assert trainer.global_step == 2
    if stage < 3:  # stage 3 keeps the module released after fit (full_state_dict() reads it)
        assert model.tokens.weight.dtype == torch.bfloat16 and torch.equal(model.tokens.weight, before)
    else:
        full = trainer.strategy.full_state_dict()
        assert torch.equal(full["tokens.weight"].to(torch.bfloat16), before)


class _CastsToFp32(ParityNet):
    """A head fed ``h.float()``, as code written for ddp's autocast does: fine under ddp's ``bf16-mixed``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.blocks[0](self.emb(x))
        h = self.sometimes(h.float())  # code written for autocast casts up before a layer
        logits = torch.nn.functional.linear(self.norm(h), self.emb.weight)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize("stage", [2, 3])
def test_dtype_mismatch_under_the_cast_layout_names_the_autocast_layout(stage: int) -> None:
    """torch's "mat1 and mat2 must have the same dtype" named nothing of ours; the error now says the module trains
    in bf16 under the cast layout and names mixed_precision='autocast', under which the same model trains."""
    trainer = _trainer(ZeroStrategy(stage=stage), precision="bf16-mixed", limit_val_batches=0)
    with pytest.raises(RuntimeError, match=r"(?s)same dtype.*trains the module itself in bfloat16.*"
                                           r"mixed_precision='autocast'"):
        trainer.fit(_CastsToFp32(checkpointing=False))
    trainer = _trainer(ZeroStrategy(stage=stage, mixed_precision="autocast"), precision="bf16-mixed",
                       limit_val_batches=0)
    trainer.fit(_CastsToFp32(checkpointing=False))
    assert trainer.global_step == 2


class _OneProcessFNO(FNO):
    """tests/zoo's FNO with a plain loader: one process needs no distributed sampler."""

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.train_data(), batch_size=4)

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_trainable_complex_parameter_is_refused_up_front(stage: int) -> None:
    """A Fourier neural operator's complex spectral weights came back from the flat buffers as real tensors
    and the model's own einsum failed ("expected scalar type ComplexFloat but found Float"), naming nothing
    of ours. Now fit stops before the first step naming the parameter and the real-pairs fix, whose parity
    with ddp is tests/zoo "fno"."""
    trainer = _trainer(ZeroStrategy(stage=stage))
    with pytest.raises(ValueError, match=r"^Parameter 'spectral\.0\.weights1' is complex \(torch\.complex64\).*"
                                         r"torch\.view_as_real"):
        trainer.fit(_OneProcessFNO(complex_weights=True))
    assert trainer.global_step == 0


def test_frozen_complex_parameter_is_accepted() -> None:
    """No stage partitions a frozen complex parameter: it stays the user's tensor, complex, and trains the rest."""
    model = _OneProcessFNO(complex_weights=True)
    for p in model.spectral.parameters():
        p.requires_grad_(False)
    before = model.spectral[0].weights1.detach().clone()
    trainer = _trainer(ZeroStrategy(stage=3))
    trainer.fit(model)
    assert trainer.global_step == 2
    assert model.spectral[0].weights1.is_complex() and torch.equal(model.spectral[0].weights1, before)


@pytest.mark.parametrize("entry", ["fit", "validate"])
def test_lightning_module_compiled_whole_is_refused_naming_the_zero_road(entry: str) -> None:
    """``trainer.fit(torch.compile(model))`` was refused by Lightning with a line naming only single-device, ddp
    and fsdp; ours names ``compile=True`` and the inner-network compile, before any step (nothing is compiled:
    the refusal comes first)."""
    model = ParityNet(checkpointing=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(ZeroStrategy(stage=2), limit_val_batches=1)
    with pytest.raises(RuntimeError, match=r"^trainer\.fit\(torch\.compile\(model\)\).*ZeroStrategy\(compile=True\)"):
        getattr(trainer, entry)(torch.compile(model))
    assert trainer.global_step == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_uncompiled_module_still_reaches_the_strategy() -> None:
    """The strategy's module slot (a property intercepting Lightning's assignment) still holds what fit set."""
    model = ParityNet(checkpointing=False)
    trainer = _trainer(ZeroStrategy(stage=1), limit_val_batches=0)
    trainer.fit(model)
    assert trainer.strategy.lightning_module is model and trainer.strategy.model is not None
    assert trainer.global_step == 2


@pytest.mark.parametrize("kwargs,says", [
    ({"fp8": "tensorwise"}, "fp8='tensorwise' computes from bf16 weights"),
    ({"state_precision": "bf16_sr"}, "state_precision='bf16_sr' computes from bf16 weights"),
    ({"tensor_parallel": 2}, "with tensor_parallel=2 is not built yet"),
    ({"mixed_precision": "amp"}, r"mixed_precision must be one of \['cast', 'autocast'\]"),
])
def test_autocast_layout_refuses_what_needs_16bit_weights(kwargs: dict, says: str) -> None:
    opts = {"mixed_precision": "autocast", **kwargs}
    with pytest.raises(ValueError, match=says):
        ZeroStrategy(stage=2, **opts)


def test_checkpoint_plugin_that_sharded_checkpoints_bypass_is_refused() -> None:
    """A user's CheckpointIO (here Lightning's AsyncCheckpointIO) would silently not be used by sharded
    checkpoints; the full format writes through it, and the default TorchCheckpointIO is accepted."""
    from lightning.pytorch.plugins import AsyncCheckpointIO, TorchCheckpointIO

    trainer = _trainer(ZeroStrategy(stage=2), plugins=[AsyncCheckpointIO()])
    with pytest.raises(ValueError, match=r"AsyncCheckpointIO is not used by sharded checkpoints.*checkpoint_async=True"):
        trainer.fit(ParityNet(checkpointing=False))
    assert trainer.global_step == 0
    for strategy, plugin in ((ZeroStrategy(stage=2, checkpoint_format="full"), AsyncCheckpointIO()),
                             (ZeroStrategy(stage=2), TorchCheckpointIO())):
        trainer = _trainer(strategy, plugins=[plugin], limit_val_batches=0)
        trainer.fit(ParityNet(checkpointing=False))
        assert trainer.global_step == 2
