"""One Fabric configuration of ``benchmarks/fabric.py`` in its own process (or torchrun group): the
example GPT trained by a hand-written Fabric loop, timed as ``peers_worker.py`` times the Trainer.

Configurations: ``fabric_zero2``, ``fabric_zero3`` (``Fabric(strategy="zero2"|"zero3")``),
``fabric_fsdp`` (Fabric's FSDPStrategy in its documented best setup: FULL_SHARD, one unit per
transformer block, built on the meta device) and ``fabric_deepspeed_stage_3`` (Fabric's
DeepSpeedStrategy(stage=3), the network built under ``deepspeed.zero.Init``). Every one trains the
same GPTModule (its ``training_step``, its param groups, torch AdamW(fused=True) and its LR schedule)
in ``bf16-mixed``; the step is timing.py's [Note: what a step is], timed by the same StepTimer
driven from the loop; each rank appends peers_worker's record to ``--results-file``.

    python benchmarks/fabric_worker.py --config fabric_zero3 --model gpt_tiny --device cpu --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
from benchmarks import peers_worker as pw, records, timing  # noqa: E402
import torch  # noqa: E402


def _zero(stage: int) -> Callable[[argparse.Namespace], Any]:
    def build(args: argparse.Namespace) -> Any:
        importlib.import_module("lightning_zero")  # registers the names with Fabric
        return f"zero{stage}"

    return build


def _fsdp(args: argparse.Namespace) -> Any:
    from examples.gpt import Block
    from lightning.fabric.strategies import FSDPStrategy

    return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})


def _deepspeed_stage_3(args: argparse.Namespace) -> Any:
    importlib.import_module("deepspeed")  # fail here, with DeepSpeed's own message, if it cannot be imported
    from lightning.fabric.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=3, logging_batch_size_per_gpu=args.micro_batch)


CONFIGS: dict[str, pw.PeerConfig] = {
    c.name: c
    for c in (
        pw.PeerConfig("fabric_zero2", _zero(2)),
        pw.PeerConfig("fabric_zero3", _zero(3), build_in="configure_model"),
        pw.PeerConfig("fabric_fsdp", _fsdp, empty_init_on_cuda=True),
        pw.PeerConfig("fabric_deepspeed_stage_3", _deepspeed_stage_3, build_in="configure_model"),
    )
}
"""As peers_worker.CONFIGS; ``build_in='configure_model'`` means ``fabric.init_module(empty_init=True)``
(sharded initialisation: ZeRO-3 on the meta device, DeepSpeed's zero.Init)."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    args = pw.gpt_worker_parser(__doc__, CONFIGS).parse_args(argv)
    args.profile = False
    return args


def build_module(spec: pw.PeerConfig, args: argparse.Namespace, fabric: Any, cfg: Any) -> Any:
    """The GPTModule, built where each strategy documents it for a large model."""
    from examples.gpt import GPTModule

    kwargs = {"fused": None if args.no_fused else True, "max_steps": args.warmup + args.steps, "pipeline": False}
    if spec.build_in == "configure_model":
        empty_init: Optional[bool] = True
    else:
        empty_init = spec.empty_init_on_cuda if args.device == "cuda" else None
    with fabric.init_module(empty_init=empty_init):
        module = GPTModule(cfg, **kwargs)
        module.configure_model()
    return module


def _train(args: argparse.Namespace, spec: pw.PeerConfig, strategy: Any) -> None:
    from examples.data import TextDataModule
    from examples.gpt import GPTConfig
    from lightning.fabric import Fabric

    from benchmarks.presets import model_preset

    fabric = Fabric(accelerator="gpu" if args.device == "cuda" else "cpu", devices=args.devices, strategy=strategy,
                    precision=pw.PRECISION)
    fabric.launch()
    fabric.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    cfg = GPTConfig(**model_preset(args.model))
    module = build_module(spec, args, fabric, cfg)
    if spec.name == "fabric_fsdp":
        # FSDP's documented order after meta-device init: wrap (and materialise) the module first, then
        # build the optimizer on the sharded parameters (Fabric refuses an optimizer holding meta tensors).
        model = fabric.setup_module(module)
        opt_cfg = module.configure_optimizers()
        optimizer = fabric.setup_optimizers(opt_cfg["optimizer"])
    else:  # ZeRO and DeepSpeed take model and optimizer together (DeepSpeed's engine needs both at once)
        opt_cfg = module.configure_optimizers()
        model, optimizer = fabric.setup(module, opt_cfg["optimizer"])
    scheduler = opt_cfg["lr_scheduler"]["scheduler"]
    data = TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch)
    data.prepare_data()
    data.setup("fit")
    loader = fabric.setup_dataloaders(data.train_dataloader())
    timer = timing.StepTimer(args.warmup)  # driven from the loop: its hooks read only the batch and the loss
    timer._device = fabric.device
    total = args.warmup + args.steps
    batches = iter(loader)
    for i in range(total):
        batch = next(batches)
        timer.on_train_batch_start(None, None, batch, i)  # type: ignore[arg-type]
        loss = model.training_step(batch, i)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        timer.on_train_batch_end(None, None, loss, batch, i)  # type: ignore[arg-type]
    timer.on_train_end(None, None)  # type: ignore[arg-type]
    records.append_record(args.results_file, pw.rank_record(args, fabric, module, timer, pw.count_params(cfg)))
    records._shutdown_process_group()


def run(args: argparse.Namespace) -> int:
    spec = CONFIGS[args.config]
    return records.run_as_row(args, lambda: spec.build(args), lambda strategy: _train(args, spec, strategy))


def main(argv: Optional[list[str]] = None) -> int:
    return records.worker_main(argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
