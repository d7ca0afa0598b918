"""trainer_checks.py: which Lightning callbacks the ZeRO strategy refuses when fit sets up (in one process;
the distributed behaviour, and ddp's, is tests/callbacks/test_callbacks_parity.py)."""

from __future__ import annotations

import pytest
from lightning.pytorch import callbacks as lightning_callbacks
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    GradientAccumulationScheduler,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelPruning,
    StochasticWeightAveraging,
)
from lightning.pytorch.utilities import GradClipAlgorithmType

from lightning_zero.precision import ZeroPrecision
from lightning_zero.trainer_checks import check_callbacks


class MyFinetuning(BackboneFinetuning):
    pass


EMA = getattr(lightning_callbacks, "EMAWeightAveraging", None)
"""New in Lightning 2.6 (its base class WeightAveraging is refused where it exists)."""


@pytest.mark.parametrize("callback,says", [
    (MyFinetuning(), "MyFinetuning unfreezes parameters"),
    (StochasticWeightAveraging(swa_lrs=0.1), "StochasticWeightAveraging reads and overwrites"),
    (ModelPruning("l1_unstructured", amount=0.1), "ModelPruning re-registers"),
    *([(EMA(decay=0.9), "EMAWeightAveraging reads the module's parameters")] if EMA is not None else []),
])
def test_callbacks_that_edit_parameters_are_refused(callback: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        check_callbacks([ModelCheckpoint(), callback])


def test_callbacks_that_train_as_under_ddp_pass() -> None:
    check_callbacks([ModelCheckpoint(), EarlyStopping(monitor="x"), LearningRateMonitor(),
                     GradientAccumulationScheduler({0: 1, 2: 3})])


def test_clip_request_is_popped_once_with_its_algorithm() -> None:
    p = ZeroPrecision("32-true")
    p.clip_gradients(None, 0.5, GradClipAlgorithmType.VALUE)  # type: ignore[arg-type]
    assert p.pop_clip() == (None, 0.5) and p.pop_clip() == (None, None)
    p.clip_gradients(None, 2.0, "norm")  # type: ignore[arg-type]
    assert p.pop_clip() == (2.0, None)
    p.clip_gradients(None, 0.0, "value")  # type: ignore[arg-type]
    assert p.pop_clip() == (None, None)
