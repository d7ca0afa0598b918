"""One run of the long-sequence benchmark (``benchmarks/sequence.py``), lightning_zero's side, in its own
process (``longest``: one GPU, one sequence length) or torchrun group (``sp``: sequence parallel N).

The model is an HF ``LlamaForCausalLM`` built from a config (random weights; ``presets.LLAMA_PRESETS``), in
``configure_model`` under the strategy's meta context, trained with torch AdamW in ``bf16-mixed`` on one
random sequence per step, the loss the token mean of a chunked cross-entropy
(``lightning_zero.sequence.chunked_loss``: the ``[tokens, vocab]`` logits never exist). What differs:

* ``longest``: ``ZeroStrategy`` stage 3 with parameters and optimizer states in host memory
  (``offload_state_precision`` 'bf16_sr' by default: 8 host bytes per parameter with the gradients), every
  decoder layer checkpointed, each MLP tiled (``lightning_zero.sequence.tiled_mlp.tile_mlps``). The layer
  checkpoints of layers ``K..L-1`` go to pinned host memory (the strategy's ``activation_offload`` with
  ``activation_offload_policy`` naming those layers), those of layers ``0..K-1`` stay on the GPU (plain
  non-reentrant checkpointing, ``lightning_zero.activations.offload.checkpoint(..., offload='none')``): see
  [Note: where the checkpoints go].
* ``sp``: ``ZeroStrategy(stage=3, sequence_parallel=N, tiled_mlp=T)`` on N GPUs, every decoder layer
  checkpointed on the GPU (no offload), as DeepSpeed's ALST recipe runs in ``sequence_ds.py``.

[Note: where the checkpoints go]
A checkpointed layer keeps its inputs: the hidden states, ``2 d`` bytes per token (HF passes the rotary
``cos``/``sin`` and the position ids by keyword, which torch's non-reentrant checkpoint holds by reference,
one copy for all layers). Offloaded, each layer's copy is its own pinned host block; torch's caching pinned
allocator rounds every block up to a power of two unless ``pinned_max_round_threshold_mb`` is set (this
worker sets it on one GPU and checks that it took: ``pinned_rounding`` in the record). ``--gpu-ckpt-layers
auto`` keeps on the GPU only as many layers as the host cannot hold: ``host_free = MemAvailable - offload
states (lightning_zero's estimator) - margin`` (sequence_plan.py [Note: the long-sequence ceiling of one
machine]).

Writes one JSON line per rank to ``--results-file`` (``kind: rank``) or an error row (``status``: 'oom-gpu',
'oom-host', 'failed', 'skipped'); ``sequence.py`` renders them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from typing_extensions import override  # noqa: E402

from benchmarks.presets import llama_preset  # noqa: E402
from benchmarks.records import (  # noqa: E402
    _shutdown_process_group, _version, append_record, device_info, short_reason, versions, worker_main,
)
from benchmarks.sequence_plan import (  # noqa: E402
    GIB, PINNED_ROUND_MB, flops_per_token, host_ckpt_bytes_per_layer, offload_state_bytes, tiles_for,
)

LR = 1e-5


# ---------------------------------------------------------------------------------------------------- host memory


def meminfo(key: str) -> int:
    """A /proc/meminfo field in bytes (0 where unreadable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def status_bytes(key: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM) in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class HostWatch:
    """Samples the machine's used memory (MemTotal - MemAvailable) every ``period`` s: its peak covers pinned
    and page-locked buffers whatever allocated them, and every rank of the node."""

    def __init__(self, period: float = 0.5) -> None:
        self.total = meminfo("MemTotal")
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._thread.start()

    def _run(self, period: float) -> None:
        while not self._stop.is_set():
            self.peak_used = max(self.peak_used, self.total - meminfo("MemAvailable"))
            self._stop.wait(period)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=2)
        return self.peak_used


def exact_pinned_sizes() -> str:
    """Ask torch's caching pinned allocator not to round large blocks up to a power of two, and check that it
    took (a 96 MiB block must not cost 128 MiB): 'exact', 'pow2' or 'n/a' (no CUDA)."""
    if not torch.cuda.is_available():
        return "n/a"
    try:
        torch._C._accelerator_setAllocatorSettings(f"pinned_max_round_threshold_mb:{PINNED_ROUND_MB}")
    except Exception:  # noqa: BLE001 - an older torch: the rounding stays, the plan accounts for it
        pass
    before = status_bytes("VmRSS")
    probe = torch.empty(96 * 2**20, dtype=torch.uint8, pin_memory=True)
    grown = status_bytes("VmRSS") - before
    del probe
    return "pow2" if grown >= 120 * 2**20 else "exact"


# ---------------------------------------------------------------------------------------------------- model


class LongLlama(LightningModule):
    """HF Llama with tiled MLPs and checkpointed layers, its loss a chunked cross-entropy."""

    def __init__(self, dims: dict[str, int], tiles: int, chunk_tokens: int, gpu_layers: int, tile_here: bool) -> None:
        super().__init__()
        self.dims, self.tiles, self.chunk_tokens = dims, tiles, chunk_tokens
        self.gpu_layers = gpu_layers
        """Layers checkpointed on the GPU (the rest the strategy's activation offload takes)."""
        self.tile_here = tile_here
        """Tile the MLPs here (one GPU: the strategy's ``tiled_mlp`` acts under sequence parallelism only)."""
        self.model: Optional[torch.nn.Module] = None

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        from transformers import LlamaForCausalLM

        from benchmarks.lora_worker import llama_config
        from lightning_zero.activations.offload import checkpoint
        from lightning_zero.sequence.tiled_mlp import tile_mlps

        model = LlamaForCausalLM(llama_config(self.dims))
        if self.tile_here and self.tiles > 1:
            tile_mlps(model, self.tiles)
        for layer in list(model.model.layers)[: self.gpu_layers]:
            checkpoint(layer, offload="none")
        self.model = model

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        from lightning_zero.sequence.chunked_loss import chunked_cross_entropy

        assert self.model is not None
        ids = batch["input_ids"]
        if "shift_labels" in batch:  # split by the strategy (sequence parallel): global positions and count
            labels, pos, count = batch["shift_labels"], batch["position_ids"], batch["num_items_in_batch"]
        else:
            labels = F.pad(ids[:, 1:], (0, 1), value=-100)
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            count = (labels != -100).sum()
        hidden = self.model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        total = chunked_cross_entropy(hidden, self.model.lm_head.weight, labels, chunk_tokens=self.chunk_tokens)
        return total / count

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        fused = True if torch.cuda.is_available() else None
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.0, fused=fused)


class RandomSequence(Dataset):
    """``n`` sequences of ``seq_len`` random token ids, the same on every rank (seeded by index)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000_003 * i + 7)
        return {"input_ids": torch.randint(0, self.vocab, (self.seq_len,), generator=g)}


class SeqTimer(Callback):
    """Wall time of each training step, the device synchronised at both ends; the last loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.loss: Optional[float] = None
        self._device: Optional[torch.device] = None
        self._start = 0.0

    def _now(self) -> float:
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.perf_counter()

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._device = trainer.strategy.root_device

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = self._now()

    @override
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.times.append(self._now() - self._start)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.loss = float(loss.detach())


# ---------------------------------------------------------------------------------------------------- run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("longest", "sp"), required=True)
    p.add_argument("--config", default="ours", help="row name")
    p.add_argument("--model", default="8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps (the last is reported; all are recorded)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=1, help="processes; under --mode sp the sequence-parallel degree")
    p.add_argument("--attention", default="auto", help="sp: sequence_attention (auto, ulysses, ring)")
    p.add_argument("--state-precision", default="bf16_sr", help="longest: offload_state_precision")
    p.add_argument("--gpu-ckpt-layers", default="auto", help="longest: layers checkpointed on the GPU, or auto")
    p.add_argument("--host-margin-gib", type=float, default=8.0, help="host memory left free by --gpu-ckpt-layers auto")
    p.add_argument("--chunk-tokens", type=int, default=4096, help="tokens per chunk of the chunked loss")
    p.add_argument("--tiles", type=int, default=0, help="MLP tiles (0: ceil(local tokens / hidden size), ALST's rule)")
    p.add_argument("--profile", action="store_true", help="profile one more step: NCCL and SP all-to-all share")
    p.add_argument("--results-file", type=Path, required=True)
    return p.parse_args(argv)


def gpu_layers(args: argparse.Namespace, dims: dict[str, int], pinned: str) -> tuple[int, dict[str, Any]]:
    """Layers whose checkpoints stay on the GPU (see [Note: where the checkpoints go]) and the host budget."""
    n_layers = dims["num_hidden_layers"]
    if args.mode != "longest":
        return n_layers, {}
    per_layer = host_ckpt_bytes_per_layer(dims, args.seq_len, pow2=pinned == "pow2")
    states = offload_state_bytes(dims, args.state_precision)
    free = meminfo("MemAvailable") - states - args.host_margin_gib * GIB
    plan = {"host_available_bytes": meminfo("MemAvailable"), "host_states_bytes": states,
            "host_ckpt_bytes_per_layer": per_layer, "host_free_for_ckpt_bytes": free}
    if args.gpu_ckpt_layers != "auto":
        return min(n_layers, int(args.gpu_ckpt_layers)), plan
    fit = max(0, int(free // per_layer)) if args.device == "cuda" else n_layers  # CPU: no host limit to plan for
    return max(0, n_layers - fit), plan


def build_strategy(args: argparse.Namespace, dims: dict[str, int], keep: int, tiles: int) -> Any:
    from lightning_zero import ZeroStrategy

    if args.mode == "sp":
        return ZeroStrategy(stage=3, sequence_parallel=args.devices, sequence_attention=args.attention, tiled_mlp=tiles)
    offloaded = [f"*.layers.{i}" for i in range(keep, dims["num_hidden_layers"])]
    return ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="cpu",
                        offload_state_precision=args.state_precision,
                        activation_offload=bool(offloaded), activation_offload_policy=offloaded or None)


def what_ran(module: LongLlama) -> dict[str, int]:
    """How many decoder layers ran checkpointed, with host-offloaded checkpoints, with a tiled MLP (read back
    from the modules, not restated from the arguments), and the offloader's peak of live host copies."""
    from lightning_zero.activations.offload import is_checkpointed, offloader_of
    from lightning_zero.sequence.tiled_mlp import TILED

    assert module.model is not None
    layers = list(module.model.model.layers)
    offloaders = [o for m in layers if (o := offloader_of(m)) is not None]
    return {"checkpointed": sum(is_checkpointed(m) for m in layers), "offloaded": len(offloaders),
            "tiled_mlp": sum(bool(getattr(m.mlp, TILED, None)) for m in layers),
            "host_ckpt_peak_bytes": offloaders[0].stats.peak_bytes if offloaders else 0}


def classify(exc: BaseException) -> str:
    """'oom-gpu', 'oom-host' or 'failed' for an exception that ended a run."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, torch.OutOfMemoryError) or "CUDA out of memory" in text:
        return "oom-gpu"
    if isinstance(exc, MemoryError) or "host memory" in text or "cudaHostRegister" in text \
            or ("out of memory" in text and "pin" in text.lower()):
        return "oom-host"
    return "failed"


def run(args: argparse.Namespace) -> int:
    base = {"kind": "error", "config": args.config, "rank": int(os.environ.get("RANK", "0")),
            "seq_len": args.seq_len, "mode": args.mode}
    try:
        return _run(args)
    except BaseException as exc:  # noqa: BLE001 - every failure is a row with its kind
        if isinstance(exc, KeyboardInterrupt):
            raise
        import traceback

        traceback.print_exc()
        append_record(args.results_file, {**base, "status": classify(exc), "reason": short_reason(exc)})
        return 1


def _run(args: argparse.Namespace) -> int:
    L.seed_everything(0, verbose=False)
    # the probe touches CUDA before the strategy picks this rank's device: one GPU only (nothing to pin under sp)
    pinned = exact_pinned_sizes() if args.device == "cuda" and args.mode == "longest" else "n/a"
    watch = HostWatch()
    _, dims = llama_preset(args.model, args.layers, args.seq_len)
    local = args.seq_len // (args.devices if args.mode == "sp" else 1)
    tiles = args.tiles or tiles_for(local, dims["hidden_size"])
    keep, plan = gpu_layers(args, dims, pinned)
    strategy = build_strategy(args, dims, keep, tiles)
    timer = SeqTimer()
    callbacks: list[Callback] = [timer]
    profiler = None
    if args.profile:
        from benchmarks.sequence_profile import SeqCommProfiler

        profiler = SeqCommProfiler(start_after=args.steps)
        callbacks.append(profiler)
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=args.devices, num_nodes=1, strategy=strategy,
        precision="bf16-mixed", max_steps=args.steps + (1 if args.profile else 0), limit_val_batches=0,
        num_sanity_val_steps=0, enable_checkpointing=False, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )
    module = LongLlama(dims, tiles, args.chunk_tokens, keep if args.mode == "longest" else dims["num_hidden_layers"],
                       tile_here=args.mode == "longest")
    loader = DataLoader(RandomSequence(args.steps + 2, args.seq_len, dims["vocab_size"]), batch_size=1)
    trainer.fit(module, train_dataloaders=loader)
    host_peak = watch.stop()
    if len(timer.times) < args.steps:
        raise RuntimeError(f"only {len(timer.times)} of {args.steps} steps ran")
    device = trainer.strategy.root_device
    name, _ = device_info(device)
    applied = what_ran(module)
    cuda = device.type == "cuda"
    step = timer.times[args.steps - 1]
    record = {
        "kind": "rank", "config": args.config, "mode": args.mode, "rank": trainer.global_rank,
        "world_size": trainer.world_size, "seq_len": args.seq_len, "layers": dims["num_hidden_layers"],
        "model": args.model, "device_name": name, "step_times_s": timer.times[: args.steps], "step_s": step,
        "tokens_per_s": args.seq_len / step, "flops_per_token": flops_per_token(dims, args.seq_len),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "gpu_total_bytes": torch.cuda.get_device_properties(device).total_memory if cuda else None,
        "peak_rss_bytes": status_bytes("VmHWM"), "host_used_peak_bytes": host_peak, "host_total_bytes": watch.total,
        "loss": timer.loss if timer.loss is None or math.isfinite(timer.loss) else float("nan"),
        "tiles": tiles, "chunk_tokens": args.chunk_tokens, "gpu_ckpt_layers": keep, "pinned_rounding": pinned,
        "attention": args.attention if args.mode == "sp" else None, "state_precision": args.state_precision,
        "plan": plan, "applied": applied, "comm": profiler.result if profiler is not None else None,
        "versions": {**versions(), "transformers": _version("transformers")},
    }
    append_record(args.results_file, record)
    _shutdown_process_group()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return worker_main(argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
