"""The example GPT: shapes, real weight tying, activation checkpointing, FLOPs formula, param groups;
GPTModule trains the plain GPT unless asked for pipeline stages, and Lightning's model summary names
it and measures its FLOPs (issue #14); its PipelineModule form: same function as the plain GPT, GPT-2
initialisation (also through ZeRO-3's ``zero_init_module``), checkpoints loadable into either form,
and training under non-pipeline strategies in one process."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import WindowDataset  # noqa: E402
from gpt import (  # noqa: E402
    GPT, Block, Embeddings, GPTConfig, GPTModule, LMHead, convert_gpt_state_dict, flops_per_token, gpt_pipeline,
    lr_lambda, matmul_params,
)

from lightning_zero.pipeline import PipelineModule  # noqa: E402

TINY = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=32, seq_len=16)


def _ids(batch: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, t), generator=torch.Generator().manual_seed(seed))


def test_logits_shape_and_causality() -> None:
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    idx = _ids()
    logits = model(idx)
    assert logits.shape == (2, 16, 256)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256  # a future token must not change earlier positions
    assert torch.allclose(model(changed)[:, :-1], logits[:, :-1], atol=1e-6)
    with pytest.raises(ValueError, match="exceeds"):
        model(_ids(t=17))


def test_tied_head_is_the_embedding() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    assert model.lm_head is None
    names = [n for n, _ in model.named_parameters()]
    assert not any("lm_head" in n for n in names)
    idx = torch.zeros(2, 16, dtype=torch.long)  # only token 0 is looked up ...
    model(idx).logsumexp(-1).sum().backward()
    grad = model.wte.weight.grad
    assert grad is not None and grad[1:].abs().sum() > 0  # ... so other rows got gradient through the head
    hidden: list[torch.Tensor] = []
    model.ln_f.register_forward_hook(lambda _m, _i, out: hidden.append(out))
    with torch.no_grad():
        model.wte.weight[5].add_(1.0)  # an edit of the embedding is an edit of the head
        logits = model(_ids())
    torch.testing.assert_close(logits, torch.nn.functional.linear(hidden[-1], model.wte.weight))


def test_untied_model_has_its_own_head() -> None:
    model = GPT(replace(TINY, tie_weights=False))
    assert model.lm_head is not None
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()


@pytest.mark.parametrize("pipeline", [False, True])
def test_activation_checkpointing_gives_the_same_gradients(pipeline: bool) -> None:
    torch.manual_seed(0)
    plain = GPTModule(model=TINY, pipeline=pipeline).model
    ckpt = GPTModule(model=replace(TINY, activation_checkpointing=True), pipeline=pipeline).model
    ckpt.load_state_dict(plain.state_dict())
    if pipeline:
        assert isinstance(ckpt, PipelineModule) and ckpt.activation_checkpoint_interval == 1
    idx = _ids()
    for m in (plain, ckpt):
        logits = m.predict(idx) if pipeline else m(idx)
        torch.nn.functional.cross_entropy(logits.view(-1, 256), idx.view(-1)).backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt.named_parameters()):
        assert a.grad is not None and b.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("tie, bias", [(True, True), (False, True), (True, False)])
def test_matmul_params_match_the_module(tie: bool, bias: bool) -> None:
    cfg = replace(TINY, tie_weights=tie, bias=bias)
    model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    lookups = model.wpe.weight.numel() + (0 if tie else model.wte.weight.numel())
    assert matmul_params(cfg) == total - lookups


def test_flops_per_token_of_the_benchmark_model() -> None:
    cfg = GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024)
    n = matmul_params(cfg)
    assert 1.25e9 < n < 1.35e9  # "GPT-1.3B"
    assert flops_per_token(cfg) == 6 * n + 12 * 24 * 2048 * 1024
    # DESIGN.md section 7: 52.3k tokens/s on one H200 is 443 TFLOP/s.
    assert 52.3e3 * flops_per_token(cfg) / 1e12 == pytest.approx(443, rel=0.01)


@pytest.mark.parametrize("pipeline", [True, False])
def test_param_groups_decay_only_linear_weights(pipeline: bool) -> None:
    module = GPTModule(model=TINY, pipeline=pipeline)
    decay, no_decay = module.param_groups()
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0.0
    ids = {id(p) for p in decay["params"]} | {id(p) for p in no_decay["params"]}
    assert len(ids) == len(decay["params"]) + len(no_decay["params"])  # no parameter twice
    assert ids == {id(p) for p in module.parameters()}  # every parameter once
    assert all(p.dim() == 2 for p in decay["params"])
    no_decay_ids = {id(p) for p in no_decay["params"]}
    if pipeline:
        assert isinstance(module.model, PipelineModule)
        emb, ln_f, block = module.model.tied["embed"], module.model.layers["3"], module.model.layers["1"]
    else:
        assert isinstance(module.model, GPT)
        emb, ln_f, block = module.model, module.model.ln_f, module.model.blocks[0]
    for p in (emb.wte.weight, emb.wpe.weight, ln_f.weight, ln_f.bias, block.attn.qkv.bias):
        assert id(p) in no_decay_ids


def test_configure_optimizers_and_schedule() -> None:
    module = GPTModule(model=dict(vars(TINY)), lr=1e-2, warmup_steps=4, max_steps=20, optimizer="adam")
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]
    assert isinstance(opt, torch.optim.Adam) and len(opt.param_groups) == 2
    assert sched["interval"] == "step"
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)  # first warm-up step
    assert lr_lambda(3, 4, 20, 0.1) == pytest.approx(1.0)
    assert lr_lambda(20, 4, 20, 0.1) == pytest.approx(0.1)
    assert lr_lambda(100, 4, 20, 0.1) == pytest.approx(0.1)
    sgd = GPTModule(model=TINY, optimizer="sgd", max_steps=10).configure_optimizers()["optimizer"]
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="adamw"):
        GPTModule(model=TINY, optimizer="lion")
    with pytest.raises(ValueError, match="must divide"):
        GPTConfig(vocab_size=256, n_layer=1, n_head=3, d_model=32, seq_len=8)


def test_hparams_rebuild_the_module() -> None:
    module = GPTModule(model=TINY, lr=3e-4, betas=(0.8, 0.9), max_steps=7)
    clone = GPTModule(**module.hparams)
    assert clone.config == module.config and clone.optim == module.optim and clone.max_steps == 7


# ------------------------------------------------------------------------------------------------ pipeline form


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    """Lightning writes LOCAL_RANK, WORLD_SIZE, MASTER_PORT... into os.environ; later tests must not see them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tie", [True, False])
def test_pipeline_form_is_the_same_network(tie: bool) -> None:
    cfg = replace(TINY, tie_weights=tie)
    module = GPTModule(model=cfg, pipeline=True)
    assert isinstance(module.model, PipelineModule) and module.hparams["pipeline"] is True
    assert module.model.num_layers == cfg.n_layer + 3
    plain = GPT(cfg)
    module.model.load_state_dict(convert_gpt_state_dict(plain.state_dict(), cfg, to_pipeline=True, prefix=""))
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in plain.parameters())
    idx, targets = _ids(seed=1), _ids(seed=2)
    torch.testing.assert_close(module(idx), plain(idx))
    loss = module._loss((idx, targets))
    ref = torch.nn.functional.cross_entropy(plain(idx).view(-1, 256), targets.view(-1))
    torch.testing.assert_close(loss, ref)
    loss.backward()
    ref.backward()
    got = convert_gpt_state_dict(_grads(module.model), cfg, to_pipeline=False, prefix="")
    expected = _grads(plain)
    assert got.keys() == expected.keys()
    for name in expected:  # the tied embedding gets gradient from both of its uses
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)
    head = module.model.tied["embed"] if tie else module.model.layers[str(cfg.n_layer + 2)]
    assert isinstance(head, Embeddings if tie else LMHead)


def _check_gpt2_init(model: nn.Module, n_layer: int) -> None:
    residual = {id(p) for m in model.modules() if isinstance(m, Block) for p in m.residual_projections()}
    assert len(residual) == 2 * n_layer
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            want = 0.02 / math.sqrt(2 * n_layer) if id(m) in residual else 0.02
            assert float(m.weight.std()) == pytest.approx(want, rel=0.12), name
            if isinstance(m, nn.Linear) and m.bias is not None:
                assert float(m.bias.abs().max()) < 1e-3, name
        elif isinstance(m, nn.LayerNorm):
            assert float((m.weight - 1).abs().max()) < 1e-3 and float(m.bias.abs().max()) < 1e-3, name


INIT_CFG = GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=64, seq_len=64)


@pytest.mark.parametrize("tie", [True, False])
def test_both_forms_are_gpt2_initialised(tie: bool) -> None:
    cfg = replace(INIT_CFG, tie_weights=tie)
    torch.manual_seed(0)
    _check_gpt2_init(gpt_pipeline(cfg), cfg.n_layer)
    _check_gpt2_init(GPT(cfg), cfg.n_layer)


@pytest.mark.parametrize("pipeline", [True, False])
def test_zero_init_module_initialises_every_module_gpt2_style(pipeline: bool) -> None:
    """ZeRO-3's sharded init calls the hook for every module it materialises, whatever values the
    module's own reset_parameters left (here: constants)."""
    torch.manual_seed(0)
    module = GPTModule(model=INIT_CFG, pipeline=pipeline)
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(0.5)
        for m in module.model.modules():
            if isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            module.zero_init_module(m)
    _check_gpt2_init(module.model, INIT_CFG.n_layer)


def test_checkpoints_load_into_either_form() -> None:
    pipe, plain = GPTModule(model=TINY, pipeline=True), GPTModule(model=TINY)
    assert isinstance(plain.model, GPT) and isinstance(pipe.model, PipelineModule)
    for src, dst in ((plain, pipe), (pipe, plain)):
        checkpoint = {"state_dict": src.state_dict()}
        dst.on_load_checkpoint(checkpoint)
        dst.load_state_dict(checkpoint["state_dict"])  # strict: every key renamed, none missing
        torch.testing.assert_close(dst(_ids()), src(_ids()))
    same = {"state_dict": pipe.state_dict()}
    pipe.on_load_checkpoint(same)  # already the right form: unchanged
    assert list(same["state_dict"]) == list(pipe.state_dict())


class LossProbe(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit_one_process(module: GPTModule, strategy: Any, steps: int = 3) -> tuple[L.Trainer, list[float]]:
    probe = LossProbe()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, callbacks=[probe],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=1.0, use_distributed_sampler=False,  # the same batches under every strategy
    )
    data = WindowDataset(torch.randint(0, 256, (2000,), generator=torch.Generator().manual_seed(0)), 16, 16)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4))
    return trainer, probe.losses


def test_pipeline_gpt_trains_alike_under_non_pipeline_strategies(tmp_path: Path) -> None:
    """The PipelineModule form in one process runs its layers in sequence: zero2 and zero3 (where the
    tied embedding is a gather unit used twice per forward) give the single-device losses."""
    from lightning_zero import ZeroStrategy

    runs = {}
    for name, strategy in (("single", "auto"), ("zero2", ZeroStrategy(stage=2)), ("zero3", ZeroStrategy(stage=3))):
        torch.manual_seed(0)
        module = GPTModule(model=TINY, lr=1e-2, warmup_steps=1, max_steps=3, pipeline=True)
        trainer, losses = _fit_one_process(module, strategy)
        runs[name] = (trainer, module, losses)
    ref = runs["single"][2]
    assert len(ref) == 3 and all(math.isfinite(x) for x in ref)
    for name in ("zero2", "zero3"):
        assert runs[name][2] == pytest.approx(ref, rel=1e-4), name
    # a ZeRO-3 checkpoint (full weights) loads into both forms
    trainer, _, _ = runs["zero3"]
    path = tmp_path / "zero3.ckpt"
    trainer.save_checkpoint(path)
    single = runs["single"][1].eval()
    with torch.no_grad():
        expected = single(_ids())
        for pipeline in (True, False):
            loaded = GPTModule.load_from_checkpoint(path, pipeline=pipeline).eval()
            assert isinstance(loaded.model, PipelineModule if pipeline else GPT)
            torch.testing.assert_close(loaded(_ids()), expected, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("pipeline", [True, False])
def test_deferred_construction_under_zero3(pipeline: bool) -> None:
    """benchmarks/peers_worker.py's pattern: the network is built in configure_model (ZeRO-3 sharded
    init: parameters created on the meta device), then materialised and initialised module by module
    through zero_init_module."""
    from lightning_zero import ZeroStrategy

    initialised: list[str] = []

    class Deferred(GPTModule):
        def _build_model(self) -> Any:
            return None

        def configure_model(self) -> None:
            if getattr(self, "model", None) is None:
                if pipeline:
                    self.model = gpt_pipeline(self.config)
                    # PipelineModule builds its layers lazily, on first use: build them here, inside
                    # ZeRO-3's meta-device context (a pipeline strategy would build only its stage's).
                    self.model.materialize()
                else:
                    self.model = GPT(self.config)
                assert all(p.is_meta for p in self.model.parameters())

        def zero_init_module(self, module: nn.Module) -> None:
            initialised.append(type(module).__name__)
            super().zero_init_module(module)

    torch.manual_seed(0)
    module = Deferred(model=INIT_CFG, lr=1e-6, warmup_steps=1, max_steps=1)
    trainer, losses = _fit_one_process(module, ZeroStrategy(stage=3), steps=1)
    assert isinstance(module.model, PipelineModule if pipeline else GPT)
    assert {"Linear", "Embedding"} <= set(initialised)
    assert len(losses) == 1 and math.isfinite(losses[0])
    with trainer.strategy.gathered_params():
        _check_gpt2_init(module.model, INIT_CFG.n_layer)


def test_onebit_presets_train_under_zero0_and_are_refused_elsewhere() -> None:
    """conf/optimizer/onebit_*.yaml select OneBitAdam/OneBitLamb; a stage they cannot combine with fails early."""
    import lightning.pytorch as pl

    from lightning_zero import ZeroStrategy
    from lightning_zero.optim import OneBitAdam

    rows = [(r[:-1], r[1:]) for r in torch.randint(0, 256, (16, 17))]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    cfg = GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, seq_len=16)

    def trainer(stage: int) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), max_steps=4, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    module = GPTModule(model=cfg, optimizer="onebit_adam", max_steps=4)
    t = trainer(0)
    t.fit(module, loader)
    assert isinstance(t.optimizers[0], OneBitAdam) and t.optimizers[0].freeze_step == 1  # 15% of 4 steps, at least 1
    with pytest.raises(ValueError, match="zero0"):
        trainer(2).fit(GPTModule(model=cfg, optimizer="onebit_lamb", max_steps=4), loader)


def test_default_module_is_the_plain_gpt_and_its_summary_is_honest() -> None:
    """Issue #14: the example's ModelSummary called a plain zero2 run's model a PipelineModule with 0
    FLOPs. The default GPTModule holds the plain GPT, and its example input lets Lightning's summary
    measure the forward FLOPs (close to the analytic count: the formula also counts LayerNorm
    parameters and biases, which do no matmul)."""
    from lightning.pytorch.utilities.model_summary import summarize

    cfg = replace(TINY, seq_len=32)
    module = GPTModule(model=cfg)
    assert isinstance(module.model, GPT) and module.hparams["pipeline"] is False
    summary = summarize(module)
    assert summary.layer_types == ["GPT"]
    forward = flops_per_token(cfg) * cfg.seq_len / 3  # one sequence, forward only (1/3 of 6N + attention)
    assert 0.75 * forward < summary.total_flops <= forward
    assert "PipelineModule" not in str(summary)
    # where a model call outside the step methods cannot run, nothing is measured (and nothing hangs)
    assert GPTModule(model=cfg, pipeline=True).example_input_array is None
    explicit = GPTModule(model=cfg)
    explicit.example_input_array = torch.zeros((2, 8), dtype=torch.long)
    assert explicit.example_input_array.shape == (2, 8)


@pytest.mark.parametrize("stage", [2, 3])
def test_summary_runs_under_zero_stages(stage: int) -> None:
    """The summary's forward runs on every rank before training: measured under stage 2, skipped under
    stage 3 (parameters are gathered only inside steps), and the run trains either way."""
    from lightning.pytorch.callbacks import ModelSummary

    from lightning_zero import ZeroStrategy

    class Probe(ModelSummary):
        def summarize(self, summary_data: Any, total_parameters: int, *args: Any, total_flops: int = 0,
                      **kwargs: Any) -> None:
            self.seen = (dict(summary_data)["Type"], total_parameters, total_flops)

    probe = Probe()
    module = GPTModule(model=TINY, lr=1e-2, warmup_steps=1, max_steps=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=stage), max_steps=2, logger=False,
        callbacks=[probe], enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
    )
    data = WindowDataset(torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(0)), 16, 16)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=4))
    types, params, flops = probe.seen
    assert types == ["GPT"] and params == sum(p.numel() for p in GPT(TINY).parameters())
    assert (flops > 0) == (stage < 3)
    assert trainer.global_step == 2
