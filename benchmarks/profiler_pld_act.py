"""Issue #19 on one GPU: flops profiler overhead, Progressive Layer Dropping, activation offload.

    python benchmarks/profiler_pld_act.py [--out DIR] [--sections prof,pld,act] [--budget-s 460]

Prints one markdown table per section (and writes them to ``DIR/profiler_pld_act.md``), all on the
same device in one run, in about 7 minutes on an H100/H200:

* ``prof``: a GPT-350M-shaped model (24 x 1024, seq 1024, micro-batch 8, bf16-mixed) under Lightning,
  20 steps without and with ``FlopsProfiler(profile_step=10)``: the profiled step's time against the
  median step (the profiler's overhead), the other steps against the run without it (zero), and the
  profiler's FLOPs per step against the 6N + attention formula, its TFLOP/s and MFU.
* ``pld``: the example GPT (Pre-LN, 24 x 1024, seq 512, micro-batch 16, bf16-mixed) on the built-in
  pydoc corpus, 300 steps without and with ``model.pld`` (theta 0.5, gamma 0.01): training time per
  sample, executed layers, and the validation loss every 50 steps; TensorBoard runs in ``DIR/tb``
  with ``val/loss`` against both the step and (``val_loss_vs_train_s``) the training seconds.
* ``act``: GPT-1.3B (24 x 2048, vocab 50304) at seq 2048 with fused AdamW and bf16 autocast: the
  largest micro-batch with plain block checkpointing and with ``lightning_zero.activations.checkpoint
  (offload='cpu')`` (each mode in a fresh process; exponential search then bisection, one step per
  attempt, OOM caught), and tokens/s of both at plain's largest micro-batch and of offload at its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
GPT_1B_SEQ2048 = dict(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, seq_len=2048)
"""conf/model/gpt_1b.yaml at the issue's sequence length."""
GPT_350M = dict(vocab_size=50304, n_layer=24, n_head=16, d_model=1024, seq_len=1024)
ACCELERATOR = "gpu"
"""What the Lightning sections train on (a CPU smoke test of this script sets "cpu" and shrinks the shapes)."""
PLD_GPT = dict(vocab_size=50304, n_layer=24, n_head=16, d_model=1024, seq_len=512)


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------- prof
def _random_loader(cfg: dict, batch: int, n: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    ids = torch.randint(0, cfg["vocab_size"], (n * batch, cfg["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=batch)


class StepTimer:
    """Wall time of every training batch, device synchronised at both ends."""

    def __new__(cls) -> Any:
        import lightning.pytorch as L

        class _Timer(L.Callback):
            def __init__(self) -> None:
                self.times: list[float] = []
                self.train_s = 0.0
                self._t = 0.0

            def on_train_batch_start(self, *args: Any) -> None:
                torch.cuda.synchronize()
                self._t = time.perf_counter()

            def on_train_batch_end(self, *args: Any) -> None:
                torch.cuda.synchronize()
                dt = time.perf_counter() - self._t
                self.times.append(dt)
                self.train_s += dt

        return _Timer()


def section_prof(out: Path) -> str:
    import lightning.pytorch as L
    from examples.gpt import GPTConfig, GPTModule, flops_per_token

    from lightning_zero.profiler import FlopsProfiler

    batch, steps, at = 8, 20, 10
    rows = []
    results: dict[str, Any] = {}
    for name, with_prof in (("without", False), ("with", True)):
        L.seed_everything(0)
        module = GPTModule(GPT_350M, warmup_steps=5, max_steps=steps, fused=True)
        timer = StepTimer()
        prof = FlopsProfiler(profile_step=at, module_depth=2, print_report=False) if with_prof else None
        trainer = L.Trainer(accelerator=ACCELERATOR, devices=1, precision="bf16-mixed", max_steps=steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer] + ([prof] if prof else []), default_root_dir=str(out / "prof"))
        trainer.fit(module, train_dataloaders=_random_loader(GPT_350M, batch, steps))
        results[name] = (timer.times, prof)
    base = statistics.median(results["without"][0][5:])
    times, prof = results["with"]
    others = statistics.median([t for i, t in enumerate(times) if i >= 5 and i != at])
    assert prof is not None and prof.totals is not None
    tokens = batch * GPT_350M["seq_len"]
    formula = flops_per_token(GPTConfig(**GPT_350M)) * tokens
    rows.append(["median step, no profiler", f"{base * 1e3:.1f} ms", "", ""])
    rows.append(["median step, profiler attached (other steps)", f"{others * 1e3:.1f} ms", f"{others / base:.3f}x", "zero overhead expected"])
    rows.append(["profiled step", f"{times[at] * 1e3:.1f} ms", f"{times[at] / others:.2f}x", "profiler overhead"])
    rows.append(["profiler FLOPs/step (fwd+bwd) / 6N+attn formula", f"{prof.totals.flops / 1e12:.2f} T / {formula / 1e12:.2f} T",
                 f"{prof.totals.flops / formula:.3f}", "bwd counted from the ops, no recompute here"])
    fps = formula / others
    rows.append(["TFLOP/s (profiled step, profiler's count)", f"{prof.totals.flops_per_s / 1e12:.1f}",
                 f"MFU {100 * (prof.totals.mfu or 0):.1f}%", f"peak {(prof.totals.peak_flops or 0) / 1e12:.0f} TFLOP/s dense bf16"])
    rows.append(["TFLOP/s (unprofiled median step, formula)", f"{fps / 1e12:.1f}", "", ""])
    (out / "flops_profile_gpt350m.txt").write_text(prof.report or "")
    return table(f"Flops profiler, GPT-350M shape, micro-batch {batch}, seq 1024, bf16-mixed ({torch.cuda.get_device_name()})",
                 ["what", "value", "ratio", "note"], rows)


# ---------------------------------------------------------------------------------------------- pld
def section_pld(out: Path, steps: int = 300) -> str:
    import lightning.pytorch as L
    from examples.data import TextDataModule
    from examples.gpt import GPTModule
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_zero.callbacks import ProgressiveLayerDrop

    cfg = dict(PLD_GPT)
    batch = 16

    class ValVsTime(L.Callback):
        def __init__(self, timer: Any) -> None:
            self.timer = timer
            self.points: list[tuple[int, float, float]] = []

        def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if trainer.sanity_checking:
                return
            loss = float(trainer.callback_metrics["val/loss"])
            self.points.append((trainer.global_step, self.timer.train_s, loss))
            trainer.logger.experiment.add_scalar("val_loss_vs_train_s", loss, global_step=int(round(self.timer.train_s * 1e3)))

    rows = []
    summary = {}
    for name, pld in (("baseline", False), ("pld", True)):
        L.seed_everything(0)
        module = GPTModule(dict(cfg, pld=pld, pld_theta=0.5, pld_gamma=0.01), lr=6e-4, warmup_steps=20, max_steps=steps,
                           fused=True)
        timer = StepTimer()
        curve = ValVsTime(timer)
        trainer = L.Trainer(accelerator=ACCELERATOR, devices=1, precision="bf16-mixed", max_steps=steps,
                            logger=TensorBoardLogger(str(out / "tb"), name=name, version=0), enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[timer, curve],
                            val_check_interval=50, limit_val_batches=20, num_sanity_val_steps=0, log_every_n_steps=10)
        trainer.fit(module, datamodule=TextDataModule(seq_len=cfg["seq_len"], batch_size=batch))
        plds = [c for c in trainer.callbacks if isinstance(c, ProgressiveLayerDrop)]
        executed = (sum(p.executed for p in plds[0].plans) / len(plds[0].plans)) if plds else cfg["n_layer"]
        per_sample = statistics.mean(timer.times[10:]) / batch
        summary[name] = (per_sample, curve.points)
        rows.append([name, f"{per_sample * 1e3:.3f} ms", f"{executed:.1f} / {cfg['n_layer']}",
                     " ".join(f"{loss:.3f}@{t:.0f}s" for _, t, loss in curve.points)])
    ratio = summary["pld"][0] / summary["baseline"][0]
    rows.append(["pld / baseline", f"{ratio:.3f}x time per sample", "", "TensorBoard: tb/{baseline,pld}"])
    return table(f"Progressive Layer Dropping, example GPT Pre-LN 24 x 1024, seq 512, micro-batch {batch}, {steps} steps "
                 f"(theta 0.5, gamma 0.01; {torch.cuda.get_device_name()})",
                 ["run", "train time per sample", "executed layers (mean)", "val loss @ training seconds"], rows)


# ---------------------------------------------------------------------------------------------- act
def act_worker(mode: str, compare_mb: Optional[int], deadline: float) -> dict[str, Any]:
    """One process: the largest micro-batch of ``mode`` ('plain' | 'offload') and tokens/s."""
    from examples.gpt import GPT, GPTConfig

    from lightning_zero.activations import HostOffloader, checkpoint

    torch.manual_seed(0)
    cfg = GPTConfig(**GPT_1B_SEQ2048, activation_checkpointing=(mode == "plain"))
    with torch.device("cuda"):
        model = GPT(cfg)
    offloader = HostOffloader()
    if mode == "offload":
        for block in model.blocks:
            checkpoint(block, offload="cpu", offloader=offloader)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    seq = cfg.seq_len

    def step(mb: int) -> None:
        ids = torch.randint(0, cfg.vocab_size, (mb, seq + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
        del logits
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def fits(mb: int) -> bool:
        try:
            step(mb)
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            pass
        # outside the except block: its traceback no longer holds the failed step's tensors
        opt.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return False

    def tokens_per_s(mb: int, warm: int = 2, timed: int = 4) -> Optional[float]:
        if not fits(mb):
            return None
        for _ in range(warm - 1):
            step(mb)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(timed):
            step(mb)
        torch.cuda.synchronize()
        return mb * seq * timed / (time.perf_counter() - t)

    assert fits(1), "GPT-1.3B at micro-batch 1 does not fit"
    ok, bad = 1, None
    mb = 2
    while bad is None and time.time() < deadline:  # grow until the first failure
        if fits(mb):
            ok, mb = mb, mb * 2
        else:
            bad = mb
        if mb > 512:
            break
    while bad is not None and bad - ok > 1 and time.time() < deadline:  # then bisect
        mid = (ok + bad) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    torch.cuda.reset_peak_memory_stats()
    own = tokens_per_s(ok)
    peak = torch.cuda.max_memory_allocated() / 2**30
    result = {"mode": mode, "max_mb": ok, "first_oom": bad, "tokens_per_s_at_max": own, "peak_gib_at_max": peak,
              "host_gib": offloader.stats.peak_bytes / 2**30}
    if compare_mb is not None and compare_mb != ok:
        result["tokens_per_s_at_compare"] = tokens_per_s(compare_mb)
    return result


def section_act(out: Path, deadline: float) -> str:
    results = {}
    compare: Optional[int] = None
    for mode in ("plain", "offload"):
        left = max(30.0, (deadline - time.time()) / (2 if mode == "plain" else 1))
        cmd = [sys.executable, __file__, "--act-worker", mode, "--act-deadline", str(time.time() + left - 25)]
        if compare is not None:
            cmd += ["--compare-mb", str(compare)]
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # the checkout first
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left + 60, cwd=REPO,
                              env=dict(os.environ, PYTHONPATH=path))
        (out / f"act_{mode}.log").write_text(proc.stdout + proc.stderr)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            return f"### Activation offload\n\n{mode} failed (rc {proc.returncode}):\n```\n{proc.stderr[-2000:]}\n```\n"
        results[mode] = json.loads(line[len("RESULT "):])
        if mode == "plain":
            compare = results["plain"]["max_mb"]
    p, o = results["plain"], results["offload"]
    same = o.get("tokens_per_s_at_compare", o["tokens_per_s_at_max"] if o["max_mb"] == p["max_mb"] else None)

    def k(x: Optional[float]) -> str:
        return f"{x / 1e3:.1f}k" if x else "-"

    rows = [
        ["plain checkpointing (torch, non-reentrant)", p["max_mb"], p["first_oom"], k(p["tokens_per_s_at_max"]), f"{p['peak_gib_at_max']:.1f}", "0"],
        ["checkpoint(offload='cpu')", o["max_mb"], o["first_oom"], k(o["tokens_per_s_at_max"]), f"{o['peak_gib_at_max']:.1f}", f"{o['host_gib']:.1f}"],
        [f"offload at plain's micro-batch {p['max_mb']}", p["max_mb"], "", k(same), "", ""],
    ]
    ratio_mb = o["max_mb"] / p["max_mb"]
    ratio_tps = (same / p["tokens_per_s_at_max"]) if same and p["tokens_per_s_at_max"] else float("nan")
    rows.append(["offload / plain", f"{ratio_mb:.2f}x micro-batch", "", f"{ratio_tps:.3f}x tokens/s at the same micro-batch",
                 "", "target: >= 1.5x micro-batch, >= 0.90x tokens/s"])
    return table(f"Activation offload, GPT-1.3B seq 2048, one {torch.cuda.get_device_name()}, fused AdamW, bf16 autocast",
                 ["mode", "largest micro-batch", "first OOM", "tokens/s at its largest", "peak GiB", "pinned host GiB (peak)"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--sections", default="prof,pld,act")
    ap.add_argument("--budget-s", type=float, default=460.0)
    ap.add_argument("--pld-steps", type=int, default=300)
    ap.add_argument("--act-worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--act-deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--compare-mb", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.act_worker:
        print("RESULT " + json.dumps(act_worker(args.act_worker, args.compare_mb, args.act_deadline)), flush=True)
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profiler_pld_act.py needs a CUDA device")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    deadline = start + args.budget_s
    report = []
    for section in args.sections.split(","):
        t0 = time.time()
        try:
            if section == "prof":
                text = section_prof(out)
            elif section == "pld":
                text = section_pld(out, args.pld_steps)
            elif section == "act":
                text = section_act(out, deadline)
            else:
                raise SystemExit(f"unknown section {section!r}")
        except Exception:  # a failing section never stops the next one
            import traceback

            text = f"### {section}: failed\n\n```\n{traceback.format_exc()[-3000:]}\n```\n"
        text += f"\n({section}: {time.time() - t0:.0f} s)\n"
        print(text, flush=True)
        report.append(text)
        torch.cuda.empty_cache()
    (out / "profiler_pld_act.md").write_text("\n".join(report))
    print(f"total {time.time() - start:.0f} s; tables in {out / 'profiler_pld_act.md'}")


if __name__ == "__main__":
    main()
