"""Compact host optimizer states (``offload_state_precision``): bf16 or 8-bit instead of fp32.

[Note: compact states in the engine]
With ``offload_state_precision`` other than 'fp32' each param group's host partition is one
:class:`~lightning_zero.optim.host_states.HostAdamState` (master and moments in the compact layout)
and the engine's fp32 master becomes a placeholder (storage freed, identity kept: the optimizer's
state stays keyed by it). The CPU step runs ``host_states.step`` range by range (int8: ranges on
256-element block boundaries, so it steps after backward in aligned chunks, never bucket by bucket
during backward). Everything else sees torch's fp32 layout: inside ``host_state()`` the fp32 master
and ``exp_avg``/``exp_avg_sq`` are materialised from the compact state (``export_fp32``) and, if
something wrote or replaced them (a checkpoint load), imported back on exit; outside it they do not
exist. A checkpoint therefore needs the fp32 layout's host memory for its duration (12 bytes per
parameter of the partition), like a gathered full checkpoint would: the compact layouts pay off
during training, not at save time.

:class:`CompactStates` is a member of the host optimizer (offload/host_optimizer.py), None for 'fp32'.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator, Optional, Sequence

import torch
from torch import Tensor

from lightning_zero.config.offload import OffloadConfig
from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.offload.device_share import host_changed, host_identity
from lightning_zero.offload.pinned import HostPool
from lightning_zero.offload.swap_state import make_placeholder, make_resident, take_storage
from lightning_zero.optim import host_states
from lightning_zero.optim.host_states import INT8_BLOCK, HostAdamState, HostStatePrecision


def master_in_params(offload: OffloadConfig, compute_dtype: torch.dtype, stage: int) -> bool:
    """Whether a bf16 layout's master lives in the 16-bit parameter partition: stage 3 with parameters in
    host memory and bf16 compute, where the step writes the partition in place (its value is the master's
    high word, [Note: master_view] in host_states.py); also what the host-memory check counts
    (estimator.Workload.master_in_params)."""
    o = offload
    return (o.offload_state_precision in ("bf16_sr", "bf16_kahan") and compute_dtype == torch.bfloat16
            and stage == 3 and o.offload_params == "cpu" and not o.delayed_param_update)


class CompactStates:
    """Each param group's host partition as one compact :class:`HostAdamState` (see the module note)."""

    def __init__(self, groups: Sequence[Any], precision: HostStatePrecision, host: HostPool,
                 master16s: Sequence[Optional[Tensor]], optimizer: torch.optim.Optimizer, dp_rank: int) -> None:
        """Move each group's filled fp32 master into a compact state and free the master's storage
        (``master16s``: per group, the 16-bit partition that holds a bf16 master, see :func:`master_in_params`)."""
        self._groups = groups
        self._optimizer = optimizer
        self._dp_rank = dp_rank
        self._op = host_states.load_host_op(precision)
        self._depth = 0
        self.states: list[HostAdamState] = []
        for fg, master16 in zip(groups, master16s):
            # the state takes the master's memory (host_states.py [Note: adopting the fp32 master]);
            # fg.master stays a placeholder that host_state() fills
            state = HostAdamState.adopt(take_storage(fg.master), precision,
                                        alloc=lambda n, dt: host.empty(n, dt, pin=False), master16=master16)
            self.states.append(state)

    @property
    def aligned(self) -> bool:
        """int8 states step only in block-aligned ranges (no per-bucket ranges)."""
        return bool(self.states) and self.states[0].precision == "int8"

    def range(self, gi: int, grad: Tensor, out: Optional[Tensor], hyper: AdamHyper, scale: float,
              threads: int, step: int) -> Callable[[int, int], None]:
        """The function that steps ``[lo, hi)`` of group ``gi``'s compact state (and writes ``out``)."""
        state = self.states[gi]
        offset = self._dp_rank * state.numel  # distinct random bits per rank
        out16 = out if out is not None and out.dtype != torch.float32 else None
        if out16 is not None and out16.data_ptr() == state.master.data_ptr():
            out16 = None  # the master is the partition (master_in_params): one write, not two to one place
        aligned = self.aligned

        def update_range(lo: int, hi: int) -> None:
            if aligned and lo % INT8_BLOCK:
                raise RuntimeError(f"int8 host state stepped from element {lo}, not a multiple of {INT8_BLOCK}")
            part = state.narrow(lo, hi)
            host_states.step(self._op, part, grad[lo:hi], None if out16 is None else out16[lo:hi], step,
                             hyper, scale, threads, offset=offset)
            if out is not None and out16 is None:  # fp32 compute: the master's (high word's) values
                out[lo:hi].copy_(part.master_view())

        return update_range

    def master_view(self, gi: int, lo: int, hi: int) -> Tensor:
        """The master's values of ``[lo, hi)`` of group ``gi`` (an unstepped piece's upload)."""
        return self.states[gi].narrow(lo, hi).master_view()

    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        """torch's fp32 layout materialised inside the block (see [Note: compact states in the engine])."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        opt = self._optimizer
        entry = []
        for fg, state in zip(self._groups, self.states):
            master, exp_avg, exp_avg_sq = state.export_fp32()
            make_resident(fg.master).copy_(master)
            st = opt.state[fg.master]
            st.setdefault("step", torch.zeros((), dtype=torch.float32))
            st["exp_avg"], st["exp_avg_sq"] = exp_avg, exp_avg_sq
            entry.append(host_identity((fg.master, exp_avg, exp_avg_sq)))
        self._depth = 1
        try:
            yield
        finally:
            self._depth = 0
            for fg, state, seen in zip(self._groups, self.states, entry):
                st = opt.state.get(fg.master, {})
                if host_changed((fg.master, st.get("exp_avg"), st.get("exp_avg_sq")), seen):  # written or replaced (a load)
                    state.import_fp32(fg.master, st.get("exp_avg"), st.get("exp_avg_sq"))
                st.pop("exp_avg", None)
                st.pop("exp_avg_sq", None)
                make_placeholder(fg.master)

    def step_count(self, master: Tensor) -> int:
        """Count one step in the optimizer's state (the only entry it keeps between checkpoints)."""
        st = self._optimizer.state[master]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32)
        st["step"] = st["step"].to("cpu")
        st["step"] += 1
        return int(st["step"].item())
