"""A callback the example's tests add through ``+callbacks.probe._target_=tests.examples.probe.StepProbe``:
records each rank's per-step loss (flushed at once: the run may be SIGKILLed) and its parameter storage
right after setup, and optionally SIGKILLs its own process after a given optimizer step."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as L
import torch

from tests.helpers.memory import storage_bytes


def parameter_storage(trainer: L.Trainer, module: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds: the module's parameters (released ZeRO-3 ones count 0)
    and the engines' parameter partitions (the 16-bit shards, or the fp32 masters where those are the
    partition), each storage once."""
    tensors = list(module.parameters())
    for engine in getattr(trainer.strategy, "engines", []):
        for fg in engine.groups:
            shard16 = getattr(fg, "shard16", None)
            tensors.append(shard16 if shard16 is not None else fg.master)
    return storage_bytes(t for t in tensors if t is not None and not t.is_meta)


class StepProbe(L.Callback):
    def __init__(self, out: str, kill_at: Optional[int] = None) -> None:
        self.out = Path(out)
        self.kill_at = kill_at

    def _write(self, trainer: L.Trainer, record: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer, {"param_bytes": parameter_storage(trainer, pl_module),
                              "world": trainer.world_size})

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        """Once, at the second step (Adam's moments exist from the first on): the device model state
        (tests/offload/test_estimator_storage.py's count)."""
        if trainer.global_step != 1:
            return
        tensors = list(pl_module.parameters()) + [p.grad for p in pl_module.parameters() if p.grad is not None]
        for engine in getattr(trainer.strategy, "engines", []):
            for fg in engine.groups:
                tensors += [getattr(fg, n, None) for n in ("master", "shard16", "grad_shard", "flat_grad")]
        tensors += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        live = [t for t in tensors if t is not None and not t.is_meta]
        gathered = storage_bytes(p for p in pl_module.parameters() if not p.is_meta)
        self._write(trainer, {"state_bytes": storage_bytes(live), "param_bytes_at_step": gathered})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self._write(trainer, {"step": trainer.global_step, "loss": float(loss), "batch": int(batch[0][:, 0].sum())})
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
