"""Saving and loading a training checkpoint: lightning_zero's sharded ``zero3`` checkpoints (synchronous
and asynchronous) against Lightning's FSDP and DeepSpeed stage 3, side by side, in one run (issue #13).

The workload: the peer benchmark's GPT-1.3B (``conf/model/gpt_1b.yaml``: 24 layers x d_model 2048,
vocab 50304, seq 1024; 1.31 G parameters), ``bf16-mixed``, torch AdamW(fused=True) with its warm-up +
cosine LR schedule (``examples/gpt_module.py``), micro-batch 8 per GPU, 2 GPUs. Each configuration builds the
model as ``peers_worker.py`` does for its strategy, trains ``--steps`` steps with ``trainer.fit`` (so
AdamW's moments exist), then, from a callback at the end of training (the strategy still fully set
up), times ``trainer.save_checkpoint(path)`` ``--saves`` times (the last is reported: the first may
include warm-up) and, once, Lightning's restore calls: ``ckpt = strategy.load_checkpoint(path)``,
``strategy.load_model_state_dict(ckpt)``, ``strategy.load_optimizer_state_dict(ckpt)``. What exactly
is timed, how peak memory and bytes on disk are read, why the load reads a cold page cache and how it
is checked to have restored the state: checkpoint_worker.py's [Note: what is measured].

Configurations (``checkpoint_worker.CONFIGS`` builds them; each one's exact settings, read back from
the strategy object as it ran, are written beside its figures):

* ``zero3``: ``lightning_zero.ZeroStrategy(stage=3, checkpoint_format="sharded")``: every rank writes the
  partitions it owns through ``torch.distributed.checkpoint``, synchronously;
* ``zero3_async``: the same with ``checkpoint_async=True``: ``save_checkpoint`` returns once the
  partitions are copied to host memory; ``strategy.wait_for_checkpoint()`` returns when the files are
  complete (both times are reported);
* ``zero3_nofsync``: ``zero3`` with ``checkpoint_fsync=False`` (files left in the page cache, as
  DeepSpeed leaves them: the like-for-like comparison with ``deepspeed_stage_3``);
* ``fsdp``: ``FSDPStrategy(sharding_strategy="FULL_SHARD", auto_wrap_policy={Block},
  state_dict_type="sharded")``: peers.py's FSDP with the checkpoint setting Lightning's FSDP guide
  advises for large models (each rank writes its shards through ``torch.distributed.checkpoint``);
* ``deepspeed_stage_3``: Lightning's ``DeepSpeedStrategy(stage=3)`` (its defaults), which writes
  DeepSpeed's own checkpoint directory (``engine.save_checkpoint``: one model-states and one
  optimizer-states file per rank, ``torch.save``, no fsync).

Targets (issue #13; same-run figures): ``zero3`` save time at most ``fsdp``'s and ``deepspeed_stage_3``'s;
``zero3``'s peak extra device memory during the save at most one communication bucket
(``ZeroConfig.bucket_size_mb``, 50 MiB = 52,428,800 bytes = 26.2 M bf16 elements by default); ``zero3_async``
blocking the caller less than 10% of ``zero3``'s synchronous save. Load times are shown side by side.

    python3 benchmarks/checkpoint.py --gpus 2 --write-results --budget-s 480      # the 1.3B workload
    python3 benchmarks/checkpoint.py --gpus 2 --configs zero3,zero3_async --saves 1
    python3 benchmarks/checkpoint.py --device cpu --model tiny --gpus 2 --configs zero3,fsdp,deepspeed_stage_3
    python3 benchmarks/checkpoint.py --from-results runs/checkpoint/<run>/results.jsonl   # re-render a table
    LZ_BUDGET_S=560 bash benchmarks/run_gpu.sh ckpt                              # on the GPU machine (.whl carried)

As ``peers.py`` (whose process handling this reuses): one process tree per configuration
(``torchrun --nproc-per-node N checkpoint_worker.py``), this parent never imports torch, a configuration
that fails or hangs past ``--config-timeout-s`` becomes a row with the reason, ``--budget-s`` bounds
the whole run (configurations that no longer fit are listed as skipped; a worker skips its repeat
save when the time left would not cover it) and the table is always printed. Checkpoints are written
under ``--ckpt-dir``/<config>/ and deleted after each is measured (a 1.3B checkpoint with AdamW state
is about 16 GB); this parent removes a configuration's directory again after its run, also after a
failure or a timeout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
from benchmarks.peers import (  # noqa: E402
    _note, add_runner_args, child_env, dist_version, nvidia_smi, reap_workers, reason_from_tail, run_benchmark, run_child,
    select_configs, worker_launch,
)
from benchmarks.peers_report import _escape, _fmt, _fmt_count, _versions_line, meta_record, read_records  # noqa: E402
from benchmarks.presets import model_label, model_preset  # noqa: E402

WORKER = HERE / "checkpoint_worker.py"
MIB = float(2**20)
GIB = float(2**30)

CKPT_CONFIGS: dict[str, str] = {
    "zero3": "lightning_zero",
    "zero3_async": "lightning_zero",
    "zero3_nofsync": "lightning_zero",
    "fsdp": "lightning",
    "deepspeed_stage_3": "deepspeed",
}
"""Configurations -> family (as ``presets.PEERS``), in the default order; ``checkpoint_worker.CONFIGS``
says how each is built."""

STATIC_DESC: dict[str, str] = {
    "zero3": "ZeroStrategy(stage=3, checkpoint_format='sharded')",
    "zero3_async": "ZeroStrategy(stage=3, checkpoint_format='sharded', checkpoint_async=True)",
    "zero3_nofsync": "ZeroStrategy(stage=3, checkpoint_format='sharded', checkpoint_fsync=False)",
    "fsdp": "FSDPStrategy(sharding_strategy=FULL_SHARD, auto_wrap_policy={Block}, state_dict_type='sharded')",
    "deepspeed_stage_3": "DeepSpeedStrategy(stage=3), Lightning's defaults; DeepSpeed's own checkpoint directory",
}
"""What each configuration is, for rows whose workers never reported (the workers report the settings
as they ran)."""

BYTES_PER_PARAM_ON_DISK = 16
"""Disk-space check: fp32 weights + AdamW's two moments (12 B/parameter), DeepSpeed's 16-bit weights
(2 more), and slack."""


# ---------------------------------------------------------------------------------------------------- arguments


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="GPUs (CPU processes with --device cpu) per configuration")
    p.add_argument("--configs", default=None, help=f"comma-separated subset of {list(CKPT_CONFIGS)} (default: all)")
    p.add_argument("--model", default="gpt_1b", help="conf/model preset (gpt_1b, gpt_small, gpt_tiny/tiny) or a YAML")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per GPU per training step")
    p.add_argument("--steps", type=int, default=3, help="training steps before the measurements")
    p.add_argument("--saves", type=int, default=2, help="saves per configuration (the last that ran is reported)")
    p.add_argument("--ckpt-dir", type=Path, default=Path("/tmp/lz_ckpt_bench"), help="where checkpoints are written")
    p.add_argument("--held-steps", type=int, default=0,
                   help="K > 0: also one save inside the training loop, K synchronised steps timed on each side: "
                        "what the save holds training up (checkpoint_held.py [Note: training held by a save])")
    p.add_argument("--warm-load", action="store_true",
                   help="load from the page cache (default: the checkpoint's files are evicted before the load)")
    add_runner_args(p, config_timeout_s=300.0, min_config_s=90.0)
    args = p.parse_args(argv)
    if args.gpus < 1 or args.steps < 1 or args.saves < (0 if args.held_steps else 1) or args.micro_batch < 1:
        p.error("--gpus, --steps, --saves and --micro-batch must be >= 1 (--saves 0 with --held-steps: that save only)")
    select_configs(p, args, list(CKPT_CONFIGS), list(CKPT_CONFIGS))
    try:
        model_preset(args.model)
    except ValueError as exc:
        p.error(str(exc))
    return args


# ---------------------------------------------------------------------------------------------------- running


def gpt_params(dims: dict[str, Any]) -> int:
    """Parameters of ``examples/gpt.py``'s GPT (biases, tied head), without torch."""
    d, n_layer = int(dims["d_model"]), int(dims["n_layer"])
    per_block = 12 * d * d + 13 * d
    return n_layer * per_block + (int(dims["vocab_size"]) + int(dims["seq_len"])) * d + 2 * d


def worker_cmd(args: argparse.Namespace, config: str, results: Path, timeout: float) -> list[str]:
    """python (1 process) or torchrun (N processes) on checkpoint_worker.py."""
    launch = worker_launch(args.gpus)
    cmd = launch + [
        str(WORKER), "--config", config, "--model", args.model, "--micro-batch", str(args.micro_batch),
        "--steps", str(args.steps), "--saves", str(args.saves), "--ckpt-dir", str(args.ckpt_dir),
        "--device", args.device, "--devices", str(args.gpus), "--results-file", str(results),
        "--time-limit-s", f"{timeout:.0f}",
    ]
    cmd += ["--held-steps", str(args.held_steps)] if args.held_steps else []
    return cmd + (["--warm-load"] if args.warm_load else [])


def filesystem(path: Path) -> Optional[str]:
    """'<type> on <device> (<mount point>)' of the mount holding ``path``, from /proc/mounts (None elsewhere)."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    target = str(path.resolve())
    best = max((m for m in mounts if len(m) == 3 and (target == m[1] or target.startswith(m[1].rstrip("/") + "/"))),
               key=lambda m: len(m[1]), default=None)
    return f"{best[2]} on {best[0]} ({best[1]})" if best else None


def disk_shortfall(args: argparse.Namespace) -> Optional[str]:
    """Why a checkpoint would not fit under --ckpt-dir (None if it would)."""
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    need = BYTES_PER_PARAM_ON_DISK * gpt_params(model_preset(args.model))
    free = shutil.disk_usage(args.ckpt_dir).free
    if free < need:
        return f"{free / GIB:.1f} GiB free under {args.ckpt_dir}, a checkpoint needs about {need / GIB:.1f} GiB"
    return None


def run_config(args: argparse.Namespace, config: str, results: Path, out_dir: Path, deadline: Optional[float]) -> None:
    """Run one configuration once; record every outcome (a skip, a failure, a timeout) as a row."""
    family = CKPT_CONFIGS[config]
    if family == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        _note(results, config, 0, kind="error", status="failed", rank=0, reason="deepspeed is not installed")
        return
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left < args.min_config_s:
        _note(results, config, 0, kind="error", status="skipped", rank=0,
              reason=f"out of time budget ({max(0.0, left):.0f} s left)")
        return
    short = disk_shortfall(args)
    if short is not None:
        _note(results, config, 0, kind="error", status="skipped", rank=0, reason=short)
        return
    timeout = args.config_timeout_s if left is None else min(args.config_timeout_s, left)
    attempt_file = out_dir / f"{config}.jsonl"
    attempt_file.unlink(missing_ok=True)
    attempt_file.with_suffix(".pids").unlink(missing_ok=True)
    print(f"==> {config} (timeout {timeout:.0f} s)")
    result = run_child(worker_cmd(args, config, attempt_file, timeout), child_env(args, family),
                       out_dir / f"{config}.log", timeout, prefix=f"[{config}] ")
    killed = reap_workers(attempt_file.with_suffix(".pids"), WORKER.name)
    if killed:
        print(f"... {config}: killed leftover worker processes {killed}")
    shutil.rmtree(args.ckpt_dir / config, ignore_errors=True)  # what a failed or killed worker left behind
    records = read_records(attempt_file)
    with results.open("a") as fh:
        for r in records:
            fh.write(json.dumps({**r, "attempt": 0}) + "\n")
    finished = any(r.get("kind") == "done" for r in records)
    if result.timed_out or not records or (not finished and not any(r.get("kind") == "error" for r in records)):
        _note(results, config, 0, kind="error", status="failed", rank=-1, reason=reason_from_tail(result))
    elif result.returncode not in (0, None) and not any(r.get("kind") == "error" for r in records):
        _note(results, config, 0, kind="note", note=f"exit code {result.returncode} after recording")
    ok = result.returncode == 0 and not result.timed_out
    print(f"<== {config}: {'ok' if ok else 'failed'} in {result.seconds:.0f} s")


# ---------------------------------------------------------------------------------------------------- rows


@dataclass
class CkptRow:
    """One configuration's line: the figures of its reported save and of its load (max over ranks)."""

    config: str
    status: str
    """'ok', 'failed' or 'skipped' (a failed row still shows what was measured before the failure)."""
    desc: str = ""
    is_async: bool = False
    save_index: Optional[int] = None
    saves_done: int = 0
    save_s: Optional[float] = None
    """Wall time ``trainer.save_checkpoint`` blocked the caller."""
    complete_s: Optional[float] = None
    """Until the checkpoint was complete on every rank (asynchronous: after ``wait_for_checkpoint``)."""
    first_save_s: Optional[float] = None
    first_save_host_peak: Optional[int] = None
    """Save #1's host peak: an asynchronous save allocates its host staging copy then and keeps it."""
    flush_s: Optional[float] = None
    save_peak: Optional[int] = None
    save_host_peak: Optional[int] = None
    disk: dict[str, Any] = field(default_factory=dict)
    load_s: Optional[float] = None
    load_peak: Optional[int] = None
    load_host_peak: Optional[int] = None
    verified: Optional[bool] = None
    bucket_bytes: Optional[int] = None
    notes: list[str] = field(default_factory=list)


def _max(records: list[dict[str, Any]], key: str) -> Optional[Any]:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def _complete_saves(saves: list[dict[str, Any]], world: int) -> dict[int, list[dict[str, Any]]]:
    """Save records by index, keeping the saves every rank reported."""
    by_index: dict[int, list[dict[str, Any]]] = {}
    for r in saves:
        by_index.setdefault(int(r["index"]), []).append(r)
    return {i: rs for i, rs in by_index.items() if len({r["rank"] for r in rs}) >= world}


def _fill_save(row: CkptRow, saves: dict[int, list[dict[str, Any]]]) -> None:
    index = max(saves)
    rs = saves[index]
    rank0 = next((r for r in rs if r.get("disk") is not None), {})
    row.save_index, row.saves_done = index, len(saves)
    row.save_s, row.complete_s = _max(rs, "save_s"), _max(rs, "complete_s")
    row.save_peak, row.save_host_peak = _max(rs, "peak_extra_bytes"), _max(rs, "host_peak_extra_bytes")
    row.flush_s, row.disk = rank0.get("flush_s"), rank0.get("disk") or {}
    if index > 1:
        row.first_save_s = _max(saves[min(saves)], "save_s")
        row.first_save_host_peak = _max(saves[min(saves)], "host_peak_extra_bytes")
    if row.disk.get("layout") == "file":
        row.notes.append("wrote one file, not a sharded directory")


def build_ckpt_row(records: list[dict[str, Any]], config: str) -> CkptRow:
    mine = [r for r in records if r.get("config") == config and r.get("kind") != "meta"]
    setup = sorted((r for r in mine if r.get("kind") == "setup"), key=lambda r: r["rank"])
    errors = [r for r in mine if r.get("kind") == "error"]
    first = setup[0] if setup else {}
    world = int(first.get("world_size", 1))
    row = CkptRow(config, "ok", desc=first.get("config_desc") or STATIC_DESC[config],
                  is_async=bool(first.get("is_async", config.endswith("_async"))), bucket_bytes=first.get("bucket_bytes"))
    saves = _complete_saves([r for r in mine if r.get("kind") == "save"], world)
    if saves:
        _fill_save(row, saves)
    loads = [r for r in mine if r.get("kind") == "load"]
    if len({r["rank"] for r in loads}) >= world and loads:
        row.load_s = _max(loads, "load_s")
        row.load_peak, row.load_host_peak = _max(loads, "peak_extra_bytes"), _max(loads, "host_peak_extra_bytes")
        verdicts = [r.get("verified") for r in loads]
        row.verified = None if any(v is None for v in verdicts) else all(verdicts)
    if errors:
        worst = next((e for e in errors if e["status"] == "failed"), errors[0])
        row.status = worst["status"]
        row.notes.insert(0, worst["reason"])
    elif not saves:
        row.status = "failed"
        row.notes.insert(0, "no complete save recorded")
    row.notes += [r["note"] for r in mine if r.get("kind") == "note" and r["note"] not in row.notes]
    allocated = _max(setup, "allocated_at_end_bytes")
    if allocated:
        row.notes.append(f"allocated when training ended: {_fmt_bytes(allocated)}/GPU")
    return row


# ---------------------------------------------------------------------------------------------------- rendering


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "–"
    for scale, unit in ((GIB, "GiB"), (MIB, "MiB"), (1024.0, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) < 1000 * scale else f"{n / scale:,.0f} {unit}"
    return f"{n:.0f} B"


def _fmt_disk(disk: dict[str, Any]) -> str:
    if not disk:
        return "–"
    ranks = disk.get("bytes_by_rank") or {}
    per_rank = " / ".join(_fmt_bytes(ranks[k]) for k in sorted(ranks, key=int)) or "–"
    return (f"{_fmt_bytes(disk.get('bytes'))} in {disk.get('files')} files (du {_fmt_bytes(disk.get('du_bytes'))}); "
            f"per rank {per_rank}; shared {_fmt_bytes(disk.get('shared_bytes'))}")


def _fmt_verified(v: Optional[bool]) -> str:
    return "–" if v is None else "yes" if v else "NO"


def render_table(rows: list[CkptRow], cuda: bool) -> str:
    dev = "GPU" if cuda else "device"
    head = ["config", "save: caller blocked (s)", "save: complete (s)", "+ flush (s)", f"peak extra {dev} mem, save",
            "peak extra host RSS, save", "on disk", "load (s)", f"peak extra {dev} mem, load", "peak extra host RSS, load",
            "state restored", "configuration (as run)", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        notes = list(r.notes)
        if r.save_index is not None:
            first = (f" (save #1: {r.first_save_s:.2f} s, host RSS peak extra {_fmt_bytes(r.first_save_host_peak)})"
                     if r.first_save_s is not None else " (includes warm-up)")
            notes.insert(0, f"save #{r.save_index} of {r.saves_done}{first}")
        cells = [
            f"`{r.config}`" if r.status == "ok" else f"`{r.config}` ({r.status})",
            _fmt(r.save_s, ".2f"),
            _fmt(r.complete_s, ".2f"),
            _fmt(r.flush_s, ".2f"),
            _fmt_bytes(r.save_peak) if cuda else "–",
            _fmt_bytes(r.save_host_peak),
            _fmt_disk(r.disk),
            _fmt(r.load_s, ".2f"),
            _fmt_bytes(r.load_peak) if cuda else "–",
            _fmt_bytes(r.load_host_peak),
            _fmt_verified(r.verified),
            _escape(r.desc),
            _escape("; ".join(notes)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _measured(by: dict[str, CkptRow], name: str) -> Optional[CkptRow]:
    """The configuration's row if it ran to the end ('ok'), else None."""
    row = by.get(name)
    return row if row is not None and row.status == "ok" else None


def _why_missing(by: dict[str, CkptRow], *names: str) -> str:
    for name in names:
        row = by.get(name)
        if row is None:
            return f"n/a (`{name}` not run)"
        if row.status != "ok":
            return f"n/a (`{name}` {row.status})"
    return "n/a (not measured)"


def check_targets(rows: list[CkptRow], cuda: bool) -> list[tuple[str, str, str]]:
    """(target, measured, verdict) for issue #13's checkpoint targets."""
    by = {r.config: r for r in rows}
    zero3, asy = _measured(by, "zero3"), _measured(by, "zero3_async")
    out: list[tuple[str, str, str]] = []
    for peer in ("fsdp", "deepspeed_stage_3"):
        ref = _measured(by, peer)
        what = f"`zero3` save time ≤ `{peer}`'s"
        if zero3 is None or ref is None or zero3.save_s is None or ref.save_s is None:
            out.append((what, "–", _why_missing(by, "zero3", peer)))
        else:
            a, b = zero3.save_s, ref.save_s
            out.append((what, f"{a:.2f} s vs {b:.2f} s ({a / b:.2f}×)", "PASS" if a <= b else "FAIL"))
    nofsync, ds = _measured(by, "zero3_nofsync"), _measured(by, "deepspeed_stage_3")
    what = "`zero3_nofsync` save time ≤ `deepspeed_stage_3`'s (neither fsyncs: like for like)"
    if nofsync is None or ds is None or nofsync.save_s is None or ds.save_s is None:
        out.append((what, "–", _why_missing(by, "zero3_nofsync", "deepspeed_stage_3")))
    else:
        a, b = nofsync.save_s, ds.save_s
        out.append((what, f"{a:.2f} s vs {b:.2f} s ({a / b:.2f}×)", "PASS" if a <= b else "FAIL"))
    what = "`zero3` peak extra device memory during save ≤ one bucket (`bucket_size_mb`)"
    if not cuda:
        out.append((what, "–", "n/a (no device memory on CPU)"))
    elif zero3 is None or zero3.save_peak is None or zero3.bucket_bytes is None:
        out.append((what, "–", _why_missing(by, "zero3")))
    else:
        peak, bucket = zero3.save_peak, zero3.bucket_bytes
        limit = f"{_fmt_bytes(bucket)} = {bucket:,} B = {bucket // 2 / 1e6:.1f} M bf16 elements"
        exact = f" ({peak:,} B)" if peak >= 1024 else ""
        out.append((what, f"{_fmt_bytes(peak)}{exact} vs {limit}", "PASS" if peak <= bucket else "FAIL"))
    what = "`zero3_async` blocks the caller < 10% of `zero3`'s synchronous save"
    if zero3 is None or asy is None or zero3.save_s is None or asy.save_s is None:
        out.append((what, "–", _why_missing(by, "zero3_async", "zero3")))
    else:
        a, b = asy.save_s, zero3.save_s
        complete = f"; complete after {asy.complete_s:.2f} s" if asy.complete_s is not None else ""
        out.append((what, f"{a:.2f} s vs {b:.2f} s ({100 * a / b:.1f}%){complete}", "PASS" if a < 0.10 * b else "FAIL"))
    return out


def render_targets(rows: list[CkptRow], cuda: bool) -> str:
    lines = ["| target (#13) | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in check_targets(rows, cuda)]
    return "\n".join(lines)


def load_summary(rows: list[CkptRow]) -> str:
    """Load times side by side, as ratios to ``zero3``'s."""
    loaded = [r for r in rows if r.load_s is not None]
    zero3 = next((r for r in loaded if r.config == "zero3"), None)
    if not loaded:
        return ""
    parts = []
    for r in loaded:
        ratio = f" ({r.load_s / zero3.load_s:.2f}× `zero3`)" if zero3 is not None and r is not zero3 and zero3.load_s else ""
        parts.append(f"`{r.config}` {r.load_s:.2f} s{ratio}")
    return "Load (weights and optimizer state, everything needed to resume): " + ", ".join(parts) + "."


def durable_summary(rows: list[CkptRow]) -> str:
    """Save until durable (complete + flush) side by side: the figure that compares writers that fsync
    their files with one that leaves them in the page cache."""
    done = [r for r in rows if r.complete_s is not None and r.flush_s is not None]
    if not done:
        return ""
    parts = [f"`{r.config}` {r.complete_s + r.flush_s:.2f} s" for r in done]
    return "Save until durable on disk (complete + flush; information, not a target): " + ", ".join(parts) + "."


def held_summary(records: list[dict[str, Any]], names: list[str]) -> str:
    """``--held-steps``: per configuration, what one save inside the loop held training up, the worst rank's."""
    parts = []
    for name in names:
        held = [r for r in records if r.get("kind") == "held" and r.get("config") == name]
        for index in sorted({r.get("index", 1) for r in held}):
            worst = max((r for r in held if r.get("index", 1) == index), key=lambda r: r["held_s"])
            where = f", staged: {worst['staged_on']}" if worst.get("staged_on") else ""
            if "alloc_retries_after" in worst:
                where += (f"; allocator after it: {worst['alloc_retries_after']} failed-malloc retries, "
                          f"{worst['device_frees_after']} cudaFree")
            parts.append(f"`{name}` save {index}: caller blocked {worst['blocking_s']:.3f} s, training held "
                         f"{worst['held_s']:.3f} s = {worst['held_steps']:.1%} of one step ({worst['step_s']:.3f} s; "
                         f"{len(worst['after_s'])} steps after against as many before{where})")
    if not parts:
        return ""
    return ("Two saves inside the training loop, every step synchronised on the training stream (held = caller "
            "blocked + the steps after - as many steps before; worst rank; save 1 pays one-time costs): "
            + "; ".join(parts) + ".")


def render_section(records: list[dict[str, Any]], configs: Optional[list[str]] = None) -> str:
    """A dated RESULTS.md section: workload, versions, command, how it was measured, the table with each
    configuration beside its figures, load times side by side, and issue #13's targets as PASS/FAIL."""
    meta = meta_record(records)
    gpus = int(meta.get("gpus", 2))
    cuda = meta.get("device_type", "cuda") == "cuda"
    names = configs or meta.get("configs") or sorted({r["config"] for r in records if "config" in r})
    rows = [build_ckpt_row(records, name) for name in names]
    setups = [r for r in records if r.get("kind") == "setup"]
    device = next((r["device_name"] for r in setups), meta.get("device_name") or "unknown device")
    dims = meta.get("model", {}).get("dims", {})
    n_params = next((r["n_params"] for r in setups), gpt_params(dims) if dims else None)
    unit = "GPU" if cuda else "CPU process"
    units = ("GPUs" if cuda else "CPU processes") if gpus > 1 else unit
    shape = (f"{dims.get('n_layer')} layers × d_model {dims.get('d_model')}, {dims.get('n_head')} heads, seq "
             f"{dims.get('seq_len')}, vocab {dims.get('vocab_size')}")
    size = f"; {_fmt_count(n_params)} parameters" if n_params else ""
    fused = next((r.get("fused") for r in setups), cuda)
    cold = ("The load reads a cold page cache (rank 0 fsyncs the files, then `posix_fadvise(DONTNEED)`)"
            if not meta.get("warm_load") else "The load reads the page cache (`--warm-load`)")
    lines = [
        f"## {meta.get('date', '?')} · checkpoint · {gpus} {units} · {device}",
        "",
        f"Workload: {meta.get('model', {}).get('name', '?')} ({shape}{size}), `bf16-mixed`, torch AdamW"
        f"{'(fused=True)' if fused else ''} with the example's LR schedule, micro-batch {meta.get('micro_batch')} per "
        f"{unit}; {meta.get('steps')} training steps with `trainer.fit`, then from a callback at the end of training "
        f"(strategy fully set up): up to {meta.get('saves')} × `trainer.save_checkpoint(dir)` (the last that ran is "
        "reported) and, after the first, `strategy.load_checkpoint` + `load_model_state_dict` + "
        "`load_optimizer_state_dict` (Lightning's restore calls: FSDP and DeepSpeed load weights and optimizer state "
        "inside `load_checkpoint`, so the same calls restore everything for every configuration). Every region "
        "starts after a barrier and a device synchronisation on all ranks; times are the maximum over ranks. *save: "
        "caller blocked* ends when `save_checkpoint` returns on the host (Lightning's barrier included, no device "
        "synchronisation); *complete* adds "
        "`wait_for_checkpoint()` (asynchronous) and a barrier; *+ flush* is rank 0's fsync of every file afterwards "
        "(zero when the writer synced them; until then the checkpoint is not durable). Peak extra memory = peak "
        "during the region (statistics reset just before) minus what was allocated (device: "
        "`torch.cuda.max_memory_allocated`; host: `VmHWM` minus `VmRSS`), max over ranks. *On disk*: apparent bytes, "
        f"attributed to ranks by file name. {cold}. *State restored*: every tensor of the torch optimizer's state and "
        "the fp32 weights it steps was halved after the save; after the load the sum of their squares equals the "
        f"one taken before the save, on every rank. Checkpoints under `{meta.get('ckpt_dir')}` "
        f"({meta.get('ckpt_fs') or 'filesystem unknown'}), deleted after each measurement. Each configuration ran in its own {'torchrun' if gpus > 1 else 'process'} ({gpus} processes).",
        "",
        f"Versions: {_versions_line(meta, next((r.get('versions') for r in setups), None))}",
        "",
        f"Command: `{meta.get('command', '?')}`",
        "",
        render_table(rows, cuda),
    ]
    for summary in (load_summary(rows), durable_summary(rows), held_summary(records, names)):
        if summary:
            lines += ["", summary]
    lines += ["", ("" if cuda else "CPU smoke run (gloo): the targets below are not claims.\n\n")
              + render_targets(rows, cuda)]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------- main


def meta(args: argparse.Namespace, command: str) -> dict[str, Any]:
    return {
        "kind": "meta",
        "benchmark": "checkpoint",
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": args.gpus,
        "device_type": args.device,
        "device_name": nvidia_smi("name") if args.device == "cuda" else platform.machine(),
        "configs": args.config_names,
        "model": {"name": model_label(args.model), "dims": model_preset(args.model)},
        "micro_batch": args.micro_batch,
        "steps": args.steps,
        "saves": args.saves,
        "ckpt_dir": str(args.ckpt_dir),
        "ckpt_fs": filesystem(args.ckpt_dir),
        "warm_load": args.warm_load,
        "command": command,
        "versions": {
            **{k: dist_version(k) for k in ("torch", "lightning", "deepspeed")},
            "lightning_zero": dist_version("lightning-zero"),
            "python": platform.python_version(),
        },
    }


def main(argv: Optional[list[str]] = None) -> int:
    return run_benchmark(parse_args(argv), argv, "checkpoint", meta, run_config, render_section)


if __name__ == "__main__":
    sys.exit(main())
