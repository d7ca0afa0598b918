"""The DeepSpeed peer of ``benchmarks/sequence.py sp``: Ulysses sequence parallelism with ALST's memory
pieces on the same HF Llama, DeepSpeed used directly (no Lightning), one torchrun group of N processes.

The recipe is DeepSpeed's ALST tutorial (docs/_tutorials/ulysses-alst-sequence-parallelism.md, 0.18/0.19)
and ``deepspeed/runtime/sequence_parallel/ulysses_sp.py``:

* ``UlyssesSPAttentionHF.register_with_transformers(config dir, "sdpa", N, micro_batch_size=1, S)``: HF's
  ``sdpa`` attention replaced by the Ulysses wrapper, and the ``mpu`` handed to ``deepspeed.initialize``;
* the model built from the config under ``deepspeed.zero.Init`` (ZeRO-3, bf16), HF gradient checkpointing
  (non-reentrant, HF's default), ``LlamaMLP.forward`` patched to ``TiledMLP`` with the tutorial's
  ``ceil(local tokens / hidden)`` shards (computed once: every rank holds the same length, so the tutorial's
  per-call MAX all-reduce, a guard for uneven lengths, is left out, in DeepSpeed's favour);
* the loss ``TiledFusedLogitsLoss`` over ``ceil(local tokens / --chunk-tokens)`` shards (the chunk size ours
  uses), summed, divided by the local target count, then the tutorial's differentiable token-weighted
  aggregation over the SP group (``torch.distributed.nn.functional.all_gather``);
* batches through ``UlyssesSPDataLoaderAdapter`` (``input_ids``, ``position_ids``, ``labels`` in; this rank's
  shard with ``shift_labels`` out); torch AdamW (fused) as DeepSpeed's client optimizer;
  ``engine.backward`` / ``engine.step``.

The loss is computed inside the module DeepSpeed wraps (``_LossModule``), so ZeRO-3's hooks see the head's
weight used in a forward. Anything that fails (DeepSpeed missing, einops missing, a recipe API changed,
out of memory) is one error row with the reason: ``sequence.py`` prints it as "not run: ..." next to ours.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks.presets import llama_preset  # noqa: E402
from benchmarks.records import _version, append_record, short_reason, versions, worker_main  # noqa: E402
from benchmarks.sequence_plan import flops_per_token, tiles_for  # noqa: E402
from benchmarks.sequence_worker import HostWatch, RandomSequence, classify, status_bytes  # noqa: E402

LR = 1e-5


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="deepspeed")
    p.add_argument("--model", default="8b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=2, help="processes = sequence-parallel degree")
    p.add_argument("--chunk-tokens", type=int, default=4096)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--results-file", type=Path, required=True)
    return p.parse_args(argv)


def patch_tiled_mlp(shards: int) -> None:
    """The tutorial's ``LlamaMLP.forward`` monkey patch (before the model is built), shards fixed."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.llama import modeling_llama

    def mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, shards, params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward


class _LossModule(nn.Module):
    """The Llama and its tiled loss in one forward (what ``deepspeed.initialize`` wraps)."""

    def __init__(self, llama: nn.Module, chunk_tokens: int) -> None:
        super().__init__()
        self.llama = llama
        self.chunk_tokens = chunk_tokens

    def _loss_fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.llama.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100, reduction="sum")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        hidden = self.llama.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        shards = max(1, math.ceil(hidden.shape[1] / self.chunk_tokens))
        total = TiledFusedLogitsLoss.apply(lambda _, x, y: self._loss_fn(x, y), self, hidden, shift_labels, None,
                                          shards, [self.llama.lm_head.weight], "sum")
        return total


def register(args: argparse.Namespace, cfg: Any) -> Any:
    """``UlyssesSPAttentionHF.register_with_transformers`` from a saved config (0.18 takes a path and
    ``max_length``; 0.19 also a model object and ``seq_length``)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    path = tempfile.mkdtemp(prefix="lz_seq_ds_")
    cfg.save_pretrained(path)
    params = inspect.signature(UlyssesSPAttentionHF.register_with_transformers).parameters
    length = {"seq_length": args.seq_len} if "seq_length" in params else {"max_length": args.seq_len}
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=path, core_attn_implementation="sdpa", sequence_parallel_size=args.devices,
        micro_batch_size=1, seq_length_is_variable=True, **length)


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([it["input_ids"] for it in items])
    return {"input_ids": ids, "position_ids": torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids).contiguous(),
            "labels": ids.clone()}


def with_shift_labels(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What DeepSpeed's SP adapter hands each rank, for one rank holding the whole sequence: labels shifted
    left by one, -100 at the end."""
    labels = batch.pop("labels")
    batch["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    return batch


def run(args: argparse.Namespace) -> int:
    base = {"kind": "error", "config": args.config, "rank": int(os.environ.get("RANK", "0")), "seq_len": args.seq_len}
    try:
        return _run(args)
    except BaseException as exc:  # noqa: BLE001 - the peer fails soft: one row with the reason
        if isinstance(exc, KeyboardInterrupt):
            raise
        import traceback

        traceback.print_exc()
        status = "skipped" if isinstance(exc, ImportError) else classify(exc)
        append_record(args.results_file, {**base, "status": status, "reason": short_reason(exc)})
        return 1


def _run(args: argparse.Namespace) -> int:
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups
    from transformers import LlamaForCausalLM

    from benchmarks.lora_worker import llama_config

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    torch.manual_seed(0)
    watch = HostWatch()
    _, dims = llama_preset(args.model, args.layers, args.seq_len)
    cfg = llama_config(dims)
    local = args.seq_len // args.devices
    mlp_shards = tiles_for(local, dims["hidden_size"])
    patch_tiled_mlp(mlp_shards)
    # One GPU: ALST without Ulysses (DeepSpeed makes no sequence-parallel group for a degree of 1 and its
    # adapter then fails with "No sequence parallel group found"): ZeRO-3, tiled MLP, tiled loss, checkpointing.
    single = args.devices == 1
    mpu = None if single else register(args, cfg)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
        "wall_clock_breakdown": False, **({} if single else {"sequence_parallel_size": args.devices}),
    }
    with deepspeed.zero.Init(config_dict_or_path=ds_config, mpu=mpu):
        llama = LlamaForCausalLM(cfg)
    llama.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    module = _LossModule(llama, args.chunk_tokens)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.0, fused=True if cuda else None)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=ds_config, mpu=mpu)
    if single:
        sp_group, sp_world, sp_rank = torch.distributed.group.WORLD, 1, 0
    else:
        sp_group = groups._get_sequence_parallel_group()
        sp_world = groups._get_sequence_parallel_world_size()
        sp_rank = groups._get_sequence_parallel_rank()
    n_steps = args.steps + (1 if args.profile else 0)
    loader = DataLoader(RandomSequence(n_steps * sp_world + 2, args.seq_len, dims["vocab_size"]), batch_size=1,
                        collate_fn=collate)
    if single:
        loader = map(with_shift_labels, loader)
    else:
        loader = UlyssesSPDataLoaderAdapter(loader, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_world,
                                            device=engine.device)

    def step(batch: dict[str, torch.Tensor]) -> float:
        batch = move_to_device(batch, engine.device)
        shift = batch["shift_labels"]
        total = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"], shift_labels=shift)
        good = (shift != -100).view(-1).sum()
        loss = total / good.clamp_min(1)
        losses = torch.distributed.nn.functional.all_gather(loss, group=sp_group)
        goods = torch.distributed.nn.functional.all_gather(good, group=sp_group)
        loss = sum(losses[r] * goods[r] for r in range(sp_world)) / max(sum(goods), 1)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ulysses = getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "__name__", "") == "uattn_wrapper"  # the recipe took
    times: list[float] = []
    comm: dict[str, Any] = {}
    local_tokens = 0
    last_loss = None
    it = iter(loader)
    for i in range(n_steps):
        batch = next(it)
        local_tokens = int(batch["input_ids"].shape[1])
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if i == args.steps:  # one more step under the profiler
            from benchmarks.sequence_profile import profiled

            with profiled(device, comm):
                step(batch)
            continue
        last_loss = step(batch)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    host_peak = watch.stop()
    record = {
        "kind": "rank", "config": args.config, "mode": "sp", "rank": dist.get_rank(), "world_size": dist.get_world_size(),
        "seq_len": args.seq_len, "layers": dims["num_hidden_layers"], "model": args.model,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu", "step_times_s": times,
        "step_s": times[-1], "tokens_per_s": args.seq_len / times[-1], "flops_per_token": flops_per_token(dims, args.seq_len),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None,
        "peak_rss_bytes": status_bytes("VmHWM"), "host_used_peak_bytes": host_peak, "loss": last_loss,
        "tiles": mlp_shards, "comm": comm or None, "local_tokens": local_tokens, "ulysses_attention": ulysses,
        "notes": f"ALST: UlyssesSPAttentionHF(sdpa){'' if ulysses else ' NOT REGISTERED'}, {local_tokens} tokens per rank, TiledMLP x{mlp_shards}, TiledFusedLogitsLoss x"
                 f"{max(1, math.ceil(local / args.chunk_tokens))}, HF checkpointing, ZeRO-3",
        "versions": {**versions(), "transformers": _version("transformers"), "deepspeed": _version("deepspeed")},
    }
    append_record(args.results_file, record)
    dist.barrier()
    torch.distributed.destroy_process_group()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return worker_main(argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
