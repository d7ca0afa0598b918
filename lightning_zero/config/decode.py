"""Compiled decoding (``generate(..., compile=True)``; lightning_zero/inference/compiled.py)."""

from __future__ import annotations

from dataclasses import dataclass

COMPILE_MODES = ("reduce-overhead", "default", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class DecodeConfig:
    """How ``generate`` decodes with a static KV cache and a compiled one-token step."""

    mode: str = "reduce-overhead"
    """``torch.compile`` mode of the one-token step. ``"reduce-overhead"`` captures it in a CUDA graph on
    CUDA (one launch per token, no Python per layer); on other devices CUDA graphs do not exist and the step
    compiles with ``"default"`` ([Note: CUDA graphs only on CUDA] in inference/compiled.py)."""

    backend: str = "inductor"
    """``torch.compile`` backend (``"eager"``/``"aot_eager"`` trace without generating code: cheap, for tests)."""

    coordinate_descent: bool = True
    """Compile the step with inductor's ``coordinate_descent_tuning`` (inductor backend only): each generated
    kernel's block sizes searched at compile time, and a one-row matmul decomposed into a reduction that
    fuses what feeds it (gpt-fast's setting for batch-1 decode; the int8/int4 one-row path of
    inference/inductor_wo.py is that reduction). Compiles take longer. On by default: Llama-8B's bf16 batch-1
decode on an H200 ran at 206.7 tokens/s with it against 177.7 without (0.80x against 0.69x the weight
roofline; benchmarks/RESULTS.md, 2026-11-28 10:37)."""

    fullgraph: bool = False
    """Refuse graph breaks in the step (True: an unsupported op in the model is an error instead of a
    slower step split in pieces)."""

    eos_check_every: int = 16
    """With ``eos_token_id``: the host learns whether every row has ended every this many tokens (one
    sync), so the loop runs at most this many - 1 tokens past the end; they are cut from the result,
    which equals the uncompiled path's ([Note: a sync-free decode loop])."""

    cache_multiple: int = 64
    """The static cache holds the prompt plus ``max_new_tokens`` rounded up to a multiple of this, so calls
    of nearby lengths reuse one cache and one compiled step (a longer call reallocates and recompiles)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise ValueError(f"DecodeConfig.mode must be one of {COMPILE_MODES}, got {self.mode!r}.")
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"DecodeConfig.backend must name a torch.compile backend, got {self.backend!r}.")
        if not isinstance(self.coordinate_descent, bool):
            raise ValueError(f"DecodeConfig.coordinate_descent must be True or False, got {self.coordinate_descent!r}.")
        for name in ("eos_check_every", "cache_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DecodeConfig.{name} must be an integer >= 1, got {value!r}.")
