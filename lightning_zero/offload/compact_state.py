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
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Generator, Optional

import torch
from torch import Tensor

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.offload.device_share import host_changed, host_identity
from lightning_zero.offload.swap_state import make_placeholder, make_resident, take_storage
from lightning_zero.optim import host_states
from lightning_zero.optim.host_states import INT8_BLOCK, HostAdamState


class CompactStateMixin:
    """The compact-state part of the offload engine (engine.py's OffloadMixin derives from it)."""

    _compact: Optional[list[HostAdamState]] = None
    _compact_depth: int = 0

    def _setup_compact(self) -> None:
        """Move each group's filled fp32 master into a compact state and free the master's storage."""
        precision = self.offload.offload_state_precision  # type: ignore[attr-defined]
        if precision == "fp32":
            return
        self._compact_op = host_states.load_host_op(precision)
        self._compact = []
        for fg in self.groups:  # type: ignore[attr-defined]
            # the state takes the master's memory (host_states.py [Note: adopting the fp32 master]);
            # fg.master stays a placeholder that host_state() fills
            master16 = self._compact_master16(fg)
            state = HostAdamState.adopt(take_storage(fg.master), precision,  # type: ignore[arg-type]
                                        alloc=lambda n, dt: self.host.empty(n, dt, pin=False),  # type: ignore[attr-defined]
                                        master16=master16)
            self._compact.append(state)

    def _compact_master16(self, fg: object) -> Optional[Tensor]:
        """The 16-bit partition that can hold a bf16 layout's master: stage 3 with parameters in host
        memory and bf16 compute, where the step writes the partition in place (its value is the
        master's high word, [Note: master_view] in host_states.py). None otherwise."""
        if not self._compact_master_in_params(self.compute_dtype):  # type: ignore[attr-defined]
            return None
        assert self._upload_is_shard16(fg)  # type: ignore[attr-defined]
        return fg.shard16  # type: ignore[attr-defined]

    def _compact_master_in_params(self, compute_dtype: torch.dtype) -> bool:
        """Whether a bf16 layout's master lives in the 16-bit parameter partition (see above); also
        what the host-memory check counts (estimator.Workload.master_in_params)."""
        o = self.offload  # type: ignore[attr-defined]
        return (o.offload_state_precision in ("bf16_sr", "bf16_kahan") and compute_dtype == torch.bfloat16
                and self.stage == 3 and o.offload_params == "cpu" and not o.delayed_param_update)  # type: ignore[attr-defined]

    @property
    def _compact_aligned(self) -> bool:
        """int8 states step only in block-aligned ranges (no per-bucket ranges)."""
        return self._compact is not None and self._compact[0].precision == "int8"

    def _compact_range(self, gi: int, grad: Tensor, out: Optional[Tensor], hyper: AdamHyper, scale: float,
                       threads: int, step: int) -> Callable[[int, int], None]:
        """The function that steps ``[lo, hi)`` of group ``gi``'s compact state (and writes ``out``)."""
        assert self._compact is not None
        state = self._compact[gi]
        offset = self.dp_rank * state.numel  # type: ignore[attr-defined]  # distinct random bits per rank
        out16 = out if out is not None and out.dtype != torch.float32 else None
        if out16 is not None and out16.data_ptr() == state.master.data_ptr():
            out16 = None  # the master is the partition (_compact_master16): one write, not two to one place

        def update_range(lo: int, hi: int) -> None:
            if self._compact_aligned and lo % INT8_BLOCK:
                raise RuntimeError(f"int8 host state stepped from element {lo}, not a multiple of {INT8_BLOCK}")
            part = state.narrow(lo, hi)
            host_states.step(self._compact_op, part, grad[lo:hi], None if out16 is None else out16[lo:hi], step,
                             hyper, scale, threads, offset=offset)
            if out is not None and out16 is None:  # fp32 compute: the master's (high word's) values
                out[lo:hi].copy_(part.master_view())

        return update_range

    @contextmanager
    def _compact_host_state(self) -> Generator[None, None, None]:
        """torch's fp32 layout materialised inside the block (see [Note: compact states in the engine])."""
        if self._compact is None or self._compact_depth:
            self._compact_depth += 1
            try:
                yield
            finally:
                self._compact_depth -= 1
            return
        opt = self.optimizer  # type: ignore[attr-defined]
        entry = []
        for fg, state in zip(self.groups, self._compact):  # type: ignore[attr-defined]
            master, exp_avg, exp_avg_sq = state.export_fp32()
            make_resident(fg.master).copy_(master)
            st = opt.state[fg.master]
            st.setdefault("step", torch.zeros((), dtype=torch.float32))
            st["exp_avg"], st["exp_avg_sq"] = exp_avg, exp_avg_sq
            entry.append(host_identity((fg.master, exp_avg, exp_avg_sq)))
        self._compact_depth = 1
        try:
            yield
        finally:
            self._compact_depth = 0
            for fg, state, seen in zip(self.groups, self._compact, entry):  # type: ignore[attr-defined]
                st = opt.state.get(fg.master, {})
                if host_changed((fg.master, st.get("exp_avg"), st.get("exp_avg_sq")), seen):  # written or replaced (a load)
                    state.import_fp32(fg.master, st.get("exp_avg"), st.get("exp_avg_sq"))
                st.pop("exp_avg", None)
                st.pop("exp_avg_sq", None)
                make_placeholder(fg.master)

    def _compact_step_count(self, master: Tensor) -> int:
        """Count one step in the optimizer's state (the only entry it keeps between checkpoints)."""
        st = self.optimizer.state[master]  # type: ignore[attr-defined]
        if "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32)
        st["step"] = st["step"].to("cpu")
        st["step"] += 1
        return int(st["step"].item())

