"""Pipeline parallelism vs ZeRO-1 data parallelism on 2 GPUs, same model, same global batch.

    torchrun --nproc-per-node 2 benchmarks/pipeline.py                        # GPT-1.3B, M = 4, 8, 16 vs zero1
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --results benchmarks/RESULTS.md
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --device cpu --model tiny --steps 3 --warmup 1
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --compile                  # every block torch.compiled
    torchrun --nproc-per-node 4 benchmarks/pipeline.py --sweep --global-batch 64  # 1F1B, interleaved; pp 2, 4; M 4-16
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --configs pipe-M8 --trace OUT  # + compute vs communication

Workload: the GPT of ``examples/gpt.py`` (``conf/model/gpt_1b.yaml``: 24 x 2048, 16 heads, seq 1024,
vocab 50304, tied embedding/head) written as a :class:`PipelineModule`, ``bf16-mixed``, AdamW, global
batch ``--global-batch`` sequences (default 16: 8 per GPU under zero1, as in DESIGN.md section 7).

Configurations: ``zero1`` and ``zero3`` (every GPU data parallel, the module runs in sequence) and ``pipe-M{4,8,16}``
(``--stages`` stages, default 2, x the remaining GPUs data parallel, ZeRO-1 inside each stage, 1F1B over M micro-batches of
global_batch / M sequences; ``--schedule`` picks another; a name such as ``pipe-M8-interleaved-pp4`` sets both per row,
and ``--sweep`` runs the rows issue #32 asks for in one call). ``--compile``: every configuration with
``ZeroStrategy(compile=True)`` (each block compiled one by one, lightning_zero/zero/compile.py; under a
pipeline, the blocks the stage holds), so a stage launches fused kernels. Stages are balanced by forward FLOPs
(embedding ~0, each block 1, the tied head ~ 2 V / (24 d + 4 seq) blocks), not by parameter count,
because a stage's time, not its size, sets the bubble.

Reported per configuration (markdown table on rank 0, also appended to ``--results`` when given):
tokens/s over the measured steps, the ratio to zero1, peak memory per GPU (max over ranks), and for
pipelines the measured bubble (idle fraction of the average stage, lightning_zero/pipeline/timing.py)
beside the theoretical (P-1)/(M+P-1); with ``--trace``, per stage, the profiled time split into compute,
communication and neither (:func:`stage_time_split`), and the schedule's waits (next note). All configurations run in
one process tree, one after another; memory statistics are reset and caches emptied between them.

[Note: the schedule's waits]
Every point-to-point exchange of the pipeline, and at the flush the tied weights' gradient all-reduce, runs as an
NCCL kernel from its launch until the peer's matching operation delivers: its device time is the time that stage
waits for the other (the transfer itself, a micro-batch's activation over NVLink, takes tens of microseconds).
That wait is what ``(P - 1) / (M + P - 1)`` predicts. The stage timer's "bubble measured" (pipeline/timing.py)
counts as idle everything outside the forward/backward actions: the gaps between kernels while the host launches,
the optimizer step, clipping, the loss's all-reduce, zero-fills. On 2 H200s at pp 2, M = 8 a trace split its 34%
into ~12% NCCL waits, ~5% kernel-free gaps and the rest non-schedule work (benchmarks/RESULTS.md, 2026-11-29
23:47). With ``--trace`` both are printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset, DistributedSampler  # noqa: E402

import lightning_zero  # noqa: E402
from examples.gpt import Block, GPTConfig  # noqa: E402  (examples/gpt.py)
from lightning_zero.pipeline import LayerSpec, PipelineModule, TiedLayerSpec, theoretical_bubble  # noqa: E402
from lightning_zero.pipeline.partition import balanced  # noqa: E402
from benchmarks.presets import model_preset  # noqa: E402


class Embeddings(nn.Module):
    """Token + position embedding (the first layer; its token table is also the output head)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class GPT2Block(Block):
    """examples/gpt.py's Block with GPT-2's initialisation (GPT.reset_parameters does it for the whole model)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for proj in (self.attn.proj, self.mlp.proj):
            nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))


def lm_head(emb: Embeddings, h: torch.Tensor) -> torch.Tensor:
    return F.linear(h, emb.wte.weight)


def gpt_layers(cfg: GPTConfig) -> list:
    return [
        TiedLayerSpec("embed", Embeddings, cfg),
        *[LayerSpec(GPT2Block, cfg) for _ in range(cfg.n_layer)],
        LayerSpec(nn.LayerNorm, cfg.d_model, bias=cfg.bias),
        TiedLayerSpec("embed", Embeddings, cfg, forward_fn=lm_head),
    ]


def flop_bounds(cfg: GPTConfig, stages: int) -> list[int]:
    """Boundaries balancing forward FLOPs per token: block = 24 d^2 + 4 seq d, head = 2 V d."""
    block = 24 * cfg.d_model**2 + 4 * cfg.seq_len * cfg.d_model
    weights = [0.0] + [1.0] * cfg.n_layer + [0.0, 2 * cfg.vocab_size * cfg.d_model / block]
    return balanced(weights, stages)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))


class RandomTokens(Dataset):
    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class PipeGPT(pl.LightningModule):
    def __init__(self, cfg: GPTConfig, global_batch: int, n_samples: int, partition: Any) -> None:
        super().__init__()
        self.cfg, self.global_batch, self.n_samples = cfg, global_batch, n_samples
        self.pipe = PipelineModule(gpt_layers(cfg), loss_fn, partition=partition)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipe(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "tied" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "tied" not in n)]
        fused = self.device.type == "cuda"
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=fused)

    def train_dataloader(self) -> DataLoader:
        kwargs = self.trainer.strategy.distributed_sampler_kwargs
        data = RandomTokens(self.n_samples, self.cfg.seq_len, self.cfg.vocab_size)
        sampler = DistributedSampler(data, shuffle=False, **kwargs)
        return DataLoader(data, batch_size=self.global_batch // kwargs["num_replicas"], sampler=sampler, drop_last=True)


class StepTimer(pl.Callback):
    """Wall time of the steps after ``warmup`` (device synchronised at both ends)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: Optional[float] = None
        self.end: Optional[float] = None
        self.steps = 0

    def _now(self, trainer: pl.Trainer) -> float:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup and self.start is None:
            self.start = self._now(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.start is not None:
            self.steps += 1
            if trainer.global_step >= trainer.max_steps:  # one synchronisation at the end, none per step
                self.end = self._now(trainer)


class StepTrace(pl.Callback):
    """``--trace DIR``: torch.profiler over the last two steps of a configuration, one gzipped Chrome trace per
    rank plus the top of its kernel table (where a stage's idle time goes: receives, the loss, the step)."""

    def __init__(self, out: str, name: str, first: int) -> None:
        self.out, self.name, self.first = out, name, first
        self.prof: Any = None
        self.split: Optional[dict[str, float]] = None
        """This rank's :func:`stage_time_split` once profiled."""

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.first and self.prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False)
            self.prof.__enter__()

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        os.makedirs(self.out, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        path = os.path.join(self.out, f"{self.name}_rank{rank}.json")
        self.prof.export_chrome_trace(path)
        os.system(f"gzip -f {path}")
        key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        self.split = stage_time_split(self.prof.events(), torch.cuda.is_available())
        line = f"rank {rank} ({self.name}, 2 steps): " + format_split(self.split)
        print(line, flush=True)
        with open(os.path.join(self.out, f"{self.name}_rank{rank}.txt"), "w") as f:
            f.write(self.prof.key_averages().table(sort_by=key, row_limit=40))
            f.write("\n" + memsets_by_op(self.prof.events()) + line + "\n")
        self.prof = None


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += min(b, ys[k][1]) - max(a, ys[k][0])
            k += 1
    return total


def stage_time_split(events: Any, cuda: bool) -> dict[str, float]:
    """Where one stage's profiled time went, in ms (issue #32: is a stage waiting in communication or computing?).

    CUDA: the device timeline. ``comm`` is the time NCCL kernels run (a SendRecv kernel runs from its launch until
    its peer's matching operation has delivered, so its time is the stage's wait in communication), ``compute`` the
    time any other kernel runs, ``overlap`` the compute time with an NCCL kernel running beside it (a spinning
    receive or send slowing the compute), ``idle`` the span with no kernel at all (the GPU waits for the host).
    CPU (gloo): the host timeline of the runtime's ranges (pipeline/timing.py ``LABELS``): ``compute`` inside
    forward/backward actions, ``comm`` inside exchanges (gloo waits on the host), ``idle`` the rest of the span.
    """
    from torch.autograd import DeviceType

    comm: list[tuple[float, float]] = []
    compute: list[tuple[float, float]] = []
    for ev in events:
        rng = (float(ev.time_range.start), float(ev.time_range.end))
        if cuda:
            if ev.device_type != DeviceType.CUDA or rng[1] <= rng[0]:
                continue
            (comm if "nccl" in ev.name.lower() else compute).append(rng)
        elif ev.name == "pipe.exchange":
            comm.append(rng)
        elif ev.name in ("pipe.forward", "pipe.backward"):
            compute.append(rng)
    comm, compute = _union(comm), _union(compute)
    both = _union(comm + compute)
    span = (both[-1][1] - both[0][0]) if both else 0.0
    ms = 1e-3  # profiler times are in microseconds
    return {"span": span * ms, "compute": _length(compute) * ms, "comm": _length(comm) * ms,
            "overlap": _overlap(compute, comm) * ms, "idle": (span - _length(both)) * ms}


def format_split(split: dict[str, float]) -> str:
    span = split["span"] or float("nan")
    pct = lambda k: f"{100 * split[k] / span:.1f}%"  # noqa: E731
    return (f"span {split['span']:.1f} ms: compute {split['compute']:.1f} ms ({pct('compute')}), communication "
            f"{split['comm']:.1f} ms ({pct('comm')}; {split['overlap']:.1f} ms of it beside compute), "
            f"neither {split['idle']:.1f} ms ({pct('idle')})")


def memsets_by_op(events: Any) -> str:
    """``cudaMemsetAsync`` calls counted by the nearest ``aten::`` op that issued them (issue #32: the zero-fills
    of a pipeline stage: the runtime's own allocations, or inside a library's kernels such as a GEMM's)."""
    counts: dict[str, int] = {}
    for ev in events:
        if ev.name != "cudaMemsetAsync":
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        name = parent.name if parent is not None else "(no aten op)"
        counts[name] = counts.get(name, 0) + 1
    rows = sorted(counts.items(), key=lambda kv: -kv[1])
    return "cudaMemsetAsync by issuing op: " + (", ".join(f"{n} {c}" for n, c in rows) or "none") + "\n"


SCHEDULES = ("1f1b", "gpipe", "interleaved")


def parse_config(name: str, args: argparse.Namespace) -> tuple[int, int, str]:
    """(stages, micro-batches, schedule) of a configuration name: ``zero1``/``zero3`` (1 stage), or
    ``pipe-M{M}`` with optional ``-{schedule}`` and ``-pp{P}`` parts overriding ``--schedule``/``--stages``
    (``pipe-M8-interleaved-pp4``), so one call can run several schedules and depths."""
    if name in ("zero1", "zero3"):
        return 1, 1, args.schedule
    parts = name.split("-")
    if parts[0] != "pipe" or not any(p.startswith("M") for p in parts[1:]):
        raise SystemExit(f"unknown config {name!r}: zero1, zero3 or pipe-M<M>[-<schedule>][-pp<P>]")
    stages, micro, schedule = args.stages, 0, args.schedule
    for part in parts[1:]:
        if part.startswith("M") and part[1:].isdigit():
            micro = int(part[1:])
        elif part.startswith("pp") and part[2:].isdigit():
            stages = int(part[2:])
        elif part in SCHEDULES:
            schedule = part
        else:
            raise SystemExit(f"config {name!r}: unknown part {part!r}")
    return stages, micro, schedule


def sweep_configs(world: int, schedules: list[str], micros: tuple[int, ...] = (4, 8, 16)) -> list[str]:
    """``--sweep``: zero1 and zero3, then every pipeline depth that divides the GPUs (2 and 4 on 4 GPUs) x every
    schedule x M = 4, 8, 16 (issue #32 item 4), one row each."""
    depths = [p for p in (2, 4, 8) if p <= world and world % p == 0]
    return ["zero1", "zero3"] + [f"pipe-M{m}-{s}-pp{p}" for p in depths for s in schedules for m in micros]


def run_config(name: str, args: argparse.Namespace, cfg: GPTConfig, world: int) -> dict[str, Any]:
    stages, micro, schedule = parse_config(name, args)  # zero1/zero3: 1 stage, every GPU data parallel
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(0)
    steps = args.warmup + args.steps
    chunks = args.virtual_stages if schedule == "interleaved" and stages > 1 else 1
    partition = flop_bounds(cfg, stages * chunks) if stages > 1 else "uniform"
    model = PipeGPT(cfg, args.global_batch, args.global_batch * steps, partition)
    strategy = lightning_zero.ZeroStrategy(
        stage=3 if name == "zero3" else 1, pipeline_stages=stages, microbatches=micro, schedule=schedule,
        virtual_stages=args.virtual_stages,
        process_group_backend="nccl" if args.device == "cuda" else "gloo", compile=args.compile,
    )
    timer = StepTimer(args.warmup)
    callbacks: list[pl.Callback] = [timer]
    trace = StepTrace(args.trace, name, steps - 2) if args.trace else None
    if trace is not None:
        callbacks.append(trace)
    trainer = pl.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu", devices=world, strategy=strategy,
        precision="bf16-mixed" if args.device == "cuda" else "32-true", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False, callbacks=callbacks,
        gradient_clip_val=1.0,
    )
    error = None
    try:
        trainer.fit(model)
    except torch.cuda.OutOfMemoryError as err:  # a row, not a crash (every rank sees its own OOM or hangs: rare)
        error = f"OOM: {str(err).splitlines()[0][:80]}"
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    peaks: list = [None] * world
    torch.distributed.all_gather_object(peaks, peak)
    bubble = trainer.strategy.pipeline_bubble if error is None else None
    measured = [None] * world
    torch.distributed.all_gather_object(measured, bubble["measured_stage"] if bubble else None)
    splits: list = [None] * world
    torch.distributed.all_gather_object(splits, trace.split if trace is not None else None)
    elapsed = (timer.end - timer.start) if timer.start is not None and timer.end is not None else float("nan")
    tokens = timer.steps * args.global_batch * cfg.seq_len
    row = {
        "config": name, "schedule": schedule if stages > 1 else "-", "stages": stages, "dp": world // stages,
        "microbatches": micro,
        "micro_batch": args.global_batch // (world // stages) // micro, "tokens_per_s": tokens / elapsed,
        "peak_gib": max(p for p in peaks if p is not None), "error": error,
        "bubble_measured": bubble["measured"] if bubble else None,
        "bubble_stages": measured[:: world // stages] if bubble else None,
        "bubble_theory": theoretical_bubble(schedule, stages, micro, chunks) if stages > 1 else None,
        "splits": splits[:: world // stages] if trace is not None else None,
    }
    del trainer, model, strategy
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return row


def render(rows: list[dict[str, Any]], args: argparse.Namespace, device: str) -> str:
    base = next((r["tokens_per_s"] for r in rows if r["config"] == "zero1"), None)
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"### Pipeline vs ZeRO-1, {args.model}, {device}, {dt.date.today().isoformat()}",
        "",
        f"Global batch {args.global_batch} x seq; {args.virtual_stages} chunks per GPU when interleaved; "
        f"{args.steps} measured steps after "
        f"{args.warmup} warm-up{'; every block torch.compiled' if args.compile else ''}. Bubble: idle fraction of "
        "the average stage (per stage in brackets).",
        "",
        "| config | schedule | stages x dp | M | micro-batch | tokens/s | vs zero1 | peak GiB/GPU | bubble measured | bubble theoretical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['config']} | {r['schedule']} | {r['stages']} x {r['dp']} | {r['microbatches']} | {r['micro_batch']} | {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        stages = f" ({', '.join(pct(b) for b in r['bubble_stages'])})" if r["stages"] > 1 and r["bubble_stages"] else ""
        lines.append(
            f"| {r['config']} | {r['schedule']} | {r['stages']} x {r['dp']} | {r['microbatches']} | {r['micro_batch']} | "
            f"{r['tokens_per_s']:,.0f} | {ratio} | {r['peak_gib']:.1f} | "
            f"{pct(r['bubble_measured']) + stages if r['stages'] > 1 else '-'} | {pct(r['bubble_theory'])} |"
        )
    traced = [r for r in rows if any(x and x["span"] > 0 for x in r.get("splits") or [])]
    if traced:
        lines += ["", "Per stage, the 2 profiled steps (--trace; pipeline stage s = its first rank; CUDA: kernel time, "
                  "CPU: the runtime's ranges): compute vs communication.", ""]
        for r in traced:
            for s, split in enumerate(r["splits"]):
                lines.append(f"- {r['config']} stage {s}: " + (format_split(split) if split else "not profiled"))
            waits = [x["comm"] / x["span"] for x in r["splits"] if x and x["span"] > 0]
            if waits and r["stages"] > 1:  # [Note: the schedule's waits]
                lines.append(f"- {r['config']}: schedule waits {pct(sum(waits) / len(waits))} of the span "
                             f"({', '.join(pct(w) for w in waits)}) against {pct(r['bubble_theory'])} in theory")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_1b", help="conf/model preset: gpt_1b, gpt_small, tiny, ...")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--configs", default="zero1,pipe-M4,pipe-M8,pipe-M16")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"])
    parser.add_argument("--virtual-stages", type=int, default=2, help="model chunks per GPU for --schedule interleaved")
    parser.add_argument("--sweep", action="store_true", help="zero1, zero3, then 1F1B and interleaved at M = 4, 8, 16 "
                        "for every pipeline depth dividing the GPUs (pp 2 and pp 4 on 4 GPUs): replaces --configs")
    parser.add_argument("--sweep-schedules", default="1f1b,interleaved", help="the schedules --sweep runs")
    parser.add_argument("--stages", type=int, default=2, help="pipeline stages (the rest of the GPUs is data parallel)")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="ZeroStrategy(compile=True) in every configuration")
    parser.add_argument("--trace", default=None, help="profile the last 2 steps of each config: traces per rank here")
    parser.add_argument("--results", default=None, help="append the table to this markdown file (rank 0)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not args.sweep and (world < args.stages or world % args.stages):
        raise SystemExit(f"run with: torchrun --nproc-per-node N benchmarks/pipeline.py, N a multiple of --stages ({args.stages})")
    cfg = GPTConfig(**{k: v for k, v in model_preset(args.model).items() if k in GPTConfig.__dataclass_fields__})
    names = sweep_configs(world, args.sweep_schedules.split(",")) if args.sweep else [
        n.strip() for n in args.configs.split(",") if n.strip()]
    for name in names:  # fail before the first configuration runs, not after an hour of them
        stages, micro, _ = parse_config(name, args)
        if world % stages or args.global_batch % (world // stages * micro):
            raise SystemExit(f"config {name!r}: needs its stages ({stages}) to divide the GPUs ({world}) and M "
                             f"({micro}) x the data-parallel ranks to divide --global-batch ({args.global_batch})")
    rows = [run_config(name, args, cfg, world) for name in names]
    if int(os.environ.get("RANK", "0")) == 0:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
        table = render(rows, args, f"{world} x {device}")
        print(table)
        if args.results:
            with open(args.results, "a") as f:
                f.write("\n" + table)


if __name__ == "__main__":
    main()
