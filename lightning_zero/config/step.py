"""What an optimizer step does with a non-finite gradient norm (zero/engine.py [Note: non-finite steps])."""

from __future__ import annotations

from dataclasses import dataclass


VALID_NONFINITE = ("skip", "error", "ignore")


@dataclass
class StepConfig:
    """Non-finite steps: skip, stop or step anyway."""

    nonfinite: str = "skip"
    """What a step whose global gradient norm is NaN or infinite does, at every stage and precision
    (lightning_zero/zero/engine.py [Note: non-finite steps]). 'skip': the step is skipped on every rank
    (weights and optimizer state untouched, the gradients dropped), one warning names the step and the
    first parameter group holding a non-finite gradient, ``train/skipped_steps`` counts it, and
    ``max_nonfinite_steps`` skips in a row stop the run with an error. 'error': the first one stops the
    run. 'ignore': the optimizer steps anyway (torch's and ddp's behaviour: NaN weights from then on).
    fp16 (``16-mixed``): an overflow the loss scale can still absorb is skipped as always (the scale is
    lowered); this setting judges overflows at the minimum scale. The check reads the norm the step
    computes anyway: one host synchronisation per step (fp16 and gradient clipping read it already), and
    with CPU optimizer offload 'skip' and 'error' turn off ``offload_step_in_backward`` (an update made
    during backward cannot be taken back); 'ignore' restores both."""

    max_nonfinite_steps: int = 8
    """With ``nonfinite='skip'``: this many non-finite steps in a row stop the run (a diverged run, or
    NaN in the data, would otherwise skip forever)."""


    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.nonfinite not in VALID_NONFINITE:
            raise ValueError(f"nonfinite must be one of {list(VALID_NONFINITE)}, got {self.nonfinite!r}.")
        m = self.max_nonfinite_steps
        if isinstance(m, bool) or not (isinstance(m, int) and m >= 1):
            raise ValueError(f"max_nonfinite_steps must be an integer >= 1, got {m!r}.")
