"""One configuration of the LoRA benchmark, in its own process (or torchrun group).

Started by ``benchmarks/lora.py``, one process tree per configuration (see peers_worker.py for why).
Builds a random-weight Llama-style ``transformers.LlamaForCausalLM`` wrapped by ``peft.get_peft_model``
(LoRA r=16 on every attention and MLP projection, ``presets.LORA``), trains it for ``--warmup`` +
``--steps`` steps on random tokens (causal LM loss, torch AdamW over the LoRA parameters only) and
appends one JSON line per rank to ``--results-file``: ``{"kind": "rank", ...}`` with the timed steps
and memory, or ``{"kind": "error", "status": "skipped" | "failed", "reason": ...}``.

[Note: building the model] The network is built in ``LightningModule.configure_model``, inside each
strategy's own initialisation context, so no process ever holds the whole fp32 model on its GPU:

* ``zero3``: lightning_zero's ``model_sharded_context`` puts every parameter on the meta device as
  it is registered (buffers stay real); the engine materialises one unit at a time, calling each
  module's ``reset_parameters()``;
* ``fsdp``/``fsdp_mixed``: built under ``torch.device("meta")`` (Lightning's ``init_module(empty_init=True)``
  path, entered in ``configure_model`` because the Trainer gives FSDP no meta context there); FSDP
  materialises each unit on the GPU as it wraps it, by ``to_empty()`` + ``reset_parameters()``;
* ``deepspeed_stage_3``: Lightning's ``model_sharded_context`` is ``deepspeed.zero.Init`` (each module
  is partitioned as soon as it is constructed);
* ``ddp``: Lightning's ``tensor_init_context``: straight on the GPU, in bf16 (``bf16-true``).

HF's ``LlamaRMSNorm`` and ``LlamaRotaryEmbedding`` have no ``reset_parameters()``: FSDP's meta
materialisation raises ``AttributeError`` on them, and lightning_zero's would leave the norm weights
uninitialised (``torch.empty``). :func:`install_reset_shims` gives such classes one (norm weight = 1,
rotary ``inv_freq`` recomputed from the config), in every configuration alike. Consequence: ``fsdp``
starts from torch's default initialisation of ``nn.Linear``/``nn.Embedding`` (Kaiming-uniform, N(0, 1))
and Kaiming-initialised (not zero) LoRA B matrices; ``zero3`` (since 2026-11-28: zero/materialize.py and
zero/peft_init.py), ``ddp`` and DeepSpeed from HF's ``_init_weights`` (N(0, 0.02)) with zero B matrices:
first-step losses differ a little, the work per step does not.

Run by hand only for debugging, e.g.::

    python benchmarks/lora_worker.py --config ddp --model tiny --device cpu --results-file /tmp/r.jsonl
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning.pytorch as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import LightningModule, Trainer  # noqa: E402
from lightning.pytorch.strategies import Strategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402
from typing_extensions import override  # noqa: E402

from benchmarks.records import (  # noqa: E402
    _shutdown_process_group, _version, append_record, device_info, run_as_row, short_reason, versions, worker_main,
)
from benchmarks.timing import StepTimer  # noqa: E402
from benchmarks.presets import LORA, LORA_PEERS, LORA_PRECISION, llama_lora_counts, llama_preset  # noqa: E402

LR = 1e-4


# ---------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class LoraConfig:
    """How to build one benchmarked strategy, and how its model is built (see [Note: building the model])."""

    name: str
    build: Callable[[argparse.Namespace], Union[str, Strategy]]
    """Worker arguments -> the ``Trainer(strategy=...)`` argument (NotImplementedError/ValueError: skipped)."""
    describe: Callable[[Any], str]
    """The strategy as it ran -> its configuration, for the table (read back from the object, not restated)."""
    meta_init: bool = False
    """Enter ``torch.device("meta")`` in ``configure_model`` (FSDP materialises the units itself)."""
    built: str = ""
    """How the model is built, for the table."""


def _decoder_layer_cls() -> type:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def _zero3(args: argparse.Namespace) -> Strategy:
    from lightning_zero import ZeroStrategy

    return ZeroStrategy(stage=3)


def _describe_zero(strategy: Any) -> str:
    cfg = getattr(strategy, "config", None)
    fields = ("unit_policy", "prefetch_units", "max_live_parameters", "param_persistence_threshold", "bucket_size_mb")
    shown = ", ".join(f"{f}={_compact(getattr(cfg, f))}" for f in fields if hasattr(cfg, f))
    return f"ZeroStrategy(stage=3), defaults: {shown}; units = repeated blocks (LlamaDecoderLayer)"


def _fsdp(args: argparse.Namespace) -> Strategy:
    """Lightning's FSDP as LitGPT's LoRA recipe and Lightning's FSDP guide set it up: one FSDP unit per
    decoder layer, FULL_SHARD, ``use_orig_params=True`` (needed for frozen and trainable parameters in
    one unit; FSDP then keeps gradients for the frozen ones too, and warns so once per unit: the worker
    silences that warning, which lists every parameter name)."""
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(
        auto_wrap_policy={_decoder_layer_cls()},
        sharding_strategy="FULL_SHARD",
        use_orig_params=True,
        limit_all_gathers=True,
        cpu_offload=False,
    )


def _fsdp_peft(args: argparse.Namespace) -> Strategy:
    """FSDP as peft documents it for LoRA (``peft.utils.other.fsdp_auto_wrap_policy``, what its FSDP
    guide hands to accelerate): every leaf module with a trainable weight (each LoRA A/B) is an FSDP unit
    of its own, inside one unit per decoder layer, so the decoder layers' flat parameters are entirely
    frozen and get no gradients (FSDP's own warning about mixed units advises this: "wrap the frozen
    parameters with FSDP separately"). Otherwise as ``fsdp``."""
    from lightning.pytorch.strategies import FSDPStrategy
    from peft.utils.other import fsdp_auto_wrap_policy

    _, tiny = llama_preset("tiny", layers=1)
    with torch.device("meta"):  # the policy reads class names only: any LoRA'd Llama will do
        policy = fsdp_auto_wrap_policy(build_lora_llama(tiny))
    return FSDPStrategy(
        auto_wrap_policy=policy,
        sharding_strategy="FULL_SHARD",
        use_orig_params=True,
        limit_all_gathers=True,
        cpu_offload=False,
    )


def _describe_fsdp(strategy: Any) -> str:
    kwargs = dict(getattr(strategy, "kwargs", {}))
    policy = kwargs.pop("auto_wrap_policy", None)
    classes = policy if isinstance(policy, (set, frozenset)) else getattr(policy, "_module_classes", None)  # ModuleWrapPolicy
    if classes:
        policy_text = "{" + ", ".join(sorted(c.__name__ for c in classes)) + "}"
    elif "_or_policy" in repr(policy):
        policy_text = "peft.utils.other.fsdp_auto_wrap_policy(model) (each trainable leaf, i.e. LoRA A/B, + LlamaDecoderLayer)"
    else:
        policy_text = _compact(policy)
    sharding = getattr(getattr(strategy, "sharding_strategy", None), "name", None)
    cpu_offload = getattr(getattr(strategy, "cpu_offload", None), "offload_params", False)
    mp = getattr(strategy, "mixed_precision_config", None)
    mp_text = (
        f"MixedPrecision(param={_dtype(mp.param_dtype)}, reduce={_dtype(mp.reduce_dtype)}, buffer={_dtype(mp.buffer_dtype)})"
        if mp is not None else "no MixedPrecision"
    )
    rest = ", ".join(f"{k}={_compact(v)}" for k, v in sorted(kwargs.items()))
    return (f"FSDPStrategy(sharding_strategy={sharding}, auto_wrap_policy={policy_text}, {rest}, "
            f"cpu_offload={cpu_offload}); {mp_text}")


def _deepspeed(args: argparse.Namespace) -> Strategy:
    """Lightning's ``deepspeed_stage_3`` preset (its documented defaults); torch AdamW as DeepSpeed's
    client optimizer (``zero_allow_untested_optimizer`` is on by default), so no op needs a JIT build."""
    import deepspeed  # noqa: F401  (fail here, with DeepSpeed's own message, if it cannot be imported)
    from lightning.pytorch.strategies import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=3, logging_batch_size_per_gpu=args.micro_batch)


def _describe_deepspeed(strategy: Any) -> str:
    config = getattr(strategy, "config", None) or {}
    zero = dict(config.get("zero_optimization", {}))
    stage = zero.pop("stage", "?")
    zero_text = ", ".join(f"{k}={_compact(v)}" for k, v in sorted(zero.items()))
    bf16 = (config.get("bf16") or {}).get("enabled")
    # the stage-3 settings Lightning leaves to DeepSpeed, as the engine resolved them
    zc = getattr(getattr(getattr(strategy, "deepspeed_engine", None), "_config", None), "zero_config", None)
    fields = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance")
    resolved = ", ".join(f"stage3_{f}={_compact(getattr(zc, f))}" for f in fields if hasattr(zc, f))
    return (f"DeepSpeedStrategy(stage={stage}) defaults, deepspeed.zero.Init: zero_optimization {{{zero_text}}}; "
            f"bf16.enabled={bf16}; DeepSpeed's defaults: {resolved or 'stage3_* (not read back)'}")


def _ddp(args: argparse.Namespace) -> str:
    return "ddp"


def _describe_ddp(strategy: Any) -> str:
    kwargs = getattr(strategy, "_ddp_kwargs", {}) or {}
    extra = ", ".join(f"{k}={_compact(v)}" for k, v in sorted(kwargs.items()))
    return f"DDPStrategy defaults ({extra or 'find_unused_parameters=False'}): full bf16 replica per GPU"


CONFIGS: dict[str, LoraConfig] = {
    c.name: c
    for c in (
        LoraConfig("zero3", _zero3, _describe_zero,
                   built="configure_model: parameters on meta, materialised and sharded unit by unit"),
        LoraConfig("fsdp", _fsdp, _describe_fsdp, meta_init=True,
                   built="configure_model under torch.device('meta'); FSDP materialises per unit (reset_parameters)"),
        LoraConfig("fsdp_mixed", _fsdp, _describe_fsdp, meta_init=True,
                   built="configure_model under torch.device('meta'); FSDP materialises per unit (reset_parameters)"),
        LoraConfig("deepspeed_stage_3", _deepspeed, _describe_deepspeed,
                   built="configure_model under deepspeed.zero.Init"),
        LoraConfig("fsdp_peft", _fsdp_peft, _describe_fsdp, meta_init=True,
                   built="configure_model under torch.device('meta'); FSDP materialises per unit (reset_parameters)"),
        LoraConfig("ddp", _ddp, _describe_ddp, built="configure_model on the device, in bf16 (Lightning's tensor_init_context)"),
    )
}
assert set(CONFIGS) == set(LORA_PEERS), "presets.LORA_PEERS and lora_worker.CONFIGS must name the same configurations"


def _compact(value: Any) -> str:
    """2e8 for 200000000, sets and types by name, everything else by repr (short)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)) and abs(value) >= 1e5 and float(value).is_integer():
        mant, exp = f"{float(value):e}".split("e")
        return f"{float(mant):g}e{int(exp)}"
    if isinstance(value, type):
        return value.__name__
    if isinstance(value, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(_compact(v) for v in value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={_compact(v)}" for k, v in sorted(value.items())) + "}"
    return str(value)[:80]


def _dtype(dtype: Optional[torch.dtype]) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "None"


# ---------------------------------------------------------------------------------------------------- model


def _norm_reset_parameters(self: nn.Module) -> None:
    """reset_parameters() for a norm without one (HF's RMSNorm): weight 1, bias 0."""
    with torch.no_grad():
        if isinstance(getattr(self, "weight", None), torch.Tensor):
            self.weight.fill_(1.0)
        if isinstance(getattr(self, "bias", None), torch.Tensor):
            self.bias.zero_()


def _default_inv_freq(config: Any, dim_tensor: torch.Tensor) -> torch.Tensor:
    """RoPE's inverse frequencies from the config (the default rope type), sized like ``dim_tensor``."""
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0
    dim = 2 * dim_tensor.numel()
    return 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def _rotary_reset_parameters(self: nn.Module) -> None:
    """reset_parameters() for HF's rotary embedding: recompute its ``inv_freq`` buffer(s) from the config.

    A fresh module built on the CPU gives the values (whatever the rope type); if its constructor has
    another signature in this transformers version, the default RoPE formula does.
    """
    inv = getattr(self, "inv_freq", None)
    if not isinstance(inv, torch.Tensor) or inv.is_meta:
        raise RuntimeError(f"{type(self).__name__}.inv_freq has no storage to initialise")
    try:
        with torch.device("cpu"):
            fresh = type(self)(config=self.config).inv_freq
    except Exception:  # noqa: BLE001 - older/newer constructor signature
        fresh = _default_inv_freq(self.config, inv)
    with torch.no_grad():
        inv.copy_(fresh.to(dtype=inv.dtype))
        orig = getattr(self, "original_inv_freq", None)
        if "original_inv_freq" in self._buffers and isinstance(orig, torch.Tensor) and not orig.is_meta:
            orig.copy_(inv)
        elif "original_inv_freq" not in self._buffers:
            self.original_inv_freq = inv  # transformers 4.x keeps it as a plain attribute


def install_reset_shims(model: nn.Module) -> list[str]:
    """Give every module class of ``model`` that holds parameters or buffers directly but has no
    ``reset_parameters()`` one (see [Note: building the model]); returns the classes patched."""
    patched: list[str] = []
    for module in model.modules():
        cls = type(module)
        if hasattr(cls, "reset_parameters"):
            continue
        states = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if not states:
            continue
        name = cls.__name__
        if "Rotary" in name:
            cls.reset_parameters = _rotary_reset_parameters  # type: ignore[attr-defined]
        elif "Norm" in name:
            cls.reset_parameters = _norm_reset_parameters  # type: ignore[attr-defined]
        else:
            raise TypeError(f"{name} holds parameters/buffers but has no reset_parameters(): no initialiser known")
        patched.append(name)
    return patched


def llama_config(dims: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=dims["hidden_size"],
        intermediate_size=dims["intermediate_size"],
        num_hidden_layers=dims["num_hidden_layers"],
        num_attention_heads=dims["num_attention_heads"],
        num_key_value_heads=dims["num_key_value_heads"],
        vocab_size=dims["vocab_size"],
        max_position_embeddings=dims["seq_len"],
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    cfg._attn_implementation = "sdpa"  # older transformers ignore the keyword in the constructor
    return cfg


def build_lora_llama(dims: dict[str, int]) -> nn.Module:
    """LlamaForCausalLM(random weights) wrapped by peft with :data:`presets.LORA`, in the current context."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(dims))
    lora = PeftLoraConfig(
        r=LORA["r"], lora_alpha=LORA["lora_alpha"], lora_dropout=LORA["lora_dropout"],
        target_modules=list(LORA["target_modules"]), task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def count_params(dims: dict[str, int]) -> tuple[int, int]:
    """(all, trainable) parameters of the LoRA'd model, counted on the meta device."""
    with torch.device("meta"):
        model = build_lora_llama(dims)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.parameters() if p.requires_grad)


class LoraLlamaModule(LightningModule):
    """The LoRA'd Llama, built in ``configure_model`` (see [Note: building the model])."""

    def __init__(self, dims: dict[str, int], meta_init: bool, act_ckpt: bool, fused: Optional[bool]) -> None:
        super().__init__()
        self.dims = dims
        self.meta_init = meta_init
        self.act_ckpt = act_ckpt
        self.fused = fused
        self.model: Optional[nn.Module] = None
        self.patched: list[str] = []
        counts = llama_lora_counts(dims)
        self.flops_per_token = counts["flops_per_token"]

    @override
    def configure_model(self) -> None:
        if self.model is not None:  # runs again for validate/test: idempotent
            return
        with torch.device("meta") if self.meta_init else nullcontext():
            model = build_lora_llama(self.dims)
        self.patched = install_reset_shims(model)
        if self.act_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        assert self.model is not None
        return self.model(input_ids=ids, labels=ids).loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=self.fused)


class RandomTokens(Dataset):
    """``n`` samples of ``seq_len`` uniform random token ids, the same on every rank (seeded by index)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        self.n, self.seq_len, self.vocab, self.seed = n, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return (torch.randint(0, self.vocab, (self.seq_len,), generator=g),)


# ---------------------------------------------------------------------------------------------------- timing


class LoraTimer(StepTimer):
    """:class:`timing.StepTimer` that also splits peak memory at the start of the timed steps.

    ``peak_allocated`` (read at train end, as in the peer benchmark) then covers the timed steps only;
    ``init_peak`` holds the peak of everything before them (model build, strategy setup, warm-up
    steps), read just before ``torch.cuda.reset_peak_memory_stats``. The whole run's peak is the larger.
    ``start_allocated`` is what is allocated when training starts: the model states a strategy keeps.
    """

    def __init__(self, warmup: int) -> None:
        super().__init__(warmup)
        self.init_peak = 0
        self.start_allocated = 0
        self._split = False

    def _split_peak(self) -> None:
        self._split = True
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            self.init_peak = torch.cuda.max_memory_allocated(self._device)
            torch.cuda.reset_peak_memory_stats(self._device)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._device is not None and self._device.type == "cuda":
            self.start_allocated = torch.cuda.memory_allocated(self._device)
        if self.warmup == 0:
            self._split_peak()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self._split and self.steps_seen == self.warmup:
            self._split_peak()


# ---------------------------------------------------------------------------------------------------- run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, choices=sorted(CONFIGS))
    p.add_argument("--model", default="8b", help="llama_8b/8b or llama_tiny/tiny")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of decoder layers")
    p.add_argument("--seq-len", type=int, default=None, help="override the preset's sequence length")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--act-ckpt", action="store_true", help="HF gradient checkpointing (non-reentrant)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--devices", type=int, default=1, help="processes (GPUs) in this run")
    p.add_argument("--no-fused", action="store_true", help="torch AdamW without fused=True")
    p.add_argument("--results-file", type=Path, required=True)
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace, strategy: Union[str, Strategy], timer: StepTimer) -> Trainer:
    """A Trainer that does nothing but train (no validation, checkpoints, logger, progress bar or summary)."""
    return L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=args.devices,
        num_nodes=1,
        strategy=strategy,
        precision=LORA_PRECISION[args.config],
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=None,
        callbacks=[timer],
    )


def rank_record(
    args: argparse.Namespace, trainer: Trainer, module: LoraLlamaModule, timer: LoraTimer,
    counts: tuple[int, int], spec: LoraConfig,
) -> dict[str, Any]:
    name, peak = device_info(trainer.strategy.root_device)
    whole = max(timer.peak_allocated, timer.init_peak)
    timed = timer.peak_allocated
    if args.device != "cuda":
        from lightning_zero.logging.metrics import peak_host_rss_bytes

        whole = timed = peak_host_rss_bytes() or 0
    try:
        description = spec.describe(trainer.strategy)
    except Exception as exc:  # noqa: BLE001 - a description must not cost the row
        description = f"{type(trainer.strategy).__name__} ({short_reason(exc)})"
    loss = float(timer.last_loss) if timer.last_loss is not None else None
    return {
        "kind": "rank",
        "config": args.config,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "device_type": args.device,
        "device_name": name,
        "peak_flops": peak,
        "step_times_s": timer.step_times,
        "inner_times_s": timer.inner_times,
        "tokens_per_step_local": timer.tokens_per_step,
        "peak_mem_bytes": whole,
        "peak_timed_bytes": timed,
        "peak_init_bytes": timer.init_peak,
        "start_allocated_bytes": timer.start_allocated,
        "peak_reserved_bytes": timer.peak_reserved,
        "final_loss": loss if loss is None or math.isfinite(loss) else float("nan"),
        "fused": not args.no_fused and args.device == "cuda",
        "flops_per_token": float(module.flops_per_token),
        "n_params": counts[0],
        "n_trainable": counts[1],
        "versions": {**versions(), "transformers": _version("transformers"), "peft": _version("peft")},
        "micro_batch": args.micro_batch,
        "precision": LORA_PRECISION[args.config],
        "strategy_class": type(trainer.strategy).__name__,
        "config_desc": description,
        "built": spec.built,
        "shims": module.patched,
        "act_ckpt": args.act_ckpt,
    }


def run(args: argparse.Namespace) -> int:
    spec = CONFIGS[args.config]
    return run_as_row(args, lambda: spec.build(args), lambda strategy: _fit(args, spec, strategy))


def _fit(args: argparse.Namespace, spec: "LoraConfig", strategy: Any) -> None:
    L.seed_everything(0, verbose=False)
    torch.set_float32_matmul_precision("high")
    _, dims = llama_preset(args.model, args.layers, args.seq_len)
    counts = count_params(dims)
    timer = LoraTimer(args.warmup)
    trainer = build_trainer(args, strategy, timer)
    fused = True if args.device == "cuda" and not args.no_fused else None
    module = LoraLlamaModule(dims, spec.meta_init, args.act_ckpt, fused)
    n_samples = (args.warmup + args.steps + 1) * args.micro_batch * args.devices
    loader = DataLoader(RandomTokens(n_samples, dims["seq_len"], dims["vocab_size"]), batch_size=args.micro_batch)
    trainer.fit(module, train_dataloaders=loader)
    if len(timer.step_times) < args.steps:
        raise RuntimeError(f"only {len(timer.step_times)} of {args.steps} timed steps ran")
    append_record(args.results_file, rank_record(args, trainer, module, timer, counts, spec))
    _shutdown_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    return worker_main(argv, parse_args, run,
                       ignore=(".*has both parameters with requires_grad=True and False.*",))  # see _fsdp


__all__ = ["CONFIGS", "LoraConfig", "LoraLlamaModule", "LoraTimer", "install_reset_shims", "build_lora_llama", "main"]


if __name__ == "__main__":
    sys.exit(main())
