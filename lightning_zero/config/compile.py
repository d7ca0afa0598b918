"""torch.compile settings (lightning_zero/zero/compile.py, the one call site of torch.compile)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


COMPILE_ARGS = frozenset({"backend", "mode", "fullgraph", "dynamic", "options", "disable"})
"""Keyword arguments of ``torch.compile`` that ``compile_options`` may set."""


@dataclass
class CompileConfig:
    """Whether units are compiled one by one, and with which torch.compile arguments."""

    compile: bool = False
    """torch.compile each unit one by one (stage 3's units; below stage 3 the repeated blocks the same
    policy finds), with ZeRO-3's gather/release hooks outside the compiled regions, as FSDP2 does with
    per-block compile (lightning_zero/zero/compile.py). Without it, a network the user compiled
    still works under every stage; under stage 3 the user's whole-network compile is moved onto the
    units ([Note: the user's compile under stage 3]). The first batch of each kind runs eagerly under stage 3."""

    compile_options: Optional[dict[str, Any]] = None
    """With ``compile``: keyword arguments of ``torch.compile`` (``backend``, ``mode``, ``fullgraph``,
    ``dynamic``, ``options``); None uses torch's defaults (inductor)."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}.")
        if self.compile_options is not None:
            if not isinstance(self.compile_options, dict):
                raise ValueError(f"compile_options must be a dict of torch.compile arguments, got {self.compile_options!r}.")
            bad = sorted(set(self.compile_options) - COMPILE_ARGS)
            if bad:
                raise ValueError(f"compile_options has unknown torch.compile argument(s) {bad}; valid: {sorted(COMPILE_ARGS)}.")
            if not self.compile:
                raise ValueError("compile_options is set but compile is False: set compile=True too.")
