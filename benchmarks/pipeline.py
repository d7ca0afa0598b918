"""Pipeline parallelism vs ZeRO-1 data parallelism on 2 GPUs, same model, same global batch.

    torchrun --nproc-per-node 2 benchmarks/pipeline.py                        # GPT-1.3B, M = 4, 8, 16 vs zero1
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --results benchmarks/RESULTS.md
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --device cpu --model tiny --steps 3 --warmup 1
    torchrun --nproc-per-node 2 benchmarks/pipeline.py --compile                  # every block torch.compiled

Workload: the GPT of ``examples/gpt.py`` (``conf/model/gpt_1b.yaml``: 24 x 2048, 16 heads, seq 1024,
vocab 50304, tied embedding/head) written as a :class:`PipelineModule`, ``bf16-mixed``, AdamW, global
batch ``--global-batch`` sequences (default 16: 8 per GPU under zero1, as in DESIGN.md section 7).

Configurations: ``zero1`` and ``zero3`` (every GPU data parallel, the module runs in sequence) and ``pipe-M{4,8,16}``
(``--stages`` stages, default 2, x the remaining GPUs data parallel, ZeRO-1 inside each stage, 1F1B over M micro-batches of
global_batch / M sequences; ``--schedule`` picks another). ``--compile``: every configuration with
``ZeroStrategy(compile=True)`` (each block compiled one by one, lightning_zero/zero/compile.py; under a
pipeline, the blocks the stage holds), so a stage launches fused kernels. Stages are balanced by forward FLOPs
(embedding ~0, each block 1, the tied head ~ 2 V / (24 d + 4 seq) blocks), not by parameter count,
because a stage's time, not its size, sets the bubble.

Reported per configuration (markdown table on rank 0, also appended to ``--results`` when given):
tokens/s over the measured steps, the ratio to zero1, peak memory per GPU (max over ranks), and for
pipelines the measured bubble (idle fraction of the average stage, lightning_zero/pipeline/timing.py)
beside the theoretical (P-1)/(M+P-1). All configurations run in one process tree, one after another;
memory statistics are reset and caches emptied between them.
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
        with open(os.path.join(self.out, f"{self.name}_rank{rank}.txt"), "w") as f:
            f.write(self.prof.key_averages().table(sort_by=key, row_limit=40))
            f.write("\n" + memsets_by_op(self.prof.events()))
        self.prof = None


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


def run_config(name: str, args: argparse.Namespace, cfg: GPTConfig, world: int) -> dict[str, Any]:
    flat = name in ("zero1", "zero3")  # data parallel over every GPU, the module run in sequence
    stages = 1 if flat else args.stages
    micro = 1 if flat else int(name.split("M")[-1])
    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    pl.seed_everything(0)
    steps = args.warmup + args.steps
    chunks = args.virtual_stages if args.schedule == "interleaved" else 1
    partition = flop_bounds(cfg, stages * chunks) if stages > 1 else "uniform"
    model = PipeGPT(cfg, args.global_batch, args.global_batch * steps, partition)
    strategy = lightning_zero.ZeroStrategy(
        stage=3 if name == "zero3" else 1, pipeline_stages=stages, microbatches=micro, schedule=args.schedule, virtual_stages=args.virtual_stages,
        process_group_backend="nccl" if args.device == "cuda" else "gloo", compile=args.compile,
    )
    timer = StepTimer(args.warmup)
    callbacks: list[pl.Callback] = [timer]
    if args.trace:
        callbacks.append(StepTrace(args.trace, name, steps - 2))
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
    elapsed = (timer.end - timer.start) if timer.start is not None and timer.end is not None else float("nan")
    tokens = timer.steps * args.global_batch * cfg.seq_len
    row = {
        "config": name, "stages": stages, "dp": world // stages, "microbatches": micro,
        "micro_batch": args.global_batch // (world // stages) // micro, "tokens_per_s": tokens / elapsed,
        "peak_gib": max(p for p in peaks if p is not None), "error": error,
        "bubble_measured": bubble["measured"] if bubble else None,
        "bubble_stages": measured[:: world // stages] if bubble else None,
        "bubble_theory": theoretical_bubble(args.schedule, stages, micro, chunks) if stages > 1 else None,
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
        f"Global batch {args.global_batch} x seq; schedule {args.schedule}; {args.steps} measured steps after "
        f"{args.warmup} warm-up{'; every block torch.compiled' if args.compile else ''}. Bubble: idle fraction of "
        "the average stage (per stage in brackets).",
        "",
        "| config | stages x dp | M | micro-batch | tokens/s | vs zero1 | peak GiB/GPU | bubble measured | bubble theoretical |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['config']} | {r['stages']} x {r['dp']} | {r['microbatches']} | {r['micro_batch']} | {r['error']} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        stages = f" ({', '.join(pct(b) for b in r['bubble_stages'])})" if r["stages"] > 1 and r["bubble_stages"] else ""
        lines.append(
            f"| {r['config']} | {r['stages']} x {r['dp']} | {r['microbatches']} | {r['micro_batch']} | "
            f"{r['tokens_per_s']:,.0f} | {ratio} | {r['peak_gib']:.1f} | "
            f"{pct(r['bubble_measured']) + stages if r['stages'] > 1 else '-'} | {pct(r['bubble_theory'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_1b", help="conf/model preset: gpt_1b, gpt_small, tiny, ...")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--configs", default="zero1,pipe-M4,pipe-M8,pipe-M16")
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved"])
    parser.add_argument("--virtual-stages", type=int, default=2, help="model chunks per GPU for --schedule interleaved")
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
    if world < args.stages or world % args.stages:
        raise SystemExit(f"run with: torchrun --nproc-per-node N benchmarks/pipeline.py, N a multiple of --stages ({args.stages})")
    cfg = GPTConfig(**{k: v for k, v in model_preset(args.model).items() if k in GPTConfig.__dataclass_fields__})
    rows = [run_config(name.strip(), args, cfg, world) for name in args.configs.split(",") if name.strip()]
    if int(os.environ.get("RANK", "0")) == 0:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (gloo)"
        table = render(rows, args, f"{world} x {device}")
        print(table)
        if args.results:
            with open(args.results, "a") as f:
                f.write("\n" + table)


if __name__ == "__main__":
    main()
