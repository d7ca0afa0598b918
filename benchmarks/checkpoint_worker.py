"""One configuration of the checkpoint benchmark, in its own process (or torchrun group).

Started by ``benchmarks/checkpoint.py``, one process tree per configuration (see peers_worker.py for
why). Builds the GPT exactly as ``peers_worker.py`` does for the peer the configuration is a variant
of (:func:`peers_worker.build_module`), trains ``--steps`` steps with ``trainer.fit`` (so AdamW's state
exists), then, from a callback at the end of training (the strategy still fully set up, the trainer
still fitting), measures (see [Note: what is measured]):

* save: ``trainer.save_checkpoint(path)`` ``--saves`` times (the second one is reported: the first may
  include warm-up; it is skipped when the time left would not cover it), each followed by a flush pass
  (fsync of every file), the bytes on disk, and the checkpoint's deletion;
* load, once, after the first save: ``ckpt = strategy.load_checkpoint(path)``;
  ``strategy.load_model_state_dict(ckpt)``; ``strategy.load_optimizer_state_dict(ckpt)``.

Each rank appends JSON lines to ``--results-file`` as it goes (a timeout keeps what was measured):
``{"kind": "setup"}`` (the configuration as it ran), one ``{"kind": "save"}`` per save, ``{"kind":
"load"}``, ``{"kind": "done"}``; or ``{"kind": "error", "status": "skipped" | "failed", "reason": ...}``.

[Note: what is measured]
Every timed region starts after ``strategy.barrier()`` and ``torch.cuda.synchronize()``, on every rank
at once. *save* is the host's wall time until ``trainer.save_checkpoint`` returns (Lightning's own
barrier included; no device synchronisation: what the training loop waits for); *complete* adds ``strategy.wait_for_checkpoint()`` for an
asynchronous save, a synchronisation and a barrier (for a synchronous save it is *save* plus one
barrier). Both are the maximum over ranks. *flush*: afterwards, rank 0 ``fsync``s every file of the
checkpoint (zero when the writer synced them itself; DeepSpeed's ``torch.save`` does not), so *complete
+ flush* is the time until the checkpoint is durable. *Peak extra device memory* is
``torch.cuda.max_memory_allocated()`` after the region (peak statistics reset just before it) minus
``torch.cuda.memory_allocated()`` before it; the host's is the peak resident set (``VmHWM``, reset
through ``/proc/self/clear_refs``) minus the resident set before. *Bytes on disk*: apparent sizes of
every file of the checkpoint directory, attributed to a rank by file name (``__<r>_<i>.distcp``,
``*_rank_<r>_*``) and ``du``'s allocated bytes.

*load* is the same kind of region around the three calls Lightning's restore makes
(``_checkpoint_connector.resume_start`` / ``restore_model`` / ``restore_optimizers``). Lightning's
FSDP and DeepSpeed strategies load the weights *and* the optimizer state inside ``load_checkpoint``
while fitting (their ``load_model_state_dict``/``load_optimizer_state_dict`` do nothing), so the same
three calls mean "everything needed to resume loaded" for every configuration. Before the load, rank
0 evicts the checkpoint's files from the page cache (``posix_fadvise(DONTNEED)`` after the flush;
``--warm-load`` skips it), so the load reads the disk as a resumed job would. To show the load did
restore the state: after the save, every floating tensor of the (innermost) torch optimizer's state,
keys included (the fp32 weights it steps: FSDP's flat shards, DeepSpeed's fp32 partitions,
lightning_zero's masters), is halved in place; after the load, the sum of their squares must equal
the one taken before the save (``verified``).

Run by hand only for debugging, e.g.::

    python benchmarks/checkpoint_worker.py --config zero3 --model tiny --device cpu --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

START = time.monotonic()
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import Strategy  # noqa: E402
from typing_extensions import override  # noqa: E402

from benchmarks.lora_worker import _compact, _describe_deepspeed, _describe_fsdp  # noqa: E402
from benchmarks.peers_worker import (  # noqa: E402
    CONFIGS as PEER_CONFIGS, PRECISION, PeerConfig, build_module, count_params,
)
from benchmarks.records import (  # noqa: E402
    _rank, _shutdown_process_group, append_record, device_info, run_as_row, short_reason, versions, worker_main,
)
from benchmarks.presets import model_preset  # noqa: E402
from benchmarks.checkpoint_held import HeldBySave  # noqa: E402

MIB = 2**20
RANK_IN_NAME = (re.compile(r"^__(\d+)_\d+\.distcp$"), re.compile(r"_rank_(\d+)_"), re.compile(r"rank[_-]?(\d+)"))
"""File name -> writing rank: torch.distributed.checkpoint's ``__<rank>_<i>.distcp`` (FSDP, lightning_zero),
DeepSpeed's ``*zero_pp_rank_<r>_mp_rank_00_*``, anything else naming a rank."""


# ---------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class CkptConfig:
    """One benchmarked strategy: how it is built and described, and which peer's model building it reuses."""

    name: str
    peer: str
    """The ``peers_worker.CONFIGS`` entry whose model building this reuses (where the network is built)."""
    build: Callable[[argparse.Namespace], Strategy]
    """Worker arguments -> strategy. NotImplementedError/ValueError/TypeError: skipped (an API not there yet)."""
    describe: Callable[[Any], str]
    """The strategy as it ran -> its configuration for the table (read back from the object)."""
    is_async: bool = False
    """Whether the save returns before the checkpoint is complete (``strategy.wait_for_checkpoint()``)."""


def _zero3(is_async: bool, fsync: bool = True) -> Callable[[argparse.Namespace], Strategy]:
    def build(args: argparse.Namespace) -> Strategy:
        from lightning_zero import ZeroStrategy

        strategy = ZeroStrategy(stage=3, checkpoint_format="sharded", checkpoint_async=is_async, checkpoint_fsync=fsync)
        if is_async and not callable(getattr(strategy, "wait_for_checkpoint", None)):
            raise NotImplementedError("ZeroStrategy has no wait_for_checkpoint() yet")
        return strategy

    return build


def _describe_zero(strategy: Any) -> str:
    cfg = getattr(strategy, "config", None)
    fields = ("checkpoint_format", "checkpoint_async", "checkpoint_threads", "checkpoint_fsync", "bucket_size_mb",
              "unit_policy")
    shown = ", ".join(f"{f}={_compact(getattr(cfg, f))}" for f in fields if hasattr(cfg, f))
    return f"ZeroStrategy(stage=3, {shown}): units = repeated blocks (GPT Block)"


def _fsdp_class(device: str) -> type:
    """Lightning's FSDPStrategy; on CPU (smoke runs, to exercise this worker's FSDP path) a subclass that
    gets past the two GPU checks: the Trainer's (it refuses ``type(s) is FSDPStrategy`` without a GPU)
    and FSDP's own (it needs ``device_id=torch.device("cpu")`` to accept CPU modules)."""
    from lightning.pytorch.strategies import FSDPStrategy

    if device == "cuda":
        return FSDPStrategy

    class CpuSmokeFSDPStrategy(FSDPStrategy):
        @override
        def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
            from torch.distributed.fsdp import FullyShardedDataParallel

            return FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self.kwargs,
            )

    return CpuSmokeFSDPStrategy


def _fsdp(args: argparse.Namespace) -> Strategy:
    """Lightning's FSDP as peers_worker runs it (FULL_SHARD, one unit per GPT ``Block``), with the
    checkpoint setting Lightning's FSDP guide advises for large models: ``state_dict_type="sharded"``
    (each rank writes its own shards through torch.distributed.checkpoint; the default "full" gathers
    the whole model on rank 0)."""
    from examples.gpt import Block

    return _fsdp_class(args.device)(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block}, state_dict_type="sharded")


def _describe_fsdp_ckpt(strategy: Any) -> str:
    return (f"{_describe_fsdp(strategy)}; state_dict_type={getattr(strategy, '_state_dict_type', '?')} "
            "(torch.distributed.checkpoint FileSystemWriter, fsync on)")


def _deepspeed(args: argparse.Namespace) -> Strategy:
    """Lightning's ``deepspeed_stage_3`` preset, as peers_worker builds it; its own checkpoint directory."""
    return PEER_CONFIGS["deepspeed_stage_3"].build(args)  # type: ignore[return-value]


def _describe_deepspeed_ckpt(strategy: Any) -> str:
    return (f"{_describe_deepspeed(strategy)}; checkpoint: engine.save_checkpoint(tag='checkpoint'), torch.save of "
            "each rank's model and optimizer partitions (no fsync)")


CONFIGS: dict[str, CkptConfig] = {
    c.name: c
    for c in (
        CkptConfig("zero3", "zero3", _zero3(False), _describe_zero),
        CkptConfig("zero3_async", "zero3", _zero3(True), _describe_zero, is_async=True),
        CkptConfig("zero3_nofsync", "zero3", _zero3(False, fsync=False), _describe_zero),
        CkptConfig("fsdp", "fsdp", _fsdp, _describe_fsdp_ckpt),
        CkptConfig("deepspeed_stage_3", "deepspeed_stage_3", _deepspeed, _describe_deepspeed_ckpt),
    )
}
"""The configurations, in the default order (``checkpoint.py`` lists the same names)."""


def peer_spec(spec: CkptConfig) -> PeerConfig:
    """peers_worker's entry for the model building, renamed (its ``build`` is not used)."""
    return dataclasses.replace(PEER_CONFIGS[spec.peer], name=spec.name)


# ---------------------------------------------------------------------------------------------------- memory and disk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _status_kib(field: str) -> Optional[int]:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM), or None."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_host_peak() -> bool:
    """Reset this process's peak resident set (VmHWM) to the current one; False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Region:
    """A timed region on every rank: barrier + sync, reset peak statistics, run, sync, read them."""

    def __init__(self, strategy: Strategy, name: str) -> None:
        self.strategy = strategy
        self.device = strategy.root_device
        self.name = name
        self.before = 0
        self.host_before: Optional[int] = None
        self.host_peak_ok = False
        self.t0 = 0.0

    def start(self) -> None:
        gc.collect()
        _sync(self.device)
        self.strategy.barrier(f"ckpt_bench.{self.name}.start")
        if self.device.type == "cuda":
            self.before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.host_peak_ok = _reset_host_peak()
        self.host_before = _status_kib("VmRSS")
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since start on the host, without a device synchronisation (this rank only)."""
        return time.perf_counter() - self.t0

    def lap(self) -> float:
        """Seconds since start, the device synchronised (this rank only)."""
        _sync(self.device)
        return time.perf_counter() - self.t0

    def end(self) -> dict[str, Any]:
        """Barrier, then every figure of the region (this rank's)."""
        local = self.lap()
        self.strategy.barrier(f"ckpt_bench.{self.name}.end")
        out: dict[str, Any] = {"local_s": local, "complete_s": time.perf_counter() - self.t0}
        if self.device.type == "cuda":
            out["peak_extra_bytes"] = torch.cuda.max_memory_allocated(self.device) - self.before
            out["allocated_before_bytes"] = self.before
        hwm = _status_kib("VmHWM")
        if self.host_peak_ok and hwm is not None and self.host_before is not None:
            out["host_peak_extra_bytes"] = hwm - self.host_before
        return out


def _files(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
    elif path.is_dir():
        for root, _, names in os.walk(path):
            for name in sorted(names):
                yield Path(root) / name


def _rank_of(name: str) -> Optional[int]:
    for pattern in RANK_IN_NAME:
        m = pattern.search(name)
        if m:
            return int(m.group(1))
    return None


def disk_usage(path: Path) -> dict[str, Any]:
    """Apparent bytes in total, per writing rank (by file name) and unattributed, ``du``'s allocated bytes."""
    by_rank: dict[str, int] = {}
    shared = total = allocated = n = 0
    for f in _files(path):
        st = f.stat()
        n += 1
        total += st.st_size
        allocated += st.st_blocks * 512
        rank = _rank_of(f.name)
        if rank is None:
            shared += st.st_size
        else:
            by_rank[str(rank)] = by_rank.get(str(rank), 0) + st.st_size
    return {"layout": "directory" if path.is_dir() else "file" if path.is_file() else "missing", "files": n,
            "bytes": total, "du_bytes": allocated, "bytes_by_rank": by_rank, "shared_bytes": shared}


def flush(path: Path, evict: bool) -> float:
    """fsync every file of the checkpoint (and with ``evict`` drop it from the page cache); seconds taken."""
    t0 = time.perf_counter()
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if evict and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------- optimizer check


def _torch_optimizers(trainer: Trainer) -> list[torch.optim.Optimizer]:
    """The innermost torch optimizers (LightningOptimizer and DeepSpeed's ZeRO wrapper unwrapped)."""
    out = []
    for opt in trainer.optimizers:
        opt = getattr(opt, "_optimizer", opt)
        inner = getattr(opt, "optimizer", None)
        while isinstance(inner, torch.optim.Optimizer) and inner is not opt:
            opt, inner = inner, getattr(inner, "optimizer", None)
        out.append(opt)
    return out


def _state_tensors(trainer: Trainer) -> Iterator[torch.Tensor]:
    """Floating tensors of every optimizer's state and its keys (the fp32 weights it steps), with storage."""
    for opt in _torch_optimizers(trainer):
        for key, state in opt.state.items():
            for t in [key, *state.values()] if isinstance(state, dict) else [key]:
                if (isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_meta
                        and t.untyped_storage().nbytes() > 0):
                    yield t


@torch.no_grad()
def state_checksum(trainer: Trainer, chunk: int = 2**24) -> tuple[float, int]:
    """(sum of squares in float64, number of tensors) over :func:`_state_tensors`; in chunks, so no
    float64 copy of a whole flat master is ever allocated."""
    total, n = 0.0, 0
    for t in _state_tensors(trainer):
        acc = torch.zeros((), dtype=torch.float64, device=t.device)
        for c in t.detach().reshape(-1).split(chunk):
            acc += c.double().square().sum()
        total += float(acc)
        n += 1
    return total, n


@torch.no_grad()
def perturb_state(trainer: Trainer) -> None:
    """Halve every tensor of :func:`_state_tensors` in place (a load must undo it)."""
    for t in _state_tensors(trainer):
        t.mul_(0.5)


# ---------------------------------------------------------------------------------------------------- the measurement


class CheckpointBench(Callback):
    """Saves, loads and measures at the end of training (see [Note: what is measured])."""

    def __init__(self, args: argparse.Namespace, spec: CkptConfig, n_params: int) -> None:
        super().__init__()
        self.args = args
        self.spec = spec
        self.n_params = n_params
        self.last_loss: Optional[float] = None
        self.base: dict[str, Any] = {"config": spec.name, "rank": _rank()}
        self._checksum: tuple[float, int] = (0.0, 0)
        """:func:`state_checksum` taken just before the first save."""
        self._last_save_cost = 0.0
        """Seconds the last save took with its flush and disk accounting (for :meth:`_time_for_another`)."""

    def _record(self, kind: str, **fields: Any) -> None:
        append_record(self.args.results_file, {**self.base, "kind": kind, **fields})

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.last_loss = float(loss.detach().float())

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        self.base["rank"] = trainer.global_rank
        self._record("setup", **self._setup_fields(trainer))
        root = self.args.ckpt_dir / self.spec.name
        if trainer.is_global_zero:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        strategy.barrier("ckpt_bench.mkdir")
        saves = 0
        for index in range(1, self.args.saves + 1):
            if index > 1 and not self._time_for_another(trainer):
                if trainer.is_global_zero:
                    self._record("note", note=f"save #{index} skipped: not enough time left of --time-limit-s")
                break
            path = root / f"save{index}"
            self._save(trainer, path, index)
            saves += 1
            if index == 1:
                self._load(trainer, path)
            self._delete(trainer, path)
        self._record("done", saves=saves, elapsed_s=time.monotonic() - START)

    def _setup_fields(self, trainer: Trainer) -> dict[str, Any]:
        name, _ = device_info(trainer.strategy.root_device)
        try:
            desc = self.spec.describe(trainer.strategy)
        except Exception as exc:  # noqa: BLE001 - a description must not cost the row
            desc = f"{type(trainer.strategy).__name__} ({short_reason(exc)})"
        cfg = getattr(trainer.strategy, "config", None)
        bucket_mb = getattr(cfg, "bucket_size_mb", None)
        return {
            "world_size": trainer.world_size, "device_type": self.args.device, "device_name": name,
            "versions": versions(), "n_params": self.n_params, "strategy_class": type(trainer.strategy).__name__,
            "config_desc": desc, "is_async": self.spec.is_async, "train_steps": trainer.global_step,
            "final_loss": self.last_loss, "micro_batch": self.args.micro_batch, "precision": PRECISION,
            "fused": not self.args.no_fused,  # build_module: AdamW(fused=True) unless --no-fused
            "bucket_bytes": int(bucket_mb * MIB) if bucket_mb is not None else None,
            "allocated_at_end_bytes": (torch.cuda.memory_allocated(trainer.strategy.root_device)
                                       if self.args.device == "cuda" else None),
        }

    def _time_for_another(self, trainer: Trainer) -> bool:
        """Rank 0 decides (the same answer on every rank): another save, flush and delete must fit, twice
        over, in what is left of ``--time-limit-s`` (margin for teardown)."""
        ok = True
        if trainer.is_global_zero and self.args.time_limit_s is not None:
            left = self.args.time_limit_s - (time.monotonic() - START) - 20.0
            ok = left > 2.0 * self._last_save_cost
        return bool(trainer.strategy.broadcast(ok, src=0))

    def _save(self, trainer: Trainer, path: Path, index: int) -> None:
        t_start = time.monotonic()
        region = Region(trainer.strategy, f"save{index}")
        if index == 1:
            self._checksum = state_checksum(trainer)
        region.start()
        trainer.save_checkpoint(path)
        blocking = region.elapsed()  # what the training loop waits for; queued device work shows in complete_s
        if self.spec.is_async:
            trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
        figures = region.end()
        fields: dict[str, Any] = {"index": index, "save_s": blocking, **{k: v for k, v in figures.items() if k != "local_s"}}
        if trainer.is_global_zero:
            fields["disk"] = disk_usage(path)
            fields["flush_s"] = flush(path, evict=not self.args.warm_load)
        trainer.strategy.barrier("ckpt_bench.flushed")
        self._last_save_cost = time.monotonic() - t_start
        self._record("save", **fields)

    def _load(self, trainer: Trainer, path: Path) -> None:
        strategy = trainer.strategy
        perturb_state(trainer)
        region = Region(strategy, "load")
        region.start()
        ckpt = strategy.load_checkpoint(path)
        strategy.load_model_state_dict(ckpt)
        strategy.load_optimizer_state_dict(ckpt)
        figures = region.end()
        del ckpt
        gc.collect()
        before, n_before = self._checksum
        after, n_after = state_checksum(trainer)
        rel = abs(after - before) / max(abs(before), 1e-30)
        verified = None if n_before == 0 else bool(n_after == n_before and rel < 1e-6)
        self._record("load", load_s=figures.pop("complete_s"), local_s=figures.pop("local_s"), **figures,
                     verified=verified, checksum_rel_err=rel, state_tensors=n_before)

    def _delete(self, trainer: Trainer, path: Path) -> None:
        if trainer.is_global_zero:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        trainer.strategy.barrier("ckpt_bench.deleted")


# ---------------------------------------------------------------------------------------------------- run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=sorted(CONFIGS))
    p.add_argument("--model", default="gpt_1b", help="conf/model preset name or a YAML path")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="training steps before the measurements")
    p.add_argument("--saves", type=int, default=2, help="saves (the last one that ran is reported)")
    p.add_argument("--held-steps", type=int, default=0,
                   help="K > 0: two saves inside the loop, K timed steps each side (checkpoint_held.py "
                        "[Note: training held by a save])")
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/lz_ckpt_bench"))
    p.add_argument("--warm-load", action="store_true", help="leave the checkpoint in the page cache before loading")
    p.add_argument("--time-limit-s", type=float, default=None, help="the parent's timeout: skip a repeat save past it")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=1, help="processes (GPUs) in this run")
    p.add_argument("--no-fused", action="store_true", help="torch AdamW without fused=True")
    p.add_argument("--results-file", type=Path, required=True)
    p.set_defaults(warmup=0)  # peers_worker.build_module's LR horizon is warmup + steps
    args = p.parse_args(argv)
    if args.steps < 1 or args.saves < (0 if args.held_steps else 1):
        p.error("--steps must be >= 1, --saves >= 1 (>= 0 with --held-steps)")
    return args


def build_trainer(args: argparse.Namespace, strategy: Union[str, Strategy], bench: CheckpointBench) -> Trainer:
    """A Trainer that trains ``--steps`` steps and nothing else (no validation, logger, automatic checkpoints)."""
    return L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.devices,
        num_nodes=1,
        strategy=strategy,
        precision=PRECISION,
        max_steps=args.steps + 4 * args.held_steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=([HeldBySave(args.held_steps, args.steps, args.ckpt_dir / bench.spec.name, bench.spec.is_async,
                               bench._record, bench._delete)] if args.held_steps else []) + [bench],
    )


def run(args: argparse.Namespace) -> int:
    spec = CONFIGS[args.config]
    return run_as_row(args, lambda: spec.build(args), lambda strategy: _fit(args, spec, strategy),
                      skip_on=(NotImplementedError, ValueError, TypeError))  # TypeError: an API not there yet


def _fit(args: argparse.Namespace, spec: CkptConfig, strategy: Strategy) -> None:
    from examples.data import TextDataModule
    from examples.gpt import GPTConfig

    L.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    cfg = GPTConfig(**model_preset(args.model))
    bench = CheckpointBench(args, spec, count_params(cfg))
    trainer = build_trainer(args, strategy, bench)
    model = build_module(peer_spec(spec), args, trainer, cfg)
    trainer.fit(model, datamodule=TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch))
    _shutdown_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    return worker_main(argv, parse_args, run)


__all__ = ["CONFIGS", "CkptConfig", "CheckpointBench", "Region", "disk_usage", "main"]


if __name__ == "__main__":
    sys.exit(main())
