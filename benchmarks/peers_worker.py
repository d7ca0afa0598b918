"""One benchmark configuration, in its own process (or torchrun group): build, train N steps, time them.

Started by ``benchmarks/peers.py``, one process tree per configuration, so that CUDA memory, the
caching allocator, NCCL communicators and DeepSpeed's JIT state never leak from one peer into the
next one's numbers. Each rank appends exactly one JSON line to ``--results-file``:

* ``{"kind": "rank", ...}``: the timed steps, peak memory and versions of that rank; with
  ``--profile``, also ``exposed_comm`` and ``comm_total`` (fractions of the wall time of
  ``--profile-steps`` steps profiled after the timed ones, None where there are no CUDA kernels) and
  their details in ``comm_profile`` (see comm_profile.py's :class:`CommProfiler`);
* ``{"kind": "error", "status": "skipped" | "failed", "reason": ...}``: when the strategy cannot be
  built (e.g. ``ZeroStrategy(stage=3)`` not implemented yet, DeepSpeed not installed) or training
  raised (e.g. CUDA OOM). The parent turns these into table rows; a failing configuration never
  aborts the whole benchmark (records.py's :func:`run_as_row`).

This file holds what is particular to the GPT peers: how each strategy is built (:data:`CONFIGS`), where
the network is constructed (:func:`build_module`), the Trainer that only trains, and the rank record;
the step timer (timing.py), the profiler (comm_profile.py) and the record protocol (records.py) are
shared with the other workers, which import them from there.

Run by hand only for debugging, e.g.::

    python benchmarks/peers_worker.py --config zero2 --model gpt_tiny --device cpu --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import lightning.pytorch as L
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from benchmarks.comm_profile import CommProfiler
from benchmarks.presets import PEERS, model_preset
from benchmarks.records import (
    _rank, _shutdown_process_group, append_record, device_info, run_as_row, versions, worker_main,
)
from benchmarks.timing import StepTimer

PRECISION = "bf16-mixed"
"""Every configuration trains in bf16 mixed precision (each strategy's own meaning of it)."""


# ---------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class PeerConfig:
    """How to build one benchmarked strategy, and how to construct the model under it."""

    name: str
    """Row label in the table; also the ``--configs`` name."""
    build: Callable[[argparse.Namespace], Union[str, Strategy]]
    """Worker arguments -> the ``Trainer(strategy=...)`` argument. May raise NotImplementedError/ValueError,
    which marks the configuration 'skipped' (not 'failed')."""
    build_in: str = "init_module"
    """Where the network is constructed, each peer's documented path for a large model:
    'init_module': in ``GPTModule.__init__`` under ``trainer.init_module(empty_init=...)`` (straight on
    the device for single/ddp/zero0-2; on the meta device for FSDP, see ``empty_init_on_cuda``);
    'configure_model': in ``LightningModule.configure_model``, inside the strategy's
    ``model_sharded_context`` (DeepSpeed stage 3: ``deepspeed.zero.Init``; lightning_zero stage 3:
    sharded initialisation), so no rank ever holds the whole model."""
    empty_init_on_cuda: Optional[bool] = None
    """``trainer.init_module(empty_init=...)`` on CUDA when ``build_in == 'init_module'``. None lets the
    strategy decide; True builds on the meta device (FSDP then materialises and initialises block by
    block on the GPU as it wraps: Lightning's recommended path, and far faster than a 1.3B CPU init)."""
    single_device_only: bool = False
    """Plain Lightning 'auto' is a single-device run: refuse it in a multi-process launch."""


def _single(args: argparse.Namespace) -> str:
    return "auto"


def _ddp(args: argparse.Namespace) -> str:
    return "ddp"


def _fsdp(args: argparse.Namespace) -> Strategy:
    """Lightning's FSDP, FULL_SHARD, one FSDP unit per transformer block (Lightning's recommended setup)."""
    from examples.gpt import Block
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block})


def _deepspeed(stage: int) -> Callable[[argparse.Namespace], Strategy]:
    """Lightning's ``deepspeed_stage_N`` preset. It keeps our torch AdamW(fused=True) as DeepSpeed's
    client optimizer (``zero_allow_untested_optimizer`` is on by default), so no op needs a JIT build.
    The logging batch size is given, not inferred from a dataloader Lightning would build early."""

    def build(args: argparse.Namespace) -> Strategy:
        import deepspeed  # noqa: F401  (fail here, with DeepSpeed's own message, if it cannot be imported)
        from lightning.pytorch.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=stage, logging_batch_size_per_gpu=args.micro_batch)

    return build


def _zero(stage: int, **options: Any) -> Callable[[argparse.Namespace], Strategy]:
    def build(args: argparse.Namespace) -> Strategy:
        from lightning_zero import ZeroStrategy

        return ZeroStrategy(stage=stage, **options)

    return build


CONFIGS: dict[str, PeerConfig] = {
    c.name: c
    for c in (
        PeerConfig("single", _single, single_device_only=True),
        PeerConfig("ddp", _ddp),
        PeerConfig("fsdp", _fsdp, empty_init_on_cuda=True),
        PeerConfig("deepspeed_stage_2", _deepspeed(2)),
        PeerConfig("deepspeed_stage_3", _deepspeed(3), build_in="configure_model"),
        PeerConfig("zero0", _zero(0)),
        PeerConfig("zero1", _zero(1)),
        PeerConfig("zero2", _zero(2)),
        PeerConfig("zero3", _zero(3), build_in="configure_model"),
        PeerConfig("zero2_bf16sr", _zero(2, state_precision="bf16_sr")),
        PeerConfig("zero3_bf16sr", _zero(3, state_precision="bf16_sr"), build_in="configure_model"),
        PeerConfig("zero3_bf16sr_g16", _zero(3, state_precision="bf16_sr", grad_shard_precision="bf16"),
                   build_in="configure_model"),
        PeerConfig("zero3_bf16kahan", _zero(3, state_precision="bf16_kahan"), build_in="configure_model"),
        PeerConfig("zero3_fp8", _zero(3, fp8="tensorwise"), build_in="configure_model"),
        PeerConfig("zero3_fp8_rowwise", _zero(3, fp8="rowwise"), build_in="configure_model"),
        # every Linear in fp8, the 128K-vocab head included (torchtitan keeps its output layer in bf16)
        PeerConfig("zero3_fp8_head", _zero(3, fp8="tensorwise", fp8_keep_first_last=False), build_in="configure_model"),
        # ddp's bf16-mixed layout (fp32 weights, torch.autocast) instead of DeepSpeed's 16-bit module
        PeerConfig("zero2_autocast", _zero(2, mixed_precision="autocast")),
        PeerConfig("zero3_autocast", _zero(3, mixed_precision="autocast"), build_in="configure_model"),
    )
}
"""How each configuration named in ``presets.PEERS`` is built (the default lists live there too)."""
assert set(CONFIGS) == set(PEERS), "presets.PEERS and peers_worker.CONFIGS must name the same configurations"


# ---------------------------------------------------------------------------------------------------- run


def count_params(cfg: Any) -> int:
    """Parameters of the network, counted on the meta device (exact, free, and independent of how a
    strategy has sharded or flattened the real ones)."""
    from examples.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def build_module(spec: PeerConfig, args: argparse.Namespace, trainer: Trainer, cfg: Any) -> LightningModule:
    """The GPTModule, constructed where ``spec.build_in`` says (see :class:`PeerConfig`)."""
    from examples.gpt import GPT, GPTModule

    # The LR horizon is the warm-up + timed steps with or without --profile (profiled steps after it run
    # at the final LR), so a profiling run's timed steps are those of a plain run. Every configuration
    # trains the plain GPT nn.Module (pipeline=False, the example's default too; pipeline=True wraps the
    # same layers in a PipelineModule), so all peers run one network with the same parameter names and
    # ZeRO-3 units.
    kwargs = {"fused": None if args.no_fused else True, "max_steps": args.warmup + args.steps, "pipeline": False}
    if spec.build_in == "init_module":
        empty_init = spec.empty_init_on_cuda if args.device == "cuda" else None
        with trainer.init_module(empty_init=empty_init):
            return GPTModule(cfg, **kwargs)

    class DeferredGPTModule(GPTModule):
        """GPTModule whose network is built in ``configure_model`` (sharded initialisation)."""

        @override
        def _build_model(self) -> Any:
            return None  # __init__ builds nothing; configure_model does

        @override
        def configure_model(self) -> None:
            super().configure_model()  # a GPTModule that builds there itself keeps doing so
            if getattr(self, "model", None) is None:
                self.model = GPT(self.config)

    return DeferredGPTModule(cfg, **kwargs)


def gpt_worker_parser(doc: Optional[str], configs: Iterable[str], steps: int = 15, warmup: int = 5) -> argparse.ArgumentParser:
    """The arguments every GPT benchmark worker takes (this one, compile_worker.py, fabric_worker.py)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=sorted(configs))
    p.add_argument("--model", default="gpt_1b", help="conf/model preset name or a YAML path")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=steps, help="timed steps")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps before them")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=1, help="processes (GPUs) in this run")
    p.add_argument("--no-fused", action="store_true", help="torch AdamW without fused=True")
    p.add_argument("--results-file", type=Path, required=True)
    return p


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = gpt_worker_parser(__doc__, CONFIGS)
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile --profile-steps more and record the exposed communication")
    p.add_argument("--profile-steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.profile and args.profile_steps < 1:
        p.error("--profile-steps must be >= 1")
    return args


def build_trainer(
    args: argparse.Namespace, strategy: Union[str, Strategy], timer: StepTimer, profiler: Optional[CommProfiler] = None
) -> Trainer:
    """A Trainer that does nothing but train: no validation, checkpoints, logger, progress bar or summary.
    With a profiler, it runs the profiled steps after the timed ones (the timer ignores them)."""
    return L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.devices,
        num_nodes=1,
        strategy=strategy,
        precision=PRECISION,
        max_steps=args.warmup + args.steps + (profiler.steps if profiler is not None else 0),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=None,
        callbacks=[timer] if profiler is None else [timer, profiler],  # the timer synchronises first
    )


def rank_record(
    args: argparse.Namespace, trainer: Trainer, model: Any, timer: StepTimer, n_params: int,
    profiler: Optional[CommProfiler] = None,
) -> dict:
    """What the parent needs from one rank to build its row (with ``--profile``: ``exposed_comm`` and
    ``comm_total``, fractions of the profiled wall time or None, and the details in ``comm_profile``)."""
    name, peak = device_info(trainer.strategy.root_device)
    peak_mem = timer.peak_allocated
    if args.device != "cuda":
        from lightning_zero.logging.metrics import peak_host_rss_bytes

        peak_mem = peak_host_rss_bytes() or 0
    record = {
        "kind": "rank",
        "config": args.config,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device_type": args.device,
        "device_name": name,
        "peak_flops": peak,
        "step_times_s": timer.step_times,
        "inner_times_s": timer.inner_times,
        "tokens_per_step_local": timer.tokens_per_step,
        "peak_mem_bytes": peak_mem,
        "peak_reserved_bytes": timer.peak_reserved,
        "final_loss": float(timer.last_loss) if timer.last_loss is not None else None,
        "fused": not args.no_fused,
        "flops_per_token": float(model.flops_per_token),
        "n_params": n_params,
        "versions": versions(),
        "micro_batch": args.micro_batch,
        "strategy_class": type(trainer.strategy).__name__,
    }
    if profiler is not None:
        record.update(exposed_comm=profiler.exposed_comm, comm_total=profiler.comm_total, comm_profile=profiler.result)
    return record


def run(args: argparse.Namespace) -> int:
    spec = CONFIGS[args.config]
    if spec.single_device_only and args.devices != 1:
        row = {"kind": "error", "config": args.config, "rank": _rank()}
        append_record(args.results_file, {**row, "status": "skipped", "reason": "single-device run (use 1 GPU)"})
        return 0
    return run_as_row(args, lambda: spec.build(args), lambda strategy: _fit(args, spec, strategy))


def _fit(args: argparse.Namespace, spec: PeerConfig, strategy: Any) -> None:
    from examples.data import TextDataModule
    from examples.gpt import GPTConfig

    L.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    cfg = GPTConfig(**model_preset(args.model))
    profiler = CommProfiler(args.warmup + args.steps, args.profile_steps) if args.profile else None
    timer = StepTimer(args.warmup, timed=args.steps if profiler is not None else None)
    trainer = build_trainer(args, strategy, timer, profiler)
    model = build_module(spec, args, trainer, cfg)
    data = TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch)
    trainer.fit(model, datamodule=data)
    if len(timer.step_times) < args.steps:
        raise RuntimeError(f"only {len(timer.step_times)} of {args.steps} timed steps ran (too little data?)")
    append_record(args.results_file, rank_record(args, trainer, model, timer, count_params(cfg), profiler))
    _shutdown_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    return worker_main(argv, parse_args, run)


__all__ = ["CONFIGS", "CommProfiler", "PeerConfig", "StepTimer", "append_record", "run", "run_as_row", "worker_main", "main"]


if __name__ == "__main__":
    sys.exit(main())
