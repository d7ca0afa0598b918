"""Quick GPU correctness smoke for every ZeRO stage (one process, one GPU): a small GPT trains a few
steps in bf16 and fp16 and the losses must be finite and falling. Run before the long benchmarks so a
CUDA-only bug costs seconds, not a benchmark slot. Usage: python benchmarks/gpu_smoke.py"""

from __future__ import annotations

import math
import time

import torch

import lightning.pytorch as L  # noqa: E402

import lightning_zero  # noqa: E402
from examples.gpt import GPTConfig, GPTModule  # noqa: E402


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.t0 = 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def run(stage: int, precision: str) -> str:
    L.seed_everything(0)
    cfg = GPTConfig(vocab_size=256, n_layer=4, n_head=8, d_model=512, seq_len=256, activation_checkpointing=stage == 3)
    model = GPTModule(model=cfg, max_steps=30, lr=1e-3, warmup_steps=5)
    data = torch.utils.data.TensorDataset(torch.randint(0, 256, (64 * 16, 257)))
    loader = torch.utils.data.DataLoader([(r[:-1], r[1:]) for (r,) in data], batch_size=16)
    cb = Losses()
    plugin = lightning_zero.ZeroPrecision(precision) if precision == "16-mixed" else None
    strategy = lightning_zero.ZeroStrategy(stage=stage, param_persistence_threshold=0, precision_plugin=plugin)
    kw = {} if plugin else {"precision": precision}
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=30, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb], **kw)
    t0 = time.time()
    trainer.fit(model, loader)
    first, last = sum(cb.losses[:5]) / 5, sum(cb.losses[-5:]) / 5
    ok = all(math.isfinite(x) for x in cb.losses) and last < first
    return f"| zero{stage} | {precision} | {first:.3f} | {last:.3f} | {time.time() - t0:.1f} s | {'ok' if ok else 'FAIL'} |"


if __name__ == "__main__":
    rows = ["| stage | precision | loss first 5 | loss last 5 | wall | verdict |", "|---|---|---|---|---|---|"]
    for stage in (0, 1, 2, 3):
        for precision in ("bf16-mixed", "16-mixed"):
            try:
                rows.append(run(stage, precision))
            except Exception as exc:  # keep going: the table says what broke
                rows.append(f"| zero{stage} | {precision} | - | - | - | ERROR {type(exc).__name__}: {str(exc)[:150]} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))
