"""uneven.py [Note: uneven inputs]: where ranks with loaders of different lengths would part."""

from __future__ import annotations

import pytest

from lightning_zero.uneven import UnevenInputsError, check_training_epoch, first_uneven_batch


def test_equal_or_unsized_loaders_are_never_refused() -> None:
    assert first_uneven_batch([7, 7], 0, 0, -1, 1) is None
    assert first_uneven_batch([float("inf"), float("inf")], 0, 0, -1, 1) is None


def test_the_first_batch_the_short_rank_lacks() -> None:
    assert first_uneven_batch([5, 7], 0, 0, -1, 1) == 5
    assert first_uneven_batch([7, 5, 9], 0, 0, -1, 1) == 5


def test_max_steps_that_ends_the_fit_first_is_left_alone() -> None:
    assert first_uneven_batch([5, 7], 0, 0, 5, 1) is None  # both ranks stop after step 5, as under ddp
    assert first_uneven_batch([5, 7], 0, 0, 6, 1) == 5
    assert first_uneven_batch([5, 7], 0, 10, 16, 1) == 5  # a later epoch: global steps count on


def test_accumulation_parts_ranks_at_the_short_ranks_flush() -> None:
    # accumulate 2: the short rank steps after its 5th batch (epoch end flush), the long one does not
    assert first_uneven_batch([5, 7], 0, 0, -1, 2) == 4
    assert first_uneven_batch([5, 7], 0, 0, 2, 2) is None  # two steps after batches 0-3: the fit ends
    assert first_uneven_batch([6, 7], 0, 0, -1, 2) == 6


def test_a_resumed_epoch_counts_from_its_first_batch() -> None:
    assert first_uneven_batch([5, 7], 3, 3, 5, 1) is None
    assert first_uneven_batch([5, 7], 3, 3, 6, 1) == 5


def test_the_refusal_names_the_rank_the_batch_and_the_fix() -> None:
    with pytest.raises(UnevenInputsError, match=r"rank 1 runs out of training batches at batch 5 of epoch 2.*"
                                                r"use_distributed_sampler"):
        check_training_epoch([7, 5], 2, 0, 20, -1, 1)
