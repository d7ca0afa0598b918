"""Settings every test process inherits, the workers the tests launch included."""

from __future__ import annotations

import os

# A worker that dies of a signal (SIGABRT, SIGSEGV) prints every Python thread's stack: the one
# intermittent abort at the exit of multi-fit gloo workers could not be diagnosed without it
# (lightning_zero/comm/collectives.py [Note: destroy at exit]).
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _compile_stance_is_restored() -> object:
    """Each in-process test starts at torch.compile's default stance. Stage 3's first-batch ReadWatch sets
    ``force_eager`` until the next batch or teardown (read_watch.py); a test that stops after one batch
    without tearing down (Fabric calls no teardown) left it set, and every later compile test in the pytest
    process then ran eagerly and failed (CI, 2026-11-28). Such a test fails here, naming itself."""
    yield
    import torch
    from torch._dynamo import eval_frame

    stance = eval_frame._stance.stance
    if stance != "default":
        torch.compiler.set_stance("default")
        pytest.fail(f"the test left torch.compile's stance at {stance!r}: end stage 3's first-batch watch "
                    "(strategy.teardown(), or run a second batch)")
