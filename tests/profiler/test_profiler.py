"""FlopsProfiler (issue #19): forward FLOPs counted from the ops that run equal the analytic count
exactly for every Linear (2 x in x out x tokens) on an MLP and on the example GPT, the whole GPT is
within 1% of examples/gpt.py's formula and exact against its matmul count; backward FLOPs of an MLP
are exact too; the callback profiles one step, writes the report to the run directory, logs the
totals and leaves no hook or dispatch mode behind; ``python -m lightning_zero.profiler`` works."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import WindowDataset  # noqa: E402
from gpt import GPTConfig, GPTModule, flops_per_token  # noqa: E402

from lightning_zero.profiler import FlopsProfiler, ModuleProfiler  # noqa: E402
from lightning_zero.profiler.__main__ import main as cli_main  # noqa: E402

SMALL = dict(vocab_size=256, n_layer=4, n_head=4, d_model=128, seq_len=128)  # conf/model/gpt_small.yaml


class MLP(L.LightningModule):
    def __init__(self, sizes: tuple[int, ...] = (16, 48, 24, 8)) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.Tanh())][:-1])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layers(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Capture(Logger):
    """A logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[Optional[int], dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def _hook_counts(module: nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules()]


def test_mlp_linear_flops_exact_forward_and_backward_and_callback_outputs(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MLP()
    before = _hook_counts(model)
    prof = FlopsProfiler(profile_step=2, module_depth=1, top_modules=2)
    logger = Capture()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=logger, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[prof],
                        default_root_dir=str(tmp_path))
    trainer.fit(model, train_dataloaders=DataLoader(torch.randn(40, 5, 16), batch_size=2))  # 2 x 5 = 10 tokens
    assert prof.result is not None and prof.totals is not None
    stats = prof.result.by_name()
    linears = [(f"layers.{i}", m) for i, m in enumerate(model.layers) if isinstance(m, nn.Linear)]
    tokens = 10
    for name, lin in linears:
        assert stats[name].fwd_flops == 2 * lin.in_features * lin.out_features * tokens
        assert stats[name].fwd_macs == lin.in_features * lin.out_features * tokens
        assert stats[name].params == lin.weight.numel() + lin.bias.numel()
        assert stats[name].fwd_calls == 1 and stats[name].bwd_time_s is not None
    fwd = sum(2 * m.in_features * m.out_features * tokens for _, m in linears)
    assert stats[""].fwd_flops == prof.result.fwd_flops == fwd
    # backward: every weight gradient, every input gradient but the first layer's (the data needs none)
    first = linears[0][1]
    assert prof.result.bwd_flops == 2 * fwd - 2 * first.in_features * first.out_features * tokens
    # one step profiled, nothing left behind
    assert _hook_counts(model) == before and _get_current_dispatch_mode() is None
    path = Path(prof.report_path or "")  # the run directory (this logger has none: the root dir)
    assert path.is_file() and path.parent == Path(trainer.log_dir or trainer.default_root_dir) == tmp_path
    text = path.read_text()
    assert "step 2" in text and "layers.0" not in text.split("\n")[0] and "Linear" in text
    logged = [m for step, m in logger.metrics if "profiler/flops_per_step" in m]
    assert len(logged) == 1 and logged[0]["profiler/flops_per_step"] == prof.totals.flops
    assert logged[0]["profiler/params"] == sum(p.numel() for p in model.parameters())
    assert [step for step, m in logger.metrics if "profiler/flops_per_step" in m] == [2]


def test_gpt_linears_exact_and_the_whole_model_within_one_percent_of_the_formula() -> None:
    cfg = GPTConfig(**SMALL)
    module = GPTModule(cfg)
    b, t = 2, cfg.seq_len
    with ModuleProfiler(module) as prof:
        module(torch.zeros(b, t, dtype=torch.long))
    result = prof.result
    assert result is not None
    stats = result.by_name()
    linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    assert len(linears) == 4 * cfg.n_layer
    for name, lin in linears.items():
        assert stats[name].fwd_flops == 2 * lin.in_features * lin.out_features * b * t, name
    # the example's formula (forward = a third of flops_per_token): within 1% (biases and LayerNorms
    # are in its parameter count, not in any matmul)
    formula = flops_per_token(cfg) / 3 * b * t
    assert abs(result.fwd_flops - formula) / formula < 0.01
    # exactly the matmuls: 12 d^2 per block and the tied head, 2 FLOPs each, plus attention's 4 L d T per token
    d, L_, V = cfg.d_model, cfg.n_layer, cfg.vocab_size
    assert result.fwd_flops == (2 * (12 * d * d * L_ + V * d) + 4 * L_ * d * t) * b * t
    assert stats["model.blocks.0.attn"].fwd_flops == 2 * (4 * d * d) * b * t + 4 * d * t * b * t  # incl. SDPA
    assert stats["model"].params == sum(p.numel() for p in module.parameters())


def test_activation_checkpointing_recomputation_counts_as_backward() -> None:
    cfg = GPTConfig(**dict(SMALL, n_layer=2, seq_len=32, activation_checkpointing=True))
    module = GPTModule(cfg)
    with ModuleProfiler(module) as prof:
        module(torch.zeros(2, 32, dtype=torch.long)).sum().backward()
    plain = GPTModule(GPTConfig(**dict(SMALL, n_layer=2, seq_len=32)))
    with ModuleProfiler(plain) as ref:
        plain(torch.zeros(2, 32, dtype=torch.long)).sum().backward()
    assert prof.result.fwd_flops == ref.result.fwd_flops  # recomputation is not forward work ...
    blocks_fwd = sum(prof.result.by_name()[f"model.blocks.{i}"].fwd_flops for i in range(2))
    # ... it is backward's: each block's forward again, but for its last matmul (torch's non-reentrant
    # checkpoint stops recomputing once every saved tensor is back; mlp.proj's output is saved by nothing)
    last = sum(prof.result.by_name()[f"model.blocks.{i}.mlp.proj"].fwd_flops for i in range(2))
    assert prof.result.bwd_flops == ref.result.bwd_flops + blocks_fwd - last
    assert all(m.fwd_calls == 1 for m in prof.result.modules if m.name.startswith("model.blocks.0"))


def test_cli_one_off_report(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.txt"
    cli_main(["examples.gpt:GPTModule", "--yaml-arg", "model=conf/model/gpt_tiny.yaml", "--input", "2x64:long",
              "--depth", "2", "--top", "2", "--device", "cpu", "--output", str(out)])
    shown = capsys.readouterr().out
    assert "forward FLOPs per step" in shown and "(Block)" not in shown  # depth 2 stops above the blocks
    assert "(Block)" in out.read_text()  # the file has every module
    with pytest.raises(SystemExit):
        cli_main(["examples.gpt", "--device", "cpu"])
