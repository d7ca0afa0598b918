"""Offload benchmark: lightning_zero's ZeRO-Offload/Infinity against Lightning's peers, side by side.

Trains the example GPT (``examples/gpt.py``) for a few steps per configuration, each in its own process
(CUDA memory, pinned pools and DeepSpeed's global state never leak into the next one), and prints a
markdown table: tokens/s, seconds per step, peak GPU memory, peak host memory (RSS), and the ratios the
offload issue targets (``zero3_offload`` >= 2x ``fsdp_cpu_offload`` and >= 3x ``deepspeed_stage_3_offload``, each peer
in its best documented configuration (``SETUP``, printed under the table); ``*_offload_auto`` (partial offload,
``offload_ratio='auto'``) at most 1.3x the step of the same stage without offload;
``zero2_offload`` >= 0.75x ``zero2``). On the GPU machine::

    python benchmarks/offload.py --model gpt_2.65b --micro-batch 8
    python benchmarks/offload.py --model gpt_1b --micro-batch 16 --configs zero2,zero2_offload
    python benchmarks/offload.py --model gpt_6b --configs zero3_offload --steps 5 --warmup 1   # largest model
    python benchmarks/offload.py --model gpt_10b --configs zero3_offload_nvme_opt --nvme-path /local_nvme \
        --nvme-fraction 0.5 --steps 5 --warmup 1     # fraction: see python -m lightning_zero.estimate --params 10e9
    python benchmarks/offload.py --device cpu --model tiny --steps 2 --warmup 1               # CPU smoke mode

Models: any ``conf/model/<name>.yaml`` (``gpt_tiny``/``tiny``, ``gpt_small``, ``gpt_1b``) or one of the
built-in shapes below (GPT-2 vocabulary, seq 1024). Models are built in ``configure_model`` (sharded
initialisation where the strategy supports it), trained on random tokens with AdamW, bf16-mixed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

SHAPES: dict[str, dict[str, int]] = {
    "gpt_2.65b": dict(vocab_size=50304, n_layer=32, n_head=32, d_model=2560, seq_len=1024),
    "gpt_6b": dict(vocab_size=50304, n_layer=32, n_head=32, d_model=4096, seq_len=1024),
    "gpt_10b": dict(vocab_size=50304, n_layer=48, n_head=32, d_model=4096, seq_len=1024),
    "gpt_10.1b": dict(vocab_size=50304, n_layer=49, n_head=32, d_model=4096, seq_len=1024),
    "gpt_13b": dict(vocab_size=50304, n_layer=40, n_head=40, d_model=5120, seq_len=1024),
}
"""Shapes beyond conf/model: the issue's 2.65B workload and the 'largest model' candidates."""

ALIASES = {"tiny": "gpt_tiny", "small": "gpt_small", "1b": "gpt_1b"}

ZERO = {
    "zero2": dict(stage=2),
    "zero3": dict(stage=3),
    "zero1_offload": dict(stage=1, offload_optimizer="cpu"),
    "zero2_offload": dict(stage=2, offload_optimizer="cpu"),
    "zero2_offload_after": dict(stage=2, offload_optimizer="cpu", offload_step_in_backward=False),
    "zero2_offload_dpu": dict(stage=2, offload_optimizer="cpu", delayed_param_update=True,
                              delayed_param_update_warmup=2),
    "zero3_offload": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "zero3_offload_after": dict(stage=3, offload_optimizer="cpu", offload_params="cpu", offload_step_in_backward=False),
    # nonfinite='skip' (the default) runs the CPU step after backward; 'ignore' lets it run during backward
    "zero3_offload_ignore": dict(stage=3, offload_optimizer="cpu", offload_params="cpu", nonfinite="ignore"),
    "zero2_offload_ignore": dict(stage=2, offload_optimizer="cpu", nonfinite="ignore"),
    "zero3_offload_dpu": dict(stage=3, offload_optimizer="cpu", offload_params="cpu", delayed_param_update=True,
                              delayed_param_update_warmup=2),
    "zero3_offload_opt": dict(stage=3, offload_optimizer="cpu"),
    "zero3_offload_nvme": dict(stage=3, offload_optimizer="nvme", offload_params="nvme"),
    "zero3_offload_nvme_opt": dict(stage=3, offload_optimizer="nvme", offload_params="cpu"),
    "zero3_offload_auto": dict(stage=3, offload_optimizer="cpu", offload_ratio="auto"),
    "zero3_offload_half": dict(stage=3, offload_optimizer="cpu", offload_ratio=0.5),
    "zero2_offload_auto": dict(stage=2, offload_optimizer="cpu", offload_ratio="auto"),
    "zero3_offload_bf16_sr": dict(stage=3, offload_optimizer="cpu", offload_params="cpu", offload_state_precision="bf16_sr"),
    "zero3_offload_int8": dict(stage=3, offload_optimizer="cpu", offload_params="cpu", offload_state_precision="int8"),
}
SETUP = {
    "fsdp_cpu_offload": "Lightning FSDPStrategy(cpu_offload=True, auto_wrap_policy={Block}, FULL_SHARD), "
                        "torch.optim.AdamW(fused=True) stepping on the CPU (torch's fused CPU kernel)",
    "deepspeed_stage_3_offload": "Lightning DeepSpeedStrategy, ZeRO-3, offload_optimizer and offload_param to "
                                 "cpu with pin_memory=True, DeepSpeed's own AdamW (DeepSpeedCPUAdam), bf16",
}
"""Each peer's configuration, printed beside its figures (the best its documentation advises)."""
PEERS = ("fsdp_cpu_offload", "deepspeed_stage_3_offload")
DEFAULT = ("zero3_offload", "zero3_offload_after", "zero3_offload_dpu", "fsdp_cpu_offload", "deepspeed_stage_3_offload")
"""``*_after``: the CPU step after backward instead of during it (offload_step_in_backward=False, as with
clipping or accumulation); ``*_dpu``: the delayed parameter update."""


# ---------------------------------------------------------------------------------------------------- model
def model_shape(name: str) -> dict[str, Any]:
    name = ALIASES.get(name, name)
    if name in SHAPES:
        return dict(SHAPES[name])
    path = Path(name) if name.endswith((".yaml", ".yml")) else REPO / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        raise SystemExit(f"unknown --model {name!r}: use {sorted(SHAPES)} or a conf/model preset")
    out: dict[str, Any] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if ":" in line:
            key, value = (x.strip() for x in line.split(":", 1))
            out[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value)
    return out


# ---------------------------------------------------------------------------------------------------- worker
def _repo_pythonpath() -> str:
    """The child's PYTHONPATH: the checkout first (it imports ``lightning_zero``, ``benchmarks`` and ``examples``)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """Build the strategy, train warmup + steps on random tokens, return timings and memory."""
    import lightning.pytorch as L
    import torch
    from torch.utils.data import DataLoader, Dataset

    from examples.gpt import GPT, GPTModule

    cfg = model_shape(args.model)
    cuda = args.device == "cuda"

    class LazyGPT(GPTModule):
        """The network is built in configure_model: sharded initialisation under ZeRO-3/FSDP/DeepSpeed."""

        def _build_model(self) -> Any:
            return None

        def configure_model(self) -> None:
            if self.model is None:
                self.model = GPT(self.config)

    class RandomTokens(Dataset):
        def __len__(self) -> int:
            return 10**6

        def __getitem__(self, i: int) -> Any:
            g = torch.Generator().manual_seed(i)
            row = torch.randint(0, cfg["vocab_size"], (cfg["seq_len"] + 1,), generator=g)
            return row[:-1], row[1:]

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.t0 = 0.0

        def on_train_batch_start(self, *a: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.t0)
            print(f"step {len(self.times)}: {self.times[-1]:.3f} s", file=sys.stderr, flush=True)  # progress

    strategy: Any
    if args.config in ZERO:
        from lightning_zero import ZeroStrategy

        kw = dict(ZERO[args.config])
        if "nvme" in (kw.get("offload_optimizer"), kw.get("offload_params")):
            kw["nvme_path"] = args.nvme_path
            kw["nvme_fraction"] = args.nvme_fraction
        strategy = ZeroStrategy(**kw)
    elif args.config == "fsdp_cpu_offload":
        if not cuda:
            return {"status": "skipped", "reason": "FSDP CPU offload needs CUDA"}
        from examples.gpt import Block
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(cpu_offload=True, auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    elif args.config == "deepspeed_stage_3_offload":
        if not cuda:
            return {"status": "skipped", "reason": "DeepSpeed offload needs CUDA"}
        try:
            import deepspeed  # noqa: F401  (importable, or a row with the reason)
        except Exception as err:  # not installed or not importable: a row with the reason
            return {"status": "skipped", "reason": f"deepspeed not importable: {type(err).__name__}: {err}"[:200]}
        from lightning.pytorch.strategies import DeepSpeedStrategy

        # DeepSpeed refuses a client torch optimizer under offload; give it its own CPU Adam (its best case).
        ds_config = {
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": {"device": "cpu", "pin_memory": True}},
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "bf16": {"enabled": True},
        }
        strategy = DeepSpeedStrategy(config=ds_config)
    else:
        raise SystemExit(f"unknown config {args.config}")

    L.seed_everything(0)
    # fused=True: torch's fused AdamW for every torch optimizer here (GPU masters of zero2/zero3/fsdp, and
    # the FSDP peer's CPU parameters, where torch's default single-tensor CPU AdamW is ~4x slower: not a peer's
    # best configuration). ZeRO offload steps with its own CPU Adam op either way; DeepSpeed with its own.
    module = LazyGPT(cfg, max_steps=args.warmup + args.steps, warmup_steps=2, fused=True)
    timer = Timer()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, strategy=strategy, precision="bf16-mixed",
        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )
    loader = DataLoader(RandomTokens(), batch_size=args.micro_batch, num_workers=2 if cuda else 0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, train_dataloaders=loader)
    timed = timer.times[args.warmup:]
    step_s = sum(timed) / max(1, len(timed))
    params = sum(p.numel() for p in module.parameters())
    return {
        "status": "ok", "params": params, "step_s": step_s,
        "tokens_per_s": args.micro_batch * cfg["seq_len"] / step_s if step_s else 0.0,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
        "steps_in_backward": sum(getattr(e, "eager_steps", 0) for e in getattr(trainer.strategy, "engines", [])),
        "chosen_ratio": next((getattr(e, "chosen_ratio") for e in getattr(trainer.strategy, "engines", [])
                              if hasattr(e, "chosen_ratio")), None),
    }


# ---------------------------------------------------------------------------------------------------- parent
def run_config(args: argparse.Namespace, config: str) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, __file__, "--worker", "--config", config, "--json", out.name, "--model", args.model,
               "--micro-batch", str(args.micro_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--device", args.device, "--nvme-path", args.nvme_path, "--nvme-fraction", str(args.nvme_fraction)]
        t0 = time.time()
        with HostMemoryWatch() as watch:
            try:
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.config_timeout_s,
                                      env=dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONPATH=_repo_pythonpath()))
            except subprocess.TimeoutExpired as err:
                partial = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
                steps = [line for line in partial.splitlines() if line.startswith("step ")]
                return {"config": config, "status": "failed", "host_min_free_gib": watch.min_free_gib,
                        "reason": f"timeout after {args.config_timeout_s:.0f}s; {len(steps)} steps done ("
                                  + ", ".join(x.split(': ')[1] for x in steps) + ")"}
        text = Path(out.name).read_text()
    if proc.returncode != 0 or not text:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"config": config, "status": "failed", "host_min_free_gib": watch.min_free_gib,
                "reason": f"exit code {proc.returncode}; least host memory available during the run "
                          f"{watch.min_free_gib:.1f} GiB; " + " / ".join(tail)[:300]}
    rec = json.loads(text)
    rec.update(config=config, wall_s=time.time() - t0, host_min_free_gib=watch.min_free_gib)
    return rec


class HostMemoryWatch:
    """Samples the host's MemAvailable while a worker runs: the least seen says how close a run came to the
    out-of-memory killer (which ends a worker with exit code -9 and no traceback)."""

    def __init__(self, period_s: float = 0.5) -> None:
        self.period_s = period_s
        self.min_free_gib = float("inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                self.min_free_gib = min(self.min_free_gib, int(line.split()[1]) / 2**20)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def __enter__(self) -> "HostMemoryWatch":
        if Path("/proc/meminfo").exists():
            self._sample()
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def table(records: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def f(x: Optional[float], fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    ok = {r["config"]: r for r in records if r.get("status") == "ok"}
    params = next((r["params"] for r in ok.values()), None)
    lines = [
        f"Offload benchmark: model {args.model} ({f(params / 1e6 if params else None, ',.1f')}M parameters), "
        f"micro-batch {args.micro_batch}, bf16-mixed, 1 {args.device.upper()}, {args.steps} timed steps after "
        f"{args.warmup} warm-up.",
        "",
        "| config | tokens/s | s/step | GPU peak (GiB) | host peak RSS (GiB) | host free, least (GiB) | status |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        if r.get("status") == "ok":
            lines.append(f"| {r['config']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {f(r['gpu_peak_gib'], '.1f')} | "
                         f"{r['host_peak_gib']:.1f} | {f(r.get('host_min_free_gib'), '.1f')} | ok"
                         + (f" ({r['steps_in_backward']} steps in backward)" if r.get("steps_in_backward") else "") + " |")
        else:
            lines.append(f"| {r['config']} | - | - | - | - | {f(r.get('host_min_free_gib'), '.1f')} | "
                         f"{r['status']}: {r.get('reason', '')} |")
    targets = [("zero3_offload", "fsdp_cpu_offload", 2.0), ("zero3_offload", "deepspeed_stage_3_offload", 3.0),
               ("zero3_offload_auto", "zero3", 1 / 1.3), ("zero2_offload_auto", "zero2", 1 / 1.3),
               ("zero3_offload_dpu", "fsdp_cpu_offload", 2.0), ("zero2_offload", "zero2", 0.75),
               ("zero2_offload_dpu", "zero2", 0.75), ("zero2_offload_after", "zero2", 0.75),
               ("zero3_offload_after", "fsdp_cpu_offload", 2.0), ("zero3_offload_after", "deepspeed_stage_3_offload", 3.0)]
    checks = []
    for a, b, want in targets:
        if a in ok and b in ok:
            ratio = ok[a]["tokens_per_s"] / ok[b]["tokens_per_s"]
            checks.append(f"- {a} / {b}: {ratio:.2f}x (target >= {want:.2f}x): {'PASS' if ratio >= want else 'FAIL'}")
    if checks:
        lines += ["", *checks]
    peers = [c for c in SETUP if any(r["config"] == c for r in records)]
    if peers:
        lines += ["", "Peers' configurations:", *(f"- {c}: {SETUP[c]}" for c in peers)]
    auto = [r for r in ok.values() if r.get("chosen_ratio") is not None]
    if auto:
        lines += ["", *(f"- {r['config']}: offload_ratio='auto' chose {r['chosen_ratio']:.3f} on the host" for r in auto)]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {sorted(ZERO) + list(PEERS)}")
    p.add_argument("--model", default="gpt_2.65b")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--nvme-path", default=tempfile.gettempdir(), help="nvme_path of the *_nvme configs")
    p.add_argument("--nvme-fraction", type=float, default=1.0, help="nvme_fraction of the *_nvme configs "
                   "(python -m lightning_zero.estimate suggests one for the machine)")
    p.add_argument("--config-timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="also write the records (JSON) and table here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        try:
            rec = worker(args)
        except Exception as err:  # OOM, a peer's failure: a row with the reason, never a crashed run
            traceback.print_exc()
            rec = {"status": "failed", "reason": f"{type(err).__name__}: {err}"[:300]}
        Path(args.json).write_text(json.dumps(rec))
        return 0
    if args.configs:
        configs = args.configs.split(",")
    elif args.device == "cpu":
        configs = ["zero2", "zero2_offload", "zero3_offload", "zero3_offload_dpu", "zero3_offload_nvme", *PEERS]
    else:
        configs = list(DEFAULT)
    unknown = [c for c in configs if c not in ZERO and c not in PEERS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {sorted(ZERO) + list(PEERS)}")
    records = []
    for config in configs:
        print(f"[offload benchmark] {config} ...", file=sys.stderr, flush=True)
        records.append(run_config(args, config))
    text = table(records, args)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "offload.json").write_text(json.dumps(records, indent=1))
        (args.out / "offload.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
