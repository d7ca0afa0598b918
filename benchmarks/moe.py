"""Mixture of Experts with expert parallelism (issue #20, "Performance"): GPT-1.3B-class with 8 experts in
every other block, ``ZeroStrategy(stage=2, expert_parallel=2)`` on 2 GPUs, against the dense model of
equal active parameters (the same GPT without MoE: top-1 routing activates one MLP per token) under
``zero2``; tokens/s, peak memory per GPU, the all-to-all share of the step and the dropped fraction (mean over
the timed batches and the MoE layers, per rank), with the routing's health ([Note: routing health]).

    torchrun --nproc-per-node 2 benchmarks/moe.py --config moe    # then --config dense; prints one JSON line
    torchrun --nproc-per-node 2 benchmarks/moe.py --config moe --smoke   # CPU/gloo, tiny model: a check

    torchrun --nproc-per-node 2 benchmarks/moe.py --config moe --dispatch capacity   # fixed-capacity buffers
    python -m benchmarks.moe --config moe --local   # one process, no Trainer: see [Note: local overhead]
    torchrun --nproc-per-node 2 benchmarks/moe.py --config moe --data random   # the random tokens of old

Run from the repository root with ``PYTHONPATH=.`` (benchmarks/ and examples/ are imported as packages).

Rank 0 prints the JSON line, then the record as a row of the RESULTS.md table (:func:`table_row`).

[Note: all-to-all share] ``collectives.all_to_all_single`` / ``all_to_all`` (the token exchange and its
count exchange, forward and backward) are wrapped for the timed steps with CUDA events recorded on the
current stream around each call: the interval covers the exchange and any wait for a slower peer (load
imbalance), which is what the step pays, since the expert computation needs the tokens. The share is
the sum of those intervals over the timed steps divided by their wall time. Target: below 20% on NVLink.

[Note: routing health] The 2026-11-29 EP 4 rows (RESULTS.md) dropped 84% of the assignments in the timed
steps, ``1 - 1.25/8``: the router had sent nearly every token to one expert during warm-up, so those steps
timed a degenerate load (under sorted dispatch one expert per rank does all the work). They trained on uniformly
random tokens (``--data random`` now); the default is real text (``--data text``: byte tokens of Python's
bundled documentation through examples/data.py, no download), the kind of load an MoE meets in use. Text is not
a cure by itself: on CPU (2 gloo ranks, ``--smoke --steps 20``) the run on text drops 1% at the first step and
30-55% from the fourth on (random tokens: 0-16%), and a 4-layer, 256-wide model with the 50304 vocabulary (one
process, 4 x 256 tokens a step) drops 47-74% at steps 3-5 on either data. The schedule (peak LR 1e-3 after 2
warm-up steps on a fresh model, aux loss 0.01) looks like the driver more than the data: at ``--lr 1e-4`` the
smoke run on text stays at 0-36% over 20 steps. So the routing is measured,
not assumed: the record carries the dropped fraction of every step (``dropped_fraction_steps``), of the first
step (the initial router) and of the last warm-up step, beside the timed mean, and ``routing_collapsed``: the
last warm-up step or the timed mean above ``--max-dropped`` on any rank. Its default is half of the *collapse
value* ``1 - capacity_factor / experts`` (top-1: the fraction dropped when every token picks one expert, whose
capacity keeps ``capacity_factor / experts`` of them): a router at least halfway from a balanced load (0
dropped) to a single expert; 0.42 for 8 experts at 1.25 (a fixed 0.5 would never fire with 2 experts, whose
collapse value is 0.375). A collapsed record marks its table row's dropped-fraction cell and prints a WARNING
line under it: its tokens/s time a degenerate routing.

[Note: balanced routing] On the GPT-1.3B class on 2 H200s (2026-11-29 17:09) the router dropped 46% at the first
step and collapsed within the warm-up even at ``--lr 1e-4``: a fresh deep model gives every token nearly the same
``ln_2`` input, and the aux loss needs far more steps than a benchmark runs. ``--routing balanced`` times the
layer at the load a trained router aims for: the learned gate's logits are computed as usual, then a large bias
sends token ``i`` of each micro-batch to expert ``i mod E`` (:class:`BalancedGate`). The gate's matmul, top-k,
capacity, dispatch, all-to-all and every expert's work are all in the step (forward and backward); only the
choice is fixed. The bias saturates the gate's softmax, so its weight's gradient is computed but zero: the
router does not learn in such a run. It is a benchmark setting, not a product one: the row says which routing
it timed.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import lightning_zero  # noqa: E402
from examples.data import WindowDataset, load_corpus, tokenize  # noqa: E402
from examples.gpt import GPTConfig, GPTModule  # noqa: E402
from examples.gpt_module import OptimConfig  # noqa: E402
from benchmarks.moe_profile import KernelProfiler, profile_table  # noqa: E402
from lightning_zero.comm import collectives as C  # noqa: E402
from lightning_zero.moe import MoE  # noqa: E402
from lightning_zero.moe.gating import Routing, TopKGate, topk_gating  # noqa: E402

BALANCE_BIAS = 1e4
"""Added to the chosen expert's logit under ``--routing balanced``: far above any learned logit gap."""


class BalancedGate(TopKGate):
    """The learned gate with token ``i`` sent to expert ``i mod E`` ([Note: balanced routing])."""

    def forward(self, x: torch.Tensor) -> Routing:
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        pick = torch.arange(logits.shape[0], device=logits.device) % self.num_experts
        logits = logits + torch.zeros_like(logits).scatter_(1, pick.unsqueeze(1), BALANCE_BIAS)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        return topk_gating(logits, self.top_k, factor, self.min_capacity, self.drop_tokens)

GPT_1B = dict(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=1024)
SMOKE = dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=64)


CAPACITY_FACTOR = 1.25
"""The MoE layers' training capacity factor (top-1)."""


class Tokens(Dataset):
    """Random token ids (``--data random``; the rows up to 2026-11-29): nothing for the router to split on."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


def text_windows(n: int, seq_len: int) -> WindowDataset:
    """``n`` next-token windows of ``seq_len`` byte tokens spread over the example's corpus (Python's documentation,
    ~466K bytes): non-overlapping where the corpus holds ``n`` of them, else with the stride that fits ``n``
    (GPT-1.3B's shape at 4 GPUs x 8 x 16 steps overlaps neighbours by ~11%): one epoch covers the run, so no
    epoch boundary falls among the timed steps."""
    tokens = tokenize(load_corpus("pydoc"))
    stride = max(1, min(seq_len, (tokens.numel() - seq_len - 1) // max(1, n - 1)))
    data = WindowDataset(tokens, seq_len, stride)
    if len(data) < n:
        raise ValueError(f"The corpus ({tokens.numel()} tokens) holds {len(data)} windows of {seq_len}, not {n}.")
    return data


def collapse_dropped(experts: int, capacity_factor: float = CAPACITY_FACTOR) -> float:
    """The dropped fraction of a top-1 router that sends every token to one expert ([Note: routing health])."""
    return max(0.0, 1.0 - capacity_factor / experts)


def routing_collapsed(record: dict[str, Any], max_dropped: float) -> bool:
    """Whether the routing in ``record`` degenerated: its last warm-up step or its timed mean dropped more than
    ``max_dropped`` of the assignments ([Note: routing health])."""
    return max(record["dropped_fraction_warmup_end"], record["dropped_fraction"]) > max_dropped


def collapse_warning(records: list[dict[str, Any]]) -> str | None:
    """The line printed under the table row when the routing of any rank's record collapsed (each record's own
    ``routing_collapsed``); None when every rank's routing is healthy."""
    bad = [(rank, r) for rank, r in enumerate(records) if r.get("routing_collapsed")]
    if not bad:
        return None
    figures = "; ".join(f"rank {rank} {r['dropped_fraction_init']:.1%} / {r['dropped_fraction_warmup_end']:.1%} / "
                        f"{r['dropped_fraction']:.1%}" for rank, r in bad)
    return (f"WARNING: routing collapsed: dropped at the first step / the end of warm-up / in the timed steps: "
            f"{figures} (max {bad[0][1]['max_dropped']:.1%}; every token on one expert drops "
            f"{bad[0][1]['collapse_dropped']:.1%}): the timed steps measure a degenerate routing")


class A2ATimer:
    """[Note: all-to-all share]: wraps the all-to-all collectives while ``active``."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.active, self.events, self.cpu_s = cuda, False, [], 0.0
        for name in ("all_to_all_single", "all_to_all"):
            setattr(C, name, self._wrap(getattr(C, name)))

    def _wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            if not self.cuda:
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                self.cpu_s += time.perf_counter() - t
                return out
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events.append((start, end))
            return out

        return timed

    def seconds(self) -> float:
        if not self.cuda:
            return self.cpu_s
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.events) / 1000.0


def layers_dropped_fraction(module: torch.nn.Module) -> torch.Tensor | None:
    """The mean over ``module``'s MoE layers of the fraction of assignments their last forward dropped by
    capacity (a device scalar, not read here: a host read per step would stall the GPU); None without MoE."""
    stats = [m.last_stats.dropped_fraction for m in module.modules() if getattr(m, "last_stats", None) is not None]
    return torch.stack(stats).float().mean() if stats else None


TABLE_HEADER = ("| config | GPUs | EP | experts | tokens/s | step s | all-to-all share (per rank) "
                "| dropped fraction (per rank) | peak GiB (per rank) |\n|---|---|---|---|---|---|---|---|---|")


def table_row(record: dict[str, Any], records: list[dict[str, Any]]) -> str:
    """``record`` (rank 0's) as a row under :data:`TABLE_HEADER`, the per-rank figures of ``records`` beside."""
    def ranks(key: str, fmt: str) -> str:
        return ", ".join(format(r[key], fmt) for r in records)

    config = record["config"] + (f" ({record['dispatch']})" if record.get("dispatch") else "")
    config += ", balanced routing" if record.get("routing") == "balanced" else ""
    collapsed = " **routing collapsed**" if record.get("routing_collapsed") else ""
    return (f"| {config} | {record['world']} | {record['ep']} | {record['experts']} "
            f"| {record['tokens_per_s']:,.0f} | {record['step_s']:.4f} "
            f"| {record['all_to_all_share']:.1%} ({ranks('all_to_all_share', '.1%')}) "
            f"| {record['dropped_fraction']:.2%} ({ranks('dropped_fraction', '.2%')}){collapsed} "
            f"| {record['peak_memory_gib']:.1f} ({ranks('peak_memory_gib', '.1f')}) |")


class _Experts(torch.nn.Module):
    """The expert MLPs alone on rows already grouped by expert: what the layer would cost without routing."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.experts = layer.experts

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        chunks = rows.chunk(len(self.experts))
        return torch.cat([e(c) for e, c in zip(self.experts, chunks)])


def local_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """[Note: local overhead] One MoE layer of GPT-1.3B's shape scaled down (``--local-hidden``, seq x micro-batch
    ``--local-tokens``, ``--experts`` local experts at EP 1, top-1, capacity factor 1.25), forward + backward, on
    this process's device: the time of the whole layer, of its expert MLPs alone on as many rows, and of the
    routing alone (the same layer with identity experts: gate, dispatch, combine); for the routing, the operators
    it issues (torch.profiler, top-level aten ops) and, on CUDA, its host synchronisations (sync debug mode
    warnings). Best of ``--local-repeats`` forward + backward passes each."""
    import warnings

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU box: one thread keeps the timings comparable
    h, n = args.local_hidden, args.local_tokens
    torch.manual_seed(0)
    mlp = lambda: torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))  # noqa
    layer = MoE(h, mlp, num_experts=args.experts, top_k=1, capacity_factor=1.25, min_capacity=4,
                dispatch=args.dispatch).to(device)
    experts = _Experts(layer)
    x = torch.randn(n, h, device=device, requires_grad=True)
    rows = torch.randn(n, h, device=device, requires_grad=True)

    def step(fn: Any, inp: torch.Tensor) -> None:
        fn(inp).sum().backward()

    def timed(fn: Any, inp: torch.Tensor) -> float:
        for _ in range(2):
            step(fn, inp)
        best = float("inf")
        for _ in range(args.local_repeats):
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            step(fn, inp)
            sync()
            best = min(best, time.perf_counter() - t)
        return best

    routing = copy.deepcopy(layer)  # the same routing with identity experts: the gate, dispatch and combine alone
    routing.experts = torch.nn.ModuleList(torch.nn.Identity() for _ in layer.experts)
    layer_s, experts_s, routing_s = timed(layer, x), timed(experts, rows), timed(routing, x)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(routing, x)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))
    syncs = None
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step(routing, x)
            torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    return {"mode": "local", "dispatch": args.dispatch, "hidden": h, "tokens": n, "experts": args.experts,
            "layer_ms": layer_s * 1e3, "experts_ms": experts_s * 1e3, "routing_ms": routing_s * 1e3,
            "routing_over_experts": routing_s / experts_s, "layer_over_experts": layer_s / experts_s,
            "routing_top_level_ops": ops, "routing_host_syncs": syncs,
            "dropped_fraction": float(layer.last_stats.dropped_fraction), "device": str(device)}


class StepClock(L.Callback):
    """Wall time of the steps after ``warmup``, all-to-all timing on for those steps; the dropped fraction of
    every step, warm-up included ([Note: routing health])."""

    def __init__(self, warmup: int, timer: A2ATimer, stop_at: int) -> None:
        self.warmup, self.timer, self.start, self.steps, self.stop_at = warmup, timer, 0.0, 0, stop_at
        self.elapsed: Optional[float] = None
        self.dropped: list[torch.Tensor] = []
        """Per batch from the first, the mean over MoE layers of the dropped fraction of its forward: device
        scalars, read once at the end (a host read per step would stall the GPU)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        dropped = layers_dropped_fraction(pl_module)
        if dropped is not None:
            self.dropped.append(dropped)
        if trainer.global_step == self.stop_at:
            self._stop(trainer)

    def dropped_fractions(self) -> list[float]:
        """The per-step dropped fractions, read to the host (empty without MoE layers)."""
        return torch.stack(self.dropped).tolist() if self.dropped else []

    def _sync(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self._sync()
            torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
            self.start, self.timer.active = time.perf_counter(), True

    def _stop(self, trainer: L.Trainer) -> None:
        """The end of the timed steps (``--profile``'s steps come after it, untimed)."""
        self._sync()
        self.elapsed = time.perf_counter() - self.start
        self.steps = trainer.global_step - self.warmup
        self.timer.active = False

    def on_train_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.elapsed is None:
            self._stop(trainer)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=["moe", "dense"], required=True)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=None, help="per GPU; default 8 (2 with --smoke)")
    p.add_argument("--steps", type=int, default=None, help="default 20 (4 with --smoke)")
    p.add_argument("--warmup", type=int, default=None, help="untimed first steps; default 5 (1 with --smoke)")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny model")
    p.add_argument("--data", choices=["text", "random"], default="text",
                   help="text: the example's corpus (Python's documentation, byte tokens); random: uniform token "
                        "ids, on which the router collapses ([Note: routing health])")
    p.add_argument("--lr", type=float, default=OptimConfig.lr, help="peak AdamW LR (after 2 warm-up steps)")
    p.add_argument("--max-dropped", type=float, default=None,
                   help="routing_collapsed above this dropped fraction; default half of 1 - 1.25/experts")
    p.add_argument("--dispatch", choices=["sorted", "capacity"], default="sorted",
                   help="the MoE layers' dispatch: sorted (moe/dispatch.py) or fixed-capacity (moe/capacity.py)")
    p.add_argument("--routing", choices=["learned", "balanced"], default="learned",
                   help="balanced: token i to expert i mod E, the learned gate still computed ([Note: balanced routing])")
    p.add_argument("--eager-merge", action="store_true", help="the per-step merge of writes outside the optimizer "
                   "in eager torch instead of its fused kernel (zero/merge_writes.py): the A/B of 2026-11-29")
    p.add_argument("--profile", action="store_true", help="two untimed steps after the timed ones under "
                   "torch.profiler: device time by kernel category (moe_profile.py)")
    p.add_argument("--local", action="store_true", help="one MoE layer, one process: [Note: local overhead]")
    p.add_argument("--local-hidden", type=int, default=512)
    p.add_argument("--local-tokens", type=int, default=4096)
    p.add_argument("--local-repeats", type=int, default=5)
    args = p.parse_args()
    if args.local:
        print(json.dumps(local_overhead(args)))
        return
    for name, full, smoke in (("micro_batch", 8, 2), ("steps", 20, 4), ("warmup", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if not 0 < args.warmup < args.steps:
        raise SystemExit(f"--warmup ({args.warmup}) must be at least 1 and below --steps ({args.steps}).")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.eager_merge:  # this process only: the benchmark's A/B switch, not a library setting
        import lightning_zero.zero.merge_writes as merge_writes

        merge_writes.fused_applies = lambda live, master: False
    moe = args.config == "moe"
    shape = SMOKE if args.smoke else GPT_1B
    cfg = GPTConfig(**shape, moe_experts=args.experts if moe else 0, moe_top_k=1,
                    moe_capacity_factor=CAPACITY_FACTOR)
    ep = args.ep if moe else 1
    L.seed_everything(0)
    module = GPTModule(cfg, max_steps=args.steps, fused=not args.smoke, warmup_steps=2, lr=args.lr,
                       expert_parallel=ep)
    for layer in module.modules():  # the layers exist by now (not deferred); capacity needs drop_tokens (default)
        if isinstance(layer, MoE):
            layer.dispatch = args.dispatch
            if args.routing == "balanced":
                layer.gate.__class__ = BalancedGate  # same parameters and hooks, the choice fixed
    timer = A2ATimer(cuda=not args.smoke)
    clock = StepClock(args.warmup, timer, stop_at=args.steps)
    profiler = KernelProfiler(start_after=args.steps) if args.profile else None
    trainer = L.Trainer(
        accelerator="cpu" if args.smoke else "gpu", devices=world, strategy=lightning_zero.ZeroStrategy(
            stage=2, expert_parallel=ep), precision="32-true" if args.smoke else "bf16-mixed",
        max_steps=args.steps + (profiler.steps if profiler else 0), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[clock] + ([profiler] if profiler else []),
    )
    samples = args.micro_batch * world * (args.steps + 3)
    text = args.data == "text"
    dataset = text_windows(samples, cfg.seq_len) if text else Tokens(samples, cfg.seq_len, cfg.vocab_size)
    # shuffled text: Lightning's DistributedSampler shuffles (seeded by seed_everything) and splits over the ranks
    data = DataLoader(dataset, batch_size=args.micro_batch, shuffle=text, num_workers=0)
    trainer.fit(module, train_dataloaders=data)
    tokens = clock.steps * args.micro_batch * world * cfg.seq_len
    a2a = timer.seconds()
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    dropped = clock.dropped_fractions()[: args.steps]  # per step from the first; [0.0] * steps without MoE layers
    dropped = dropped or [0.0] * args.steps
    collapse = collapse_dropped(cfg.moe_experts) if moe else 0.0
    max_dropped = args.max_dropped if args.max_dropped is not None else collapse / 2
    record = {
        "config": args.config, "dispatch": args.dispatch if moe else None, "routing": args.routing if moe else None,
        "merge": "eager" if args.eager_merge else "fused where it applies",
        "experts": cfg.moe_experts, "ep": ep,
        "world": world, "micro_batch": args.micro_batch,
        "params_per_rank": sum(p.numel() for p in module.parameters()),
        "tokens_per_s": tokens / clock.elapsed, "step_s": clock.elapsed / max(1, clock.steps),
        "peak_memory_gib": peak, "all_to_all_share": a2a / clock.elapsed if moe else 0.0,
        "data": args.data, "lr": args.lr, "dropped_fraction": sum(dropped[args.warmup:]) / len(dropped[args.warmup:]),
        "dropped_fraction_init": dropped[0], "dropped_fraction_warmup_end": dropped[args.warmup - 1],
        "dropped_fraction_steps": [round(d, 4) for d in dropped], "collapse_dropped": collapse,
        "max_dropped": max_dropped,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    record["routing_collapsed"] = moe and routing_collapsed(record, max_dropped)
    if profiler is not None:
        record["profile"] = profiler.result
    records = C.all_gather_object(record, None)
    if trainer.global_rank == 0:
        run = {**record, "routing_collapsed": any(r["routing_collapsed"] for r in records)}  # any rank's is the run's
        per_rank = {"peak_gib": "peak_memory_gib", "a2a_share": "all_to_all_share",
                    "dropped_fraction": "dropped_fraction", "dropped_fraction_init": "dropped_fraction_init",
                    "dropped_fraction_warmup_end": "dropped_fraction_warmup_end"}
        print(json.dumps({**run, **{f"per_rank_{k}": [r[v] for r in records] for k, v in per_rank.items()}}))
        print(TABLE_HEADER)
        print(table_row(run, records))
        warning = collapse_warning(records)
        if warning:
            print(warning)
        for r in records if args.profile else []:
            print(f"\nrank {records.index(r)}: " + profile_table(r["profile"]))


if __name__ == "__main__":
    main()
