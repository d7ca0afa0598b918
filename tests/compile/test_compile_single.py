"""torch.compile pieces in one process: the config option, eager watched batches, the example's
``model.compile``, and what zero/compile.py does to modules (issue #16)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZeroConfig
from lightning_zero.zero.compile import apply_compile, dynamo_context_of, is_compiled
from lightning_zero.zero.read_watch import ReadWatch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from gpt import Block, GPTConfig, GPTModule  # noqa: E402

TINY = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)


def counting(calls: list[int]) -> Callable[..., Any]:
    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            calls[0] += 1
            return gm(*args)

        return run

    return backend


@pytest.mark.parametrize("bad,match", [
    ({"compile": "yes"}, "compile must be True or False"),
    ({"compile": True, "compile_options": {"backnd": "eager"}}, "unknown torch.compile argument"),
    ({"compile_options": {"backend": "eager"}}, "compile is False"),
])
def test_config_rejects_bad_compile_settings(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**bad)


def test_watched_batches_run_eagerly() -> None:
    """ReadWatch (stage 3's first batch of each kind) must never be traced into a graph: inside it,
    compiled functions run eagerly; after it, compiled again."""
    calls = [0]
    fn = torch.compile(lambda x: x * 2 + 1, backend=counting(calls))
    x = torch.ones(3)
    with ReadWatch([]):
        assert torch.equal(fn(x), x * 3)
    assert calls[0] == 0
    fn(x)
    assert calls[0] == 1


def test_context_of_a_module_compile_is_found() -> None:
    lin = nn.Linear(2, 2)
    lin.compile(backend="eager", fullgraph=True)
    ctx = dynamo_context_of(lin._compiled_call_impl)
    assert ctx is not None and callable(ctx)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(GPTConfig(**TINY)) for _ in range(2))
        self.norm = nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.norm(x)


def test_apply_compile_redirects_a_whole_network_compile_under_stage3_only() -> None:
    calls = [0]
    net = _Net()
    outer = torch.compile(net, backend=counting(calls))
    root = nn.ModuleDict({"model": outer})
    units = [(f"model._orig_mod.blocks.{i}", b) for i, b in enumerate(net.blocks)]
    below = apply_compile(root, units, stage3=False, options=None)  # below stage 3: the user's compile stays
    assert below.made_eager == [] and below.compiled == [] and not any(is_compiled(b) for b in net.blocks)
    plan = apply_compile(root, units, stage3=True, options=None)
    assert plan.made_eager == ["model"] and plan.compiled == [n for n, _ in units]
    assert plan.compiled_around == ["model._orig_mod.norm"]  # the rest of what the user compiled
    x = torch.randn(2, 4, 32)
    expected = nn.LayerNorm.forward(net.norm, net.blocks[1]._call_impl(net.blocks[0]._call_impl(x)))  # eager
    torch.testing.assert_close(root["model"](x), expected)
    assert calls[0] == 3  # one compiled graph per block call and the norm's, the user's backend; the outer call eager
    again = apply_compile(root, units, stage3=True, options=None)  # setup again (validate after fit)
    assert again.compiled == [] and again.already_compiled == [n for n, _ in units] and again.compiled_around == []


def test_units_of_torch_nn_itself_are_compiled_under_stage3() -> None:
    """issue #27 item 2: blocks made of ``nn.Sequential(Linear, GELU, Linear)`` give Linear units, modules
    of torch.nn whose frames dynamo skips; with the whole network compiled (fullgraph, the user's
    backend) every unit and every module between them is compiled through a frame of ours, each
    Linear and each GELU once per call, and the values are the eager ones."""
    calls = [0]
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)) for _ in range(2)))
    root = nn.ModuleDict({"net": torch.compile(net, backend=counting(calls), fullgraph=True)})
    units = [(f"net._orig_mod.{b}.{i}", net[b][i]) for b in range(2) for i in (0, 2)]
    plan = apply_compile(root, units, stage3=True, options=None)
    assert plan.compiled == [n for n, _ in units] and plan.already_compiled == []
    assert plan.compiled_around == ["net._orig_mod.0.1", "net._orig_mod.1.1"]
    x = torch.randn(3, 4)
    with torch.no_grad():
        expected = x
        for block in net:
            for layer in block:
                expected = type(layer).forward(layer, expected)
    torch.testing.assert_close(root["net"](x), expected)
    assert calls[0] == 6
    net[0][1](x)  # a part called outside the compiled network's forward runs eagerly, as under the user's compile
    assert calls[0] == 6
    assert "net._orig_mod.0.0.weight" in root.state_dict() and all(is_compiled(m) for _, m in units)


def test_compile_option_compiles_torch_builtins_and_falls_back_to_children() -> None:
    calls = [0]
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    plan = apply_compile(net, [], stage3=False, options={"backend": counting(calls), "fullgraph": True})
    assert plan.compiled == ["0"]  # a torch.nn module on its own, compiled through a frame of ours
    net(torch.randn(2, 4))
    assert calls[0] == 1
    model = nn.ModuleDict({"net": _Net()})
    plan = apply_compile(model, [], stage3=False, options={"backend": "eager"})
    assert plan.compiled == ["net"]


def _fit(compile_network: bool, steps: int = 3) -> tuple[list[float], ZeroStrategy, GPTModule]:
    torch.manual_seed(0)
    losses: list[float] = []

    class Recorded(GPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            losses.append(float(loss.detach()))
            return loss

        def train_dataloader(self) -> DataLoader:
            data = torch.randint(0, 64, (16, 17), generator=torch.Generator().manual_seed(3))
            return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)

    model = Recorded(GPTConfig(**TINY, compile=compile_network), warmup_steps=1)
    strategy = ZeroStrategy(stage=3, param_persistence_threshold=0, bucket_size_mb=0.002)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, strategy=strategy)
    with torch.compiler.set_stance("default", force_backend="aot_eager"):  # fast on CPU; same path as inductor
        trainer.fit(model)
    return losses, strategy, model


def test_example_model_compile_under_zero3() -> None:
    """``model.compile=true`` compiles the example GPT's blocks (``.compile()``, names unchanged), which are
    ZeRO-3's units: they train compiled, as the eager run does."""
    eager, _, plain = _fit(False)
    compiled, strategy, model = _fit(True)
    assert not any(b._compiled_call_impl is not None for b in plain.model.blocks)
    assert strategy.compile_plan is not None
    assert strategy.compile_plan.already_compiled == ["model.blocks.0", "model.blocks.1"]
    assert strategy.compile_plan.made_eager == [] and strategy.compile_plan.compiled == []
    assert model.model._compiled_call_impl is None and all(b._compiled_call_impl is not None for b in model.model.blocks)
    assert "model.blocks.0.ln_1.weight" in model.state_dict()
    assert max(abs(a - b) for a, b in zip(compiled, eager)) < 1e-4
