"""FP8 linears under every ZeRO stage: the model's ``nn.Linear``s swapped for torchao's ``Float8Linear``.

[Note: FP8 linears are torchao's]
torchao's float8 training (``convert_to_float8_training``) is the maintained recipe: dynamic scaling per
tensor or per row, e4m3 forward and e5m2 (or e4m3) gradients, ``torch._scaled_mm`` on GPUs with fp8, and a
``torch.compile``-friendly casting path that fuses the amax and the cast (what makes fp8 faster; without
compile the casts cost more than the GEMM saves). We use it as it is, an optional extra
(``pip install 'lightning_zero[fp8]'``); nothing of the fp8 math is our own. Ours is only the glue: which
Linears (config/fp8.py: a name filter, the first and last kept in bf16), the refusals that would otherwise
surface as a cryptic error mid-step (no fp8 on the GPU, dims not divisible by 16, a precision that is not
bf16-mixed, a Linear quantized already; at the forward, a training micro-batch whose token count is not a
multiple of 16: [Note: float8 weight gradients need rows in sixteens]), the log of what was converted, and
the place in the setup.

Why it composes with ZeRO without more code: ``Float8Linear.from_float`` keeps the Linear's own ``weight``
and ``bias`` Parameters (the same objects, so the same values and the same state-dict names: checkpoints of
an fp8 run load into a plain model and back), and the conversion runs before the optimizers and engines are
built (apply.py, step 0), so the optimizer, the flat buffers of stages 1-2 and the units of stage 3 see the
converted modules' parameters. Each engine keeps its weights in the compute dtype (bf16) and fp32 masters;
``Float8Linear`` casts the bf16 weight to float8 at each forward (stage 3: the gathered weight), so the
all-gathers stay in bf16 (torchao's fp8 all-gather is FSDP2's, not ours: a later step).

The conversion is idempotent: Lightning runs the setup again for validate/test/predict on the same module,
so a ``Float8Linear`` this module made (marked ``_lightning_zero_fp8``) is kept as it is; any other is the
user's and is refused (two owners of one conversion train differently from what either asked).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_zero.config.fp8 import Fp8Config

MARK = "_lightning_zero_fp8"
"""Attribute set on the ``Float8Linear``s this module made (the recipe's name)."""


@dataclasses.dataclass
class Fp8Plan:
    """Which Linears compute in float8 and which stay in the compute dtype, by fully qualified name."""

    recipe: str
    converted: list[str]
    kept: list[str]
    emulate: bool

    def message(self) -> str:
        kept = ", ".join(self.kept) if self.kept else "none"
        how = " (emulated: float8 casts, matmuls in higher precision)" if self.emulate else ""
        return (f"fp8={self.recipe!r}{how}: {len(self.converted)} Linear(s) compute in float8, "
                f"{len(self.kept)} kept in bf16: {kept}")


def torchao_float8() -> SimpleNamespace:
    """The three names of torchao's float8 training we use, or a one-line error naming the extra."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("fp8=... needs torchao's float8 training: pip install 'lightning_zero[fp8]' "
                          f"(torchao>=0.14) ({e}).") from None
    return SimpleNamespace(Float8Linear=Float8Linear, Float8LinearConfig=Float8LinearConfig,
                           convert_to_float8_training=convert_to_float8_training)


def check_device(device: torch.device, emulate: bool) -> None:
    """Refuse a device without fp8 matmuls unless emulating."""
    if emulate:
        return
    if device.type != "cuda":
        raise RuntimeError(f"fp8 matmuls need a CUDA GPU with compute capability >= 8.9 (got device {device}); "
                           "fp8_emulate=True runs fp8's numerics without them (no speedup).")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise RuntimeError(f"fp8 needs a GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell); "
                           f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}.")


def check_precision(precision: str) -> None:
    if precision != "bf16-mixed":
        raise ValueError(f"fp8 needs precision='bf16-mixed' (bf16 weights and activations around the float8 "
                         f"matmuls, fp32 masters), got {precision!r}.")


def plan(module: nn.Module, config: Fp8Config) -> Fp8Plan:
    """Which Linears to convert (raising for those that cannot be): every ``nn.Linear`` but the first and last
    (``fp8_keep_first_last``) and those whose name contains an ``fp8_filter`` substring."""
    float8 = torchao_float8()
    assert config.fp8 is not None
    linears: list[tuple[str, nn.Linear]] = []
    for name, m in module.named_modules():
        if isinstance(m, float8.Float8Linear) and getattr(m, MARK, None) is None:
            raise ValueError(f"fp8: Linear {name!r} is a Float8Linear already (converted outside the strategy): "
                             "pass the plain model and let ZeroStrategy(fp8=...) convert it.")
        if isinstance(m, nn.Linear):
            if not _plain_weight(m.weight):
                raise ValueError(f"fp8: Linear {name!r} is quantized already ({type(m.weight).__name__}, "
                                 f"{m.weight.dtype}); fp8 converts plain Linears only.")
            linears.append((name, m))
    if not linears:
        raise ValueError("fp8=... found no nn.Linear in the model: nothing would compute in float8.")
    ends = {linears[0][0], linears[-1][0]} if config.fp8_keep_first_last else set()
    filters = config.fp8_filter or []
    converted, kept = [], []
    for name, m in linears:
        (kept if name in ends or any(f in name for f in filters) else converted).append(name)
    odd = [f"{n} ({m.in_features}x{m.out_features})" for n, m in linears
           if n in converted and (m.in_features % 16 or m.out_features % 16)]
    if odd:
        raise ValueError(f"fp8 needs both dims of a float8 Linear divisible by 16; not so for {', '.join(odd)}: "
                         "keep them in bf16 with fp8_filter=[...].")
    held = [f"{n} ({what})" for n, m in linears if n in converted and not isinstance(m, float8.Float8Linear)
            for what in [_attachments(m)] if what]
    if held:
        raise ValueError(f"fp8 would drop what is attached to {', '.join(held)} (Float8Linear is a new module "
                         "holding the same Parameters): keep them in bf16 with fp8_filter=[...].")
    if not converted:
        raise ValueError(f"fp8={config.fp8!r} would convert no Linear (all {len(kept)} kept by fp8_keep_first_last "
                         "and fp8_filter).")
    return Fp8Plan(config.fp8, converted, kept, config.fp8_emulate)


def linear_config(recipe: str, emulate: bool) -> Any:
    """torchao's ``Float8LinearConfig`` of a recipe name, emulated or not."""
    cfg = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, emulate=emulate) if emulate else cfg


def convert(module: nn.Module, config: Fp8Config, device: torch.device, precision: str,
            info: Callable[[str], None] = rank_zero_info) -> Optional[Fp8Plan]:
    """Swap the planned Linears of ``module`` for ``Float8Linear`` (same Parameters); None when fp8 is off.
    Raises one line for what cannot train in fp8 here; logs which Linears were converted and which kept."""
    if config.fp8 is None:
        return None
    check_precision(precision)
    check_device(device, config.fp8_emulate)
    p = plan(module, config)
    todo = set(p.converted)
    float8 = torchao_float8()
    fresh = [n for n, m in module.named_modules() if n in todo and not isinstance(m, float8.Float8Linear)]
    if fresh:
        float8.convert_to_float8_training(module, config=linear_config(p.recipe, p.emulate),
                                          module_filter_fn=lambda m, fqn: fqn in todo)
        for name, m in module.named_modules():
            if name in todo:
                setattr(m, MARK, p.recipe)
                if not p.emulate and name in fresh:  # [Note: float8 weight gradients need rows in sixteens]
                    m.register_forward_pre_hook(_rows_guard(name))
        info(p.message())
    return p


# [Note: float8 weight gradients need rows in sixteens]
# ``torch._scaled_mm`` needs mat1's inner dim and both of mat2's dims divisible by 16. The forward
# (x @ w.T) and the input gradient (dy @ w) only ever have the Linear's own dims there (checked in
# ``plan``), but the weight gradient (dy.T @ x) contracts over the rows of x, the tokens of this
# micro-batch: any count not a multiple of 16 (a sequence length of 77, a collator padding to the longest
# sample) fails inside backward with a GEMM shape error, possibly many steps in (torchao pads only with
# ``pad_inner_dim``, off by default: it copies both operands of every GEMM). A forward pre-hook on each
# real (not emulated) float8 Linear that backward will run through says so before the forward instead,
# naming the Linear and what to do. torchao's backward computes the weight gradient whenever it runs, so
# a frozen Linear (a LoRA base) that an earlier trainable layer's gradient flows through needs it too.
# Emulation multiplies in fp32 (no such constraint) and gets no hook.
ROWS_MULTIPLE = 16
"""Rows (tokens) per micro-batch a real float8 Linear's weight-gradient GEMM needs a multiple of."""


def _rows_guard(name: str) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook refusing a training micro-batch whose row count the weight-gradient GEMM cannot take."""

    def check(module: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        if not (torch.is_tensor(x) and x.dim() and torch.is_grad_enabled()
                and (x.requires_grad or module.weight.requires_grad)):
            return  # no backward through this Linear
        rows = x.numel() // max(1, x.shape[-1])
        if rows % ROWS_MULTIPLE:
            raise ValueError(f"fp8: Linear {name!r} got {rows} rows (tokens) in this training micro-batch; float8 "
                             f"weight gradients need a multiple of {ROWS_MULTIPLE} (torch._scaled_mm): pad batches "
                             f"to a multiple of {ROWS_MULTIPLE} tokens (e.g. the collator's pad_to_multiple_of="
                             f"{ROWS_MULTIPLE}) or keep this Linear in bf16 with fp8_filter=[...].")

    return check


def _plain_weight(w: torch.Tensor) -> bool:
    """A floating-point weight that is a plain tensor (or a tensor-parallel DTensor), not a quantized subclass."""
    if not w.is_floating_point():
        return False
    data = w.data
    return type(data) is torch.Tensor or type(data).__name__ == "DTensor"


def _attachments(m: nn.Module) -> str:
    """What a swap for a new module would silently lose: hooks registered on the Linear, parametrizations
    (weight norm: ``weight`` is computed, not a Parameter)."""
    from torch.nn.utils import parametrize

    names = [h.strip("_") for h in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
             if getattr(m, h, None)]
    if parametrize.is_parametrized(m):
        names.append("parametrizations")
    return ", ".join(names)
