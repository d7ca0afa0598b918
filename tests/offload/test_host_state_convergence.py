"""Convergence of the compact host Adam states (issue #15, item 4) against fp32 Adam on the example GPT.

The example GPT at the ``gpt_tiny`` shape (vocab 256, 2 layers, 4 heads, d_model 64; context 32
instead of 64 to fit CI's 2 cores: 118,528 parameters) trains for 300 steps on byte tokens of
Python's documentation (examples/data.py), batches of 16 random windows drawn from a fixed seed,
with AdamW (lr 1e-3 cosine-decayed to 1e-4, betas 0.9/0.99, weight decay 0.1 on every parameter).
Every run goes the way the offload engine goes: one flat partition, a ``HostAdamState`` stepped by
``host_states.step`` with bf16 gradients in and the bf16 compute copy (``out16``) out, which the model
then computes with in fp32 arithmetic. Only the state precision differs between runs; fp32 is
today's layout (the ``cpu_adam`` op), the oracle.

The check: the mean loss of the last 20 steps is within 2 % of fp32's. It has teeth: a negative
control (fp32 moments, but the master rounded to nearest bf16 after every step, i.e. plain bf16
AdamW's master) ends 3.0-3.3 % worse (three data seeds), because updates below half a bf16 ulp are
lost as the learning rate decays; that is what stochastic rounding and Kahan compensation are for.
Measured (torch 2.13 CPU; data seed 0 as below, then seeds 1 and 2):
fp32 2.6305 / 2.5888 / 2.5952; bf16_sr +0.01 / -0.02 / +0.04 %; bf16_kahan -0.01 / -0.00 / -0.02 %;
int8 -0.64 / -0.67 / -0.74 %; control +3.07 / +3.03 / +3.33 %. The runs are deterministic (any
thread count), so the margins are what a CI run sees.

The device path (``state_precision``, issue #33; zero/states16.py) runs the same training through a ZeRO-2
engine whose bf16 master and moments live where the model's weights are, checked within 1 %: measured
(data seed 0) device bf16_sr +0.02 %, device bf16_kahan +0.02 % of fp32.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from data import load_corpus, tokenize  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

from lightning_zero.config import StatePrecisionConfig  # noqa: E402
from lightning_zero.offload.cpu import AdamHyper  # noqa: E402
from lightning_zero.optim.host_states import HostAdamState, HostStatePrecision, load_host_op, step  # noqa: E402
from lightning_zero.zero.stage2 import Stage2Engine  # noqa: E402

CFG = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, seq_len=32)
BATCH, STEPS, LAST = 16, 300, 20
LR, MIN_LR, BETAS, WD = 1e-3, 1e-4, (0.9, 0.99), 0.1
TOLERANCE = 0.02
DEVICE_TOLERANCE = 0.01
COMPACT: tuple[HostStatePrecision, ...] = ("bf16_sr", "bf16_kahan", "int8")
DEVICE = ("bf16_sr", "bf16_kahan")
"""``state_precision`` of the device path (zero/states16.py), run as ``device_<precision>``."""


def _batches() -> Iterator[tuple[Tensor, Tensor]]:
    tokens = tokenize(load_corpus())
    train = tokens[: int(tokens.numel() * 0.95)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        starts = torch.randint(0, train.numel() - CFG.seq_len - 1, (BATCH,), generator=gen)
        window = train[starts[:, None] + torch.arange(CFG.seq_len + 1)]
        yield window[:, :-1], window[:, 1:]


def _lr(k: int) -> float:
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * (k - 1) / (STEPS - 1)))


def _round_master_to_nearest(state: HostAdamState) -> None:
    state.master.copy_(state.master.to(torch.bfloat16))


def _train(precision: HostStatePrecision, after_step: Optional[Callable[[HostAdamState], None]] = None) -> list[float]:
    torch.manual_seed(0)
    model = GPT(CFG)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    state = HostAdamState.zeros(numel, precision, seed=1)
    state.import_fp32(torch.cat([p.detach().reshape(-1) for p in params]))
    out16 = torch.empty(numel, dtype=torch.bfloat16)
    grad16 = torch.empty(numel, dtype=torch.bfloat16)
    views = list(zip(params, out16.split([p.numel() for p in params]), grad16.split([p.numel() for p in params])))

    def upload() -> None:  # the compute weights are the bf16 copy
        with torch.no_grad():
            for p, w, _ in views:
                p.copy_(w.view_as(p))

    out16.copy_(state.master.to(torch.float32) + (0 if state.comp is None else state.comp.to(torch.float32)))
    upload()
    op = load_host_op(precision)
    losses = []
    for k, (x, y) in enumerate(_batches(), start=1):
        model.zero_grad(set_to_none=False)
        loss = lm_loss(model(x), y)
        loss.backward()
        for p, _, g in views:
            g.copy_(p.grad.reshape(-1))  # gradients land in 16 bits, as in the engine
        hyper = AdamHyper(_lr(k), *BETAS, eps=1e-8, weight_decay=WD, adamw_mode=True)
        step(op, state, grad16, out16, k, hyper, threads=1)
        if after_step is not None:
            after_step(state)
            out16.copy_(state.master)
        upload()
        losses.append(loss.item())
    return losses


def _train_device(precision: str) -> list[float]:
    """The same run on the device path: a ZeRO-2 engine (one process) with ``state_precision``, its compute
    weights the bf16 flat parameters, stepped by the engine (zero/states16.py); the model computes in fp32
    arithmetic on fp32 copies of those weights (``functional_call``), whose gradients reach the bf16
    parameters through the cast, as the host runs' do through ``grad16``."""
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=1e-8, weight_decay=WD)
    engine = Stage2Engine(opt, None, torch.bfloat16, torch.device("cpu"), 1 << 20,
                          states=StatePrecisionConfig(precision))
    assert engine.states16 is not None and engine.groups[0].master.dtype == torch.bfloat16
    losses = []
    for k, (x, y) in enumerate(_batches(), start=1):
        weights = {n: p.float() for n, p in model.named_parameters()}
        loss = lm_loss(torch.func.functional_call(model, weights, (x,)), y)
        loss.backward()
        engine.post_backward()
        for pg in opt.param_groups:
            pg["lr"] = _lr(k)
        assert engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


RUNS = ("fp32", *COMPACT, "control_bf16_nearest", *(f"device_{p}" for p in DEVICE))
CHILD_RUNS = ("control_bf16_nearest", *(f"device_{p}" for p in DEVICE))
"""The runs a second process trains while this one trains the others (see [Note: two processes])."""


def _run(name: str) -> list[float]:
    """The losses of run ``name`` on one thread (the runs are deterministic at any count)."""
    torch.set_num_threads(1)
    if name == "control_bf16_nearest":
        return _train("fp32", after_step=_round_master_to_nearest)
    if name.startswith("device_"):
        return _train_device(name.removeprefix("device_"))
    return _train(name)


def _run_all(names: tuple[str, ...]) -> dict[str, list[float]]:
    return {name: _run(name) for name in names}


@pytest.fixture(scope="module")
def final_losses() -> dict[str, tuple[float, float]]:
    """(first loss, mean of the last 20) per run.

    [Note: two processes] The seven runs are independent, single-threaded and deterministic, and CI's pytest
    uses one of its two cores: a spawned process trains :data:`CHILD_RUNS` while this one trains the others
    (about half the wall time; the losses are the same bit for bit as in one process)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    threads = torch.get_num_threads()
    try:
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            child = pool.submit(_run_all, CHILD_RUNS)
            runs = _run_all(tuple(n for n in RUNS if n not in CHILD_RUNS))
            runs.update(child.result(timeout=600))
    finally:
        torch.set_num_threads(threads)
    runs = {name: runs[name] for name in RUNS}
    result = {name: (losses[0], sum(losses[-LAST:]) / LAST) for name, losses in runs.items()}
    print("\nfinal losses (mean of last 20 steps):", {k: round(v[1], 4) for k, v in result.items()})
    return result


def _relative(final_losses: dict[str, tuple[float, float]], name: str) -> float:
    return final_losses[name][1] / final_losses["fp32"][1] - 1


def test_fp32_baseline_learns(final_losses: dict[str, tuple[float, float]]) -> None:
    first, last = final_losses["fp32"]
    assert math.isclose(first, math.log(256), rel_tol=0.02)  # uniform over bytes at initialisation
    assert last < 0.5 * first


@pytest.mark.parametrize("precision", COMPACT)
def test_compact_state_converges_like_fp32(final_losses: dict[str, tuple[float, float]], precision: str) -> None:
    rel = _relative(final_losses, precision)
    assert abs(rel) <= TOLERANCE, f"{precision}: final loss {final_losses[precision][1]:.4f} is {rel:+.2%} of fp32's"


@pytest.mark.parametrize("precision", DEVICE)
def test_device_states_converge_like_fp32(final_losses: dict[str, tuple[float, float]], precision: str) -> None:
    """The device path (``state_precision``, issue #33): the same check, within 1 %."""
    rel = _relative(final_losses, f"device_{precision}")
    assert abs(rel) <= DEVICE_TOLERANCE, f"device {precision}: final loss is {rel:+.2%} of fp32's"


def test_check_catches_a_bf16_master_rounded_to_nearest(final_losses: dict[str, tuple[float, float]]) -> None:
    """The negative control: without stochastic rounding or compensation a bf16 master fails the 2 % check."""
    assert _relative(final_losses, "control_bf16_nearest") > TOLERANCE
