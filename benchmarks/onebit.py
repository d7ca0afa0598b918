"""1-bit Adam / 1-bit LAMB against exact Adam / LAMB: end-to-end steps/s, bytes, compression share.

Run under torchrun, one process per device; prints a markdown table on rank 0:

    torchrun --nproc-per-node 2 benchmarks/onebit.py --device cpu                  # (a) gloo over loopback
    torchrun --nproc-per-node 2 benchmarks/onebit.py --device cuda                 # (b) NCCL (NVLink)
    NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \\
        torchrun --nproc-per-node 2 benchmarks/onebit.py --device cuda             # (c) NCCL over sockets

Each optimizer trains the example GPT (examples/gpt.py, byte-level pydoc corpus) under
``ZeroStrategy(stage=0)`` for ``--steps`` steps with ``--warmup-fraction`` (15%) of exact warm-up.
Reported per optimizer: median step time in the warm-up and in the compressed phase (each phase's
first 2 steps dropped), steps/s of the compressed phase and its ratio to the exact optimizer, wire
bytes per rank and step against a 16-bit all-reduce of the same momentum, the volume ratio over
the whole run (16-bit warm-up accounting, as the optimizer's ``comm_stats``), and the share of the
compressed step spent in sign packing/unpacking (measured with device syncs over the last
``--profile-steps`` steps only, so the timed steps run unperturbed). For the exact optimizer, the
``comm share`` column is the time of one all-reduce of all gradients (compute dtype) divided by
the step time: where it is above 50%, 1-bit should pay at least 2x. The LAMB baseline is
OneBitLamb with compression never starting (exact LAMB, same code path; see
tests/onebit/test_optimizers.py::test_lamb_warmup_is_fused_lamb).

``NCCL_NVLS_ENABLE=0`` is set unless given (NVLink SHARP multicast is off on the lent machines).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402

import lightning_zero  # noqa: E402
from examples.data import TextDataModule  # noqa: E402
from examples.gpt import GPT, GPTConfig, lr_lambda  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.optim import OneBitAdam, OneBitLamb  # noqa: E402

MODELS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=64),
    "small": GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=256, seq_len=64),
    "medium": GPTConfig(vocab_size=256, n_layer=8, n_head=8, d_model=512, seq_len=128),
    "large": GPTConfig(vocab_size=50304, n_layer=12, n_head=16, d_model=1024, seq_len=512),
    "xl": GPTConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024),
}
LR = {"adam": 1e-3, "onebit_adam": 1e-3, "lamb": 1e-2, "onebit_lamb": 1e-2}
NEVER = 10**9


class Module(pl.LightningModule):
    """Next-token cross-entropy of the example GPT: decay on Linear weights only, warm-up + cosine LR."""

    def __init__(self, cfg: GPTConfig, kind: str, steps: int, freeze: int) -> None:
        super().__init__()
        self.cfg, self.kind, self.steps, self.freeze = cfg, kind, steps, freeze
        self.model = GPT(cfg)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x).float().view(-1, self.cfg.vocab_size), y.reshape(-1))

    def configure_optimizers(self) -> Any:
        decay = [m.weight for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        ids = {id(p) for p in decay}
        rest = [p for p in self.model.parameters() if id(p) not in ids]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        common = dict(lr=LR[self.kind], betas=(0.9, 0.95), eps=1e-8)
        if self.kind == "adam":
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, **common)
        elif self.kind == "onebit_adam":
            opt = OneBitAdam(groups, freeze_step=self.freeze, **common)
        else:
            opt = OneBitLamb(groups, freeze_step=self.freeze if self.kind == "onebit_lamb" else NEVER, **common)
        horizon, warmup = self.steps, max(1, self.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, warmup, horizon, 0.1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Timer(pl.Callback):
    """Wall time of every training step (device-synchronised), kernel timing on the last steps."""

    def __init__(self, steps: int, profile_steps: int) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []
        self.profile_from = steps - profile_steps
        self.kernel_s = 0.0
        self.profiled_s = 0.0
        self._t0 = 0.0

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        backend = getattr(trainer.optimizers[0], "comm_backend", None)
        if backend is not None and trainer.global_step == self.profile_from:
            backend.time_kernels = True
            self._kernel0 = backend.counters.kernel_s
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, idx: int) -> None:
        self._sync(pl_module)
        dt_s = time.perf_counter() - self._t0
        self.times.append(dt_s)
        self.losses.append(float(out["loss"]))
        backend = getattr(trainer.optimizers[0], "comm_backend", None)
        if backend is not None and backend.time_kernels:
            self.profiled_s += dt_s
            self.kernel_s = backend.counters.kernel_s - self._kernel0


def allreduce_ms(numel: int, dtype: torch.dtype, device: torch.device, reps: int = 5) -> float:
    """One all-reduce of ``numel`` elements, as the exact optimizer's gradient exchange does per step."""
    t = torch.ones(numel, dtype=dtype, device=C.device_for(None, device))
    C.all_reduce(t, None)
    times = []
    for _ in range(reps):
        C.barrier()
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        start = time.perf_counter()
        C.all_reduce(t, None)
        if t.is_cuda:
            torch.cuda.synchronize(t.device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = MODELS[args.model]
    freeze = max(1, round(args.steps * args.warmup_fraction))
    pl.seed_everything(0, workers=True)
    model = Module(cfg, kind, args.steps, freeze)
    timer = Timer(args.steps, args.profile_steps if kind.startswith("onebit") else 0)
    cuda = args.device == "cuda"
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy=lightning_zero.ZeroStrategy(stage=0), precision="bf16-mixed" if cuda else "32-true",
        max_steps=args.steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[timer], gradient_clip_val=1.0,
    )
    trainer.fit(model, datamodule=TextDataModule(seq_len=cfg.seq_len, batch_size=args.micro_batch))
    opt = trainer.optimizers[0]
    numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    times = timer.times
    timed_end = timer.profile_from if kind.startswith("onebit") else len(times)
    warm = times[2:freeze] if kind.startswith("onebit") else times[2:]
    comp = times[freeze + 2 : timed_end] if kind.startswith("onebit") else times[2:]
    stats = getattr(opt, "comm_stats", {})
    result = {
        "kind": kind, "numel": numel, "warm_ms": 1e3 * statistics.median(warm) if warm else float("nan"),
        "comp_ms": 1e3 * statistics.median(comp), "loss": statistics.fmean(timer.losses[-5:]),
        "bytes": stats.get("onebit/bytes_sent"), "ref_bytes": stats.get("onebit/bytes_16bit_allreduce"),
        "volume_ratio": stats.get("onebit/compression_ratio"),
        "kernel_share": timer.kernel_s / timer.profiled_s if timer.profiled_s else None,
    }
    if kind in ("adam", "lamb"):
        dtype = torch.bfloat16 if cuda else torch.float32
        result["comm_share"] = allreduce_ms(numel, dtype, trainer.strategy.root_device) / result["comp_ms"]
    return result


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    world = C.world_size()
    backend = C.backend()
    env = " ".join(f"{k}={os.environ[k]}" for k in ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NVLS_ENABLE") if k in os.environ)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    cfg = MODELS[args.model]
    lines = [
        f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC · onebit · {world} x {device} · {backend} {env}".rstrip(),
        "",
        f"Model `{args.model}` ({cfg.n_layer} layers x d_model {cfg.d_model}, seq {cfg.seq_len}, vocab {cfg.vocab_size}; "
        f"{results[0]['numel'] / 1e6:.2f} M parameters), micro-batch {args.micro_batch} per rank, {args.steps} steps, "
        f"warm-up {args.warmup_fraction:.0%}; ZeroStrategy(stage=0), {'bf16-mixed' if args.device == 'cuda' else '32-true'}; "
        f"torch {torch.__version__}.",
        "",
        f"Command: `{' '.join(sys.argv)}` (torchrun, {world} ranks)",
        "",
        "| optimizer | step ms (warm-up) | step ms (compressed) | steps/s | × exact | bytes/step/rank | 16-bit all-reduce | "
        "volume ratio (run) | kernel share | comm share (exact) | loss (last 5) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_kind = {r["kind"]: r for r in results}
    for r in results:
        base = by_kind.get(r["kind"].replace("onebit_", ""))
        speedup = f"{base['comp_ms'] / r['comp_ms']:.2f}" if base else ""
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        lines.append(
            f"| `{r['kind']}` | {r['warm_ms']:.1f} | {r['comp_ms']:.1f} | {1e3 / r['comp_ms']:.2f} | {speedup} | "
            f"{fmt(r['bytes'], ',.0f')} | {fmt(r['ref_bytes'], ',.0f')} | {fmt(r['volume_ratio'], '.2f')} | "
            f"{fmt(r['kernel_share'] and 100 * r['kernel_share'], '.1f')}{'%' if r['kernel_share'] else ''} | "
            f"{fmt(r.get('comm_share') and 100 * r['comm_share'], '.0f')}{'%' if r.get('comm_share') else ''} | "
            f"{r['loss']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="default: large on cuda, small on cpu")
    p.add_argument("--micro-batch", type=int, default=None, help="default: 8 on cuda, 4 on cpu")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup-fraction", type=float, default=0.15)
    p.add_argument("--profile-steps", type=int, default=5, help="last steps timed with kernel syncs")
    p.add_argument("--optimizers", default="adam,onebit_adam", help="comma list of adam,onebit_adam,lamb,onebit_lamb")
    p.add_argument("--write-results", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = p.parse_args(argv)
    args.model = args.model or ("large" if args.device == "cuda" else "small")
    args.micro_batch = args.micro_batch or (8 if args.device == "cuda" else 4)
    if args.steps * (1 - args.warmup_fraction) < args.profile_steps + 6:
        p.error("too few steps for the compressed phase to be timed and profiled")
    results = [run(kind, args) for kind in args.optimizers.split(",")]
    if C.rank() == 0:
        text = table(results, args)
        print(text, flush=True)
        if args.write_results:
            with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
                f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
