"""What an async sharded save costs its caller, one process: the example GPT under ZeroStrategy(stage=3,
checkpoint_async=True) trains 2 steps, then saves ``--saves`` times from inside ``on_train_end``, each save
waited for before the next; printed: the caller's time per save and the staging part of it (async_stage.py),
and the writer thread's CPU time per save (``time.thread_time``: Python and C work that, in Python, mostly
holds the GIL the training loop needs while an async save is written). The host-side cost of a save (the
entries, the name maps, the meta file, DCP's planning), not the device's.

    PYTHONPATH=. python benchmarks/save_blocking.py --layers 32 --d-model 128 [--device cuda]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_zero
from examples.gpt import GPT, GPTConfig


class _Module(pl.LightningModule):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.model = GPT(cfg)
        self.cfg = cfg

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        out = self.model(batch[0])
        return (out[0] if isinstance(out, tuple) else out).float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        ids = torch.randint(0, self.cfg.vocab_size, (16, self.cfg.seq_len))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=4)


class _Saves(pl.Callback):
    def __init__(self, saves: int) -> None:
        self.saves = saves

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        stager = trainer.strategy.checkpointer._stager  # type: ignore[attr-defined]
        stage, staging = stager.stage, []

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = stage(*args, **kwargs)
            staging.append(time.perf_counter() - t)
            return out

        stager.stage = timed
        ckpt = trainer.strategy.checkpointer  # type: ignore[attr-defined]
        write, writer_cpu = ckpt._write_staged, []

        def counted(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return write(*args, **kwargs)
            finally:
                writer_cpu.append(time.thread_time() - t)

        ckpt._write_staged = counted
        blocked = []
        with tempfile.TemporaryDirectory() as d:
            for i in range(self.saves):
                t = time.perf_counter()
                trainer.save_checkpoint(f"{d}/save{i}")
                blocked.append(time.perf_counter() - t)
                trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        print("caller blocked ms:", [round(x * 1e3, 1) for x in blocked])
        print("of which staging ms:", [round(x * 1e3, 1) for x in staging])
        print(f"median after the first: {sorted(blocked[1:])[len(blocked[1:]) // 2] * 1e3:.1f} ms")
        print("writer thread CPU ms:", [round(x * 1e3, 1) for x in writer_cpu],
              f"median after the first: {sorted(writer_cpu[1:])[len(writer_cpu[1:]) // 2] * 1e3:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--saves", type=int, default=6)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    if args.saves < 2:
        p.error("--saves must be >= 2 (the first pays one-time costs)")
    cfg = GPTConfig(n_layer=args.layers, d_model=args.d_model, n_head=4, seq_len=64, vocab_size=512)
    trainer = pl.Trainer(accelerator=args.device, devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[_Saves(args.saves)],
                         strategy=lightning_zero.ZeroStrategy(stage=3, checkpoint_async=True))
    trainer.fit(_Module(cfg))


if __name__ == "__main__":
    main()
