"""``python examples/train.py strategy=zero2 strategy.tensor_parallel=2`` as a user runs it (issue #17 item 2).

2 CPU processes = dp 1 x tp 2: the example GPT's MLPs split with the ready plan in
``GPTModule.configure_model``, 3 steps and a validation, then the end-of-training sharded checkpoint,
which consolidates to the full model and loads back with ``load_from_checkpoint`` (no process group).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_zero.checkpoint import describe, load_consolidated
from tests.integration.test_hydra_config import _run_train


def test_example_trains_with_tensor_parallel_and_checkpoints(tmp_path: Path) -> None:
    from gpt import GPTModule

    proc = _run_train(tmp_path, "strategy=zero2", "strategy.tensor_parallel=2", "model=gpt_tiny", "trainer=debug",
                      "data.batch_size=4", "trainer.max_steps=3", "trainer.val_check_interval=3", "logger=none")
    out = proc.stdout + proc.stderr
    assert "Starting with 2 processes" in out and "fit finished" in out
    assert "trained 3 steps" in (tmp_path / "train.log").read_text()
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert "tensor parallel 2" in describe(ckpt)
    sd = load_consolidated(ckpt)["state_dict"]
    d = 64  # conf/model/gpt_tiny.yaml
    assert sd["model.blocks.0.mlp.fc.weight"].shape == (4 * d, d)  # full, not the TP shard
    assert sd["model.blocks.1.mlp.proj.weight"].shape == (d, 4 * d)
    module = GPTModule.load_from_checkpoint(ckpt).eval()
    with torch.no_grad():
        logits = module(torch.zeros((1, 8), dtype=torch.long))
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
