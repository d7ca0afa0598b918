"""One configuration of ``benchmarks/compile.py`` in its own process (or torchrun group): the GPT,
eager or compiled, under one strategy; timed as ``peers_worker.py`` times its peers.

Configurations are ``<peer>`` (eager) and ``<peer>_compiled`` for peer in single, ddp, fsdp, zero3.
Compiled means the example's ``GPTConfig(compile=True)``: every transformer block ``.compile()``d
(torch's defaults: inductor, no CUDA graphs), the same code under every strategy (examples/gpt.py
``GPTModule.compile_network``). ``fsdp`` is Lightning's FSDPStrategy as its docs advise for compile:
FULL_SHARD, ``auto_wrap_policy={Block}``, ``use_orig_params=True`` (eager and compiled alike, so the
ratio is compile's own). Each rank appends one JSON line (peers_worker's record, plus what dynamo
counted: graph breaks, unique graphs) to ``--results-file``.

    python benchmarks/compile_worker.py --config zero3_compiled --model gpt_tiny --device cpu --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
from benchmarks import peers_worker as pw, records, timing  # noqa: E402
import torch  # noqa: E402

PEER_OF = {f"{p}{s}": p for p in ("single", "ddp", "fsdp", "zero3", "zero3_fp8", "zero3_fp8_rowwise", "zero3_fp8_head")
           for s in ("", "_compiled")}
"""Configuration -> the peers_worker configuration it builds on."""


def _fsdp_for_compile(args: argparse.Namespace) -> Any:
    from examples.gpt import Block
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}, use_orig_params=True)


def build_strategy(args: argparse.Namespace) -> Any:
    peer = PEER_OF[args.config]
    if peer == "fsdp":
        return _fsdp_for_compile(args)
    return pw.CONFIGS[peer].build(args)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = pw.gpt_worker_parser(__doc__, PEER_OF, steps=10, warmup=4)  # compilation happens in the warm-up
    args = p.parse_args(argv)
    args.profile = False
    return args


def run(args: argparse.Namespace) -> int:
    spec = pw.CONFIGS[PEER_OF[args.config]]
    if spec.single_device_only and args.devices != 1:
        row = {"kind": "error", "config": args.config, "rank": records._rank()}
        records.append_record(args.results_file, {**row, "status": "skipped", "reason": "single-device run (use 1 GPU)"})
        return 0
    return records.run_as_row(args, lambda: build_strategy(args), lambda strategy: _fit(args, spec, strategy))


def _fit(args: argparse.Namespace, spec: Any, strategy: Any) -> None:
    import lightning.pytorch as L
    from examples.data import TextDataModule
    from examples.gpt import GPTConfig
    from torch._dynamo.utils import counters

    from benchmarks.presets import model_preset

    L.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    compiled = args.config.endswith("_compiled")
    cfg = GPTConfig(**model_preset(args.model), compile=compiled)
    timer = timing.StepTimer(args.warmup)
    trainer = pw.build_trainer(args, strategy, timer)
    model = pw.build_module(spec, args, trainer, cfg)
    if compiled and getattr(model, "model", None) is None:  # built in configure_model (sharded init): compile after
        build = model.configure_model

        def configure_model() -> None:
            build()
            model.compile_network()

        model.configure_model = configure_model  # type: ignore[method-assign]
    data = TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch)
    trainer.fit(model, datamodule=data)
    if len(timer.step_times) < args.steps:
        raise RuntimeError(f"only {len(timer.step_times)} of {args.steps} timed steps ran (too little data?)")
    record = pw.rank_record(args, trainer, model, timer, pw.count_params(cfg))
    plan = getattr(trainer.strategy, "compile_plan", None)
    record.update(
        compiled=compiled,
        graph_breaks=sum(counters["graph_break"].values()),
        unique_graphs=counters["stats"]["unique_graphs"],
        compiled_blocks=sum(1 for m in model.modules() if type(m).__name__ == "Block" and m._compiled_call_impl is not None),
        compile_plan=None if plan is None else {"compiled": len(plan.compiled), "made_eager": plan.made_eager,
                                                "already_compiled": len(plan.already_compiled)},
    )
    records.append_record(args.results_file, record)
    records._shutdown_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    return records.worker_main(argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
