"""LoRA fine-tuning of a frozen Llama-style model: lightning_zero's ``zero3`` against Lightning's FSDP,
DeepSpeed stage 3 and DDP, side by side, in one run.

The workload: a random-weight ``transformers.LlamaForCausalLM`` of Llama-3-8B's shape (32 layers,
hidden 4096, FFN 14336, 32 heads / 8 KV heads, vocab 128256, untied head, SDPA attention) wrapped by
``peft.get_peft_model`` with LoRA r=16 (alpha 32, no dropout) on every attention and MLP projection,
so the frozen base (8.03 G parameters) dominates the 42 M trainable ones; seq 2048, micro-batch 2 per
GPU, random tokens, causal LM loss, torch AdamW over the LoRA parameters only (fused=True on GPU).
Targets (same-run ratios): ``zero3`` per-GPU peak memory below ``fsdp``'s (configured as Lightning's
docs advise for fine-tuning a transformer) and ``deepspeed_stage_3``'s, tokens/s at least 1.0x ``fsdp``'s.

Configurations (``lora_worker.CONFIGS`` builds them; each peer's exact settings, read back from the
strategy object as it ran, are written beside its figures):

* ``zero3``: ``lightning_zero.ZeroStrategy(stage=3)``, ``bf16-mixed`` (16-bit weights in the model,
  fp32 masters for the trainable parameters only);
* ``fsdp``: ``FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD",
  use_orig_params=True, limit_all_gathers=True, cpu_offload=False)``, ``bf16-true`` (LitGPT's LoRA
  recipe on Lightning's FSDP); ``fsdp_mixed``: the same with ``bf16-mixed``;
* ``deepspeed_stage_3``: Lightning's ``DeepSpeedStrategy(stage=3)`` with its defaults, ``bf16-mixed``;
* ``fsdp_peft`` (extra): ``fsdp`` with peft's documented FSDP wrap policy for LoRA
  (``peft.utils.other.fsdp_auto_wrap_policy``: each LoRA A/B its own FSDP unit, so the decoder layers'
  units are wholly frozen and FSDP computes and keeps no gradients for them);
* ``ddp`` (extra): Lightning's ``ddp``, ``bf16-true`` (a reference row: a full bf16 replica per GPU).

The fastest FSDP variant that ran is "the fsdp peer"; ``zero3``'s targets are checked against every
variant (passing against all of them is passing against the peer, whichever it is).

Every configuration builds the model in ``LightningModule.configure_model`` in its strategy's own
initialisation context (no process materialises the fp32 model on its GPU): see lora_worker.py's
[Note: building the model]. The same activation-checkpointing setting applies to all (off; ``--act-ckpt``
turns on HF's non-reentrant gradient checkpointing for every configuration).

    python3 benchmarks/lora.py --gpus 2 --write-results --budget-s 480          # the 8B workload
    python3 benchmarks/lora.py --gpus 2 --configs zero3,fsdp --layers 8 --steps 5
    python3 benchmarks/lora.py --device cpu --model tiny --gpus 2 --configs ddp,zero3 --steps 2 --warmup 1
    python3 benchmarks/lora.py --from-results runs/lora/<run>/results.jsonl     # re-render a run's table

As ``peers.py`` (whose process handling this reuses): one process tree per configuration
(``torchrun --nproc-per-node N lora_worker.py``), this parent never imports torch, a configuration
that fails or hangs past ``--config-timeout-s`` becomes a row with the reason, ``--budget-s`` bounds
the whole run (configurations that no longer fit are listed as skipped) and the table is always printed.
Peak memory is reported twice: over the whole run (model build, strategy set-up, warm-up and timed
steps: the targets use this one) and over the timed steps only (the peak statistics reset after the
warm-up), with what is allocated when training starts (the model states each strategy keeps).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import platform
import sys
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
from benchmarks.peers import (  # noqa: E402
    _note, add_runner_args, child_env, dist_version, nvidia_smi, run_benchmark, run_once, select_configs, worker_launch,
)
from benchmarks.peers_report import (  # noqa: E402
    GIB, Row, Target, _attempt_records, _escape, _fmt, _fmt_count, _fmt_tokens, _versions_line,
    build_row, meta_record, render_targets,
)
from benchmarks.presets import (  # noqa: E402
    LORA, LORA_BASELINE, LORA_FSDP_VARIANTS, LORA_PEERS, LORA_PRECISION, llama_lora_counts, llama_preset,
)

WORKER = HERE / "lora_worker.py"

STATIC_DESC: dict[str, str] = {
    "zero3": "ZeroStrategy(stage=3), defaults",
    "fsdp": ("FSDPStrategy(sharding_strategy=FULL_SHARD, auto_wrap_policy={LlamaDecoderLayer}, use_orig_params=True, "
             "limit_all_gathers=True, cpu_offload=False)"),
    "fsdp_mixed": ("FSDPStrategy(sharding_strategy=FULL_SHARD, auto_wrap_policy={LlamaDecoderLayer}, "
                   "use_orig_params=True, limit_all_gathers=True, cpu_offload=False)"),
    "deepspeed_stage_3": "DeepSpeedStrategy(stage=3), Lightning's defaults",
    "fsdp_peft": ("FSDPStrategy(sharding_strategy=FULL_SHARD, auto_wrap_policy=peft.utils.other.fsdp_auto_wrap_policy(model), "
                  "use_orig_params=True, limit_all_gathers=True, cpu_offload=False)"),
    "ddp": "DDPStrategy defaults",
}
"""What each configuration is, for rows whose workers never reported (the workers report the settings
as they ran)."""


def lora_targets(gpus: int) -> tuple[Target, ...]:
    """The issue's targets: zero3 peak memory below fsdp's and deepspeed_stage_3's, tokens/s at least
    fsdp's; checked against every FSDP variant (the fastest is the peer: passing against all of them
    is passing against it)."""
    g = min(gpus, 2)
    tokens = tuple(Target(g, "zero3", "tokens", v, 1.0, "LoRA") for v in LORA_FSDP_VARIANTS)
    memory = tuple(Target(g, "zero3", "memory", v, 1.0, "LoRA") for v in (*LORA_FSDP_VARIANTS, "deepspeed_stage_3"))
    return tokens + memory


# ---------------------------------------------------------------------------------------------------- arguments


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="GPUs (CPU processes with --device cpu) per configuration")
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {list(LORA_PEERS)} (default: all)")
    p.add_argument("--model", default="8b", help="llama_8b/8b (default) or llama_tiny/tiny")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of decoder layers")
    p.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length (8b: 2048)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per GPU per step")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--act-ckpt", action="store_true", help="HF gradient checkpointing for every configuration")
    add_runner_args(p, config_timeout_s=200.0, min_config_s=60.0)
    args = p.parse_args(argv)
    if args.gpus < 1 or args.steps < 1 or args.warmup < 0 or args.micro_batch < 1:
        p.error("--gpus, --steps and --micro-batch must be >= 1 and --warmup >= 0")
    select_configs(p, args, list(LORA_PEERS), list(LORA_PEERS))
    try:
        llama_preset(args.model, args.layers, args.seq_len)
    except ValueError as exc:
        p.error(str(exc))
    return args


# ---------------------------------------------------------------------------------------------------- running


def worker_cmd(args: argparse.Namespace, config: str, results: Path) -> list[str]:
    """python (1 process) or torchrun (N processes) on lora_worker.py."""
    launch = worker_launch(args.gpus)
    cmd = launch + [
        str(WORKER), "--config", config, "--model", args.model, "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
        "--devices", str(args.gpus), "--results-file", str(results),
    ]
    if args.layers is not None:
        cmd += ["--layers", str(args.layers)]
    if args.seq_len is not None:
        cmd += ["--seq-len", str(args.seq_len)]
    return cmd + (["--act-ckpt"] if args.act_ckpt else [])


def run_config(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float]) -> None:
    """Run one configuration once; record every outcome (a skip, a failure, a timeout) as a row."""
    family = LORA_PEERS[config]
    if family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        _note(results, config, 0, kind="error", status="skipped", rank=0, reason="deepspeed is not installed")
        return
    run_once(args, config, results, out_dir, deadline, lambda f: worker_cmd(args, config, f),
             child_env(args, family), WORKER.name, label=LORA_PRECISION[config])


# ---------------------------------------------------------------------------------------------------- report


def _extras(records: list[dict[str, Any]], config: str) -> dict[str, Any]:
    """What the LoRA table shows beyond peers_report's Row: the timed-steps peak, the memory allocated
    when training starts (max over ranks), and the configuration as it ran (rank 0's record)."""
    ranks = sorted((r for r in _attempt_records(records, config) if r.get("kind") == "rank"), key=lambda r: r["rank"])
    if not ranks:
        return {"desc": STATIC_DESC[config], "built": "", "shims": []}
    return {
        "timed_gib": max(r.get("peak_timed_bytes", 0) for r in ranks) / GIB,
        "start_gib": max(r.get("start_allocated_bytes", 0) for r in ranks) / GIB,
        "desc": ranks[0].get("config_desc") or STATIC_DESC[config],
        "built": ranks[0].get("built", ""),
        "shims": ranks[0].get("shims", []),
        "fused": ranks[0].get("fused"),
    }


def fsdp_peer(rows: list[Row]) -> Optional[Row]:
    """The fastest FSDP variant that ran (None if none did)."""
    ok = [r for r in rows if r.config in LORA_FSDP_VARIANTS and r.status == "ok" and r.tokens_per_s]
    return max(ok, key=lambda r: r.tokens_per_s or 0.0) if ok else None


def render_table(rows: list[Row], extras: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    cuda = meta.get("device_type", "cuda") == "cuda"
    base = fsdp_peer(rows) or next((r for r in rows if r.config == LORA_BASELINE and r.status == "ok"), None)
    base_name = base.config if base is not None else LORA_BASELINE
    mem = "GiB/GPU" if cuda else "GiB RSS/proc"
    head = ["config", "precision", "tokens/s", f"× `{base_name}`", "TFLOP/s/GPU", "MFU", f"peak, whole run ({mem})",
            f"peak, timed steps ({mem})", f"allocated at start ({mem})", "step (ms)", "loss", "configuration (as run)",
            "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        x = extras.get(r.config, {})
        ratio = r.tokens_per_s / base.tokens_per_s if base and base.tokens_per_s and r.tokens_per_s else None
        cells = [
            f"`{r.config}`" if r.status == "ok" else f"`{r.config}` ({r.status})",
            f"`{LORA_PRECISION.get(r.config, '?')}`",
            _fmt_tokens(r.tokens_per_s),
            _fmt(ratio, ".2f"),
            _fmt(r.tflops_per_gpu, ".0f" if cuda else ".3f"),
            _fmt(r.mfu * 100 if r.mfu is not None else None, ".0f") + ("%" if r.mfu is not None else ""),
            _fmt(r.peak_mem_gib, ".1f" if cuda else ".2f"),
            _fmt(x.get("timed_gib") if cuda and r.status == "ok" else None, ".1f"),
            _fmt(x.get("start_gib") if cuda and r.status == "ok" else None, ".1f"),
            _fmt(r.step_ms, ".1f"),
            _fmt(r.final_loss, ".3f"),
            _escape(x.get("desc", STATIC_DESC.get(r.config, ""))),
            _escape("; ".join(r.notes)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_section(records: list[dict[str, Any]], configs: Optional[list[str]] = None) -> str:
    """A dated RESULTS.md section: workload, versions, command, the table with each configuration beside
    its figures, how each model was built, and the issue's targets as PASS/FAIL."""
    meta = meta_record(records)
    gpus = int(meta.get("gpus", 2))
    names = configs or meta.get("configs") or sorted({r["config"] for r in records if "config" in r})
    rows = [build_row(records, name, gpus) for name in names]
    for row in rows:  # the LoRA optimizer is fused on GPU by design; peers_report notes the opposite case
        row.notes = [n for n in row.notes if n != "AdamW without fused=True"]
    extras = {name: _extras(records, name) for name in names}
    ranks = [r for r in records if r.get("kind") == "rank"]
    cuda = meta.get("device_type", "cuda") == "cuda"
    device = next((r["device_name"] for r in ranks), meta.get("device_name") or "unknown device")
    dims = meta.get("model", {}).get("dims", {})
    counts = llama_lora_counts(dims) if dims else {}
    n_params = next((r["n_params"] for r in ranks), counts.get("total"))
    n_train = next((r.get("n_trainable") for r in ranks), counts.get("trainable"))
    fpt = next((r["flops_per_token"] for r in ranks), counts.get("flops_per_token"))
    lora = meta.get("lora", {})
    unit = "GPU" if cuda else "CPU process"
    units = ("GPUs" if cuda else "CPU processes") if gpus > 1 else unit
    shape = (
        f"{dims.get('num_hidden_layers')} layers × hidden {dims.get('hidden_size')}, FFN {dims.get('intermediate_size')}, "
        f"{dims.get('num_attention_heads')} heads / {dims.get('num_key_value_heads')} KV heads, vocab "
        f"{dims.get('vocab_size')}, untied head, SDPA attention"
    )
    size = ""
    if n_params and n_train:
        size = f"; {_fmt_count(n_params)} parameters, {_fmt_count(n_train)} trainable ({100 * n_train / n_params:.2f}%)"
    versions = _versions_line(meta, next((r.get("versions") for r in ranks), None))
    v = {**meta.get("versions", {}), **(next((r.get("versions") for r in ranks), None) or {})}
    versions += f" · transformers {v.get('transformers') or 'not installed'} · peft {v.get('peft') or 'not installed'}"
    peak_text = (
        "peak memory = `torch.cuda.max_memory_allocated`, max over ranks: *whole run* from process start (model "
        "build, strategy set-up, warm-up, timed steps; the targets use it), *timed steps* after a reset of the peak "
        "statistics at the end of the warm-up; *allocated at start* = `torch.cuda.memory_allocated` when training "
        "starts (the model states a strategy keeps)"
        if cuda else "peak memory = peak RSS per process, max over ranks"
    )
    lines = [
        f"## {meta.get('date', '?')} · lora · {gpus} {units} · {device}",
        "",
        f"Workload: LoRA (peft, r={lora.get('r')}, alpha {lora.get('lora_alpha')}, dropout {lora.get('lora_dropout')}, "
        f"on {', '.join(lora.get('target_modules', []))}) of a frozen random-weight `LlamaForCausalLM` "
        f"({meta.get('model', {}).get('name', '?')}: {shape}{size}), seq {dims.get('seq_len')}, micro-batch "
        f"{meta.get('micro_batch')} per {unit}, random tokens, causal LM loss, torch AdamW(lr 1e-4"
        f"{', fused=True' if cuda else ''}) over the LoRA parameters only; activation checkpointing "
        f"{'on (HF, non-reentrant)' if meta.get('act_ckpt') else 'off'} for every configuration; "
        f"{meta.get('warmup')} warm-up + {meta.get('steps')} timed steps, median step time (slowest rank per "
        f"step), global tokens/s; TFLOP/s from {_fmt_count(fpt) if fpt else '?'}FLOP/token (4 per frozen matmul "
        "parameter, 6 per LoRA parameter, plus attention; weight gradients of frozen weights, which a strategy may "
        f"compute anyway, are not counted); {peak_text}. Each configuration ran in its own "
        f"{'torchrun' if gpus > 1 else 'process'} ({gpus} processes).",
        "",
        f"Versions: {versions}",
        "",
        f"Command: `{meta.get('command', '?')}`",
        "",
        render_table(rows, extras, meta),
    ]
    built = [name for name in names if extras[name].get("built")]
    if built:
        lines += ["", "How each model was built (lora_worker.py's [Note: building the model]):", ""]
    for name in built:
        lines.append(f"- `{name}`: {extras[name]['built']}")
    shims = sorted({s for name in built for s in extras[name].get("shims", [])})
    if shims:
        lines += ["", f"HF classes given a `reset_parameters()` (norm weight 1, RoPE `inv_freq` from the config) in "
                      f"every configuration: {', '.join(shims)}; they run where the model is materialised from the meta "
                      "device (`zero3`, the FSDP variants)."]
    peer = fsdp_peer(rows)
    zero3 = next((r for r in rows if r.config == "zero3" and r.status == "ok"), None)
    if peer is not None:
        summary = f"The fsdp peer (the fastest of {', '.join(f'`{v}`' for v in LORA_FSDP_VARIANTS)} that ran) is `{peer.config}`"
        if zero3 is not None and zero3.tokens_per_s and peer.tokens_per_s and zero3.peak_mem_gib and peer.peak_mem_gib:
            summary += (f": `zero3` / `{peer.config}` = {zero3.tokens_per_s / peer.tokens_per_s:.2f}× tokens/s, "
                        f"{zero3.peak_mem_gib / peer.peak_mem_gib:.2f}× peak memory")
        lines += ["", summary + "."]
    if cuda:
        targets = render_targets(rows, gpus, lora_targets(gpus))
        if targets:
            lines += ["", targets]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main


def meta(args: argparse.Namespace, command: str) -> dict[str, Any]:
    name, dims = llama_preset(args.model, args.layers, args.seq_len)
    return {
        "kind": "meta",
        "benchmark": "lora",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": args.gpus,
        "device_type": args.device,
        "device_name": nvidia_smi("name") if args.device == "cuda" else platform.machine(),
        "configs": args.config_names,
        "baseline": LORA_BASELINE,
        "model": {"name": name, "dims": dims},
        "lora": {**LORA, "target_modules": list(LORA["target_modules"])},
        "micro_batch": args.micro_batch,
        "act_ckpt": args.act_ckpt,
        "warmup": args.warmup,
        "steps": args.steps,
        "command": command,
        "versions": {
            **{k: dist_version(k) for k in ("torch", "lightning", "deepspeed", "transformers", "peft")},
            "lightning_zero": dist_version("lightning-zero"),
            "python": platform.python_version(),
        },
    }


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv), argv, "lora", meta, run_config, render_section)


if __name__ == "__main__":
    sys.exit(main())
