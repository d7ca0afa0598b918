"""Worker run under ``torchrun``: trains ParityNet under several strategies in one process group.

Writes ``<out>/<name>.pt`` on rank 0 with per-step losses, final full weights and per-rank memory
counts. Usage: torchrun --nproc-per-node N tests/helpers/dist_worker.py OUT NAME=SPEC [NAME=SPEC ...]
where SPEC is ``ddp`` or ``zeroK[:key=value,...]`` (keys: precision, accumulate, clip, steps, opt, ckpt).
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.helpers.parity_model import ParityNet  # noqa: E402


def parse(spec: str) -> tuple[str, dict[str, str]]:
    kind, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return kind, opts


class MemoryProbe(pl.Callback):
    """Counts optimizer-state and gradient storage on this rank right after backward/step."""

    def __init__(self) -> None:
        self.grad_bytes = 0
        self.state_bytes = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        strategy = trainer.strategy
        tensors = [p.grad for p in pl_module.parameters() if p.grad is not None]
        for engine in getattr(strategy, "engines", []):
            for fg in engine.groups:
                tensors += [t for t in (fg.flat_grad, fg.grad_shard) if t is not None]
        self.grad_bytes = max(self.grad_bytes, storage_bytes(tensors))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        tensors = []
        for opt in trainer.optimizers:
            for st in opt.state.values():
                tensors += [v for v in st.values() if torch.is_tensor(v) and v.dim() > 0]
        self.state_bytes = max(self.state_bytes, storage_bytes(tensors))


def run(name: str, spec: str, out: str) -> None:
    kind, opts = parse(spec)
    pl.seed_everything(0, workers=True)
    model = ParityNet(optimizer=opts.get("opt", "adamw"))
    if kind == "ddp":
        strategy = DDPStrategy(find_unused_parameters=True)
    else:
        strategy = lightning_zero.ZeroStrategy(stage=int(kind[-1]), bucket_size_mb=float(opts.get("bucket_mb", 0.002)))
    probe = MemoryProbe()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        precision=opts.get("precision", "32-true"),
        max_steps=int(opts.get("steps", 30)),
        accumulate_grad_batches=int(opts.get("accumulate", 2)),
        gradient_clip_val=float(opts.get("clip", 0.5)) or None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=2,
        val_check_interval=10,
        num_sanity_val_steps=0,
        callbacks=[probe],
    )
    trainer.fit(model)
    if kind == "ddp":
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        weights = trainer.strategy.lightning_module_state_dict()
    result = {
        "losses": list(model.losses),
        "weights": weights,
        "grad_bytes": probe.grad_bytes,
        "state_bytes": probe.state_bytes,
    }
    gathered = [None] * int(os.environ["WORLD_SIZE"])
    torch.distributed.all_gather_object(gathered, {k: result[k] for k in ("losses", "grad_bytes", "state_bytes")})
    if trainer.global_rank == 0:
        result["per_rank"] = gathered
        torch.save(result, os.path.join(out, f"{name}.pt"))


def main() -> None:
    out = sys.argv[1]
    for item in sys.argv[2:]:
        name, _, spec = item.partition("=")
        run(name, spec, out)


if __name__ == "__main__":
    main()
