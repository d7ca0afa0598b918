"""What OneBitAdam and OneBitLamb share: phases, the backend, error buffers, flat segments, stats, state.

[Note: two phases]
Steps 1..``freeze_step`` are exact Adam/LAMB on gradients that arrive already averaged (under
ZeroStrategy the engine all-reduces them in full precision, as for any optimizer). From then on
the variance is frozen, the caller stops averaging gradients (``needs_gradient_allreduce()`` says
when), and each rank's momentum, updated with its *local* gradient, is averaged by the backend's
error-compensated 1-bit all-reduce. The phase is not stored: it follows from the step count in the
optimizer state, so a checkpoint restores it with the moments. Gradient clipping in the compression
phase uses the root mean square of the ranks' local gradient norms (the averaged gradient never
exists; ZeroEngine.global_grad_norm_sq), so every rank clips alike and agrees on fp16 overflow skips.

[Note: flat parameters and segments]
ZeroStrategy re-points each param group at one flat fp32 master (zero/flat_group.py), so one
compressed exchange covers a whole group. The engine tells the optimizer where each original
tensor lives in that buffer (``bind_flat_params``): LAMB needs the tensor boundaries for its
per-tensor trust ratios, and both optimizers zero the padding between tensors after each exchange
(1-bit compression cannot send an exact zero, see [Note: why sign(0) = +1] in sign.py). Outside
the strategy each parameter is one segment of itself. Sharded masters (ZeRO stage >= 1) are
refused: a rank would hold only part of the momentum it must average.

[Note: error buffers in checkpoints]
The worker/server errors differ per rank, while Lightning writes rank 0's optimizer state. The
strategy therefore calls :meth:`OneBitOptimizer.gather_comm_state` (collective: rank 0 receives every rank's
errors, one at a time) and every rank picks its own on load, so a resumed run continues bit for
bit. If the world size or the layout changed, or ``checkpoint_errors=False`` (DeepSpeed's
behaviour: it resets them), the errors restart from zero and a log line says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from lightning_zero.comm.compressed.backend import CompressedBackend, allreduce_bytes
from lightning_zero.comm.compressed.onebit_allreduce import ErrorFeedback
from lightning_zero.comm.compressed.protocol import COMM_STATE_KEY

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = ("warmup", "compressed")
_STATE_VERSION = 1


class Segments:
    """The whole tensors inside one (possibly flat) parameter: ``(offset, numel)`` spans, gaps between."""

    def __init__(self, numel: int, spans: Iterable[tuple[int, int]]) -> None:
        spans = sorted((int(o), int(n)) for o, n in spans if n > 0)
        runs: list[tuple[int, int, int]] = []  # (start, length, segment index or -1 for a gap)
        pos = 0
        for i, (offset, length) in enumerate(spans):
            if offset < pos or offset + length > numel:
                raise ValueError(f"segments must be disjoint and inside {numel} elements, got {spans}")
            if offset > pos:
                runs.append((pos, offset - pos, -1))
            runs.append((offset, length, i))
            pos = offset + length
        if pos < numel:
            runs.append((pos, numel - pos, -1))
        self.numel = numel
        self.spans: tuple[tuple[int, int], ...] = tuple(spans)
        self._runs = runs
        self.has_gaps = any(seg < 0 for _, _, seg in runs)
        self._device_cache: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    @classmethod
    def whole(cls, numel: int) -> "Segments":
        return cls(numel, [(0, numel)])

    def __len__(self) -> int:
        return len(self.spans)

    def _tensors(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        cached = self._device_cache.get(device)
        if cached is None:
            n = len(self.spans)
            ids = torch.tensor([seg if seg >= 0 else n for _, _, seg in self._runs], dtype=torch.long)
            lengths = torch.tensor([length for _, length, _ in self._runs], dtype=torch.long)
            gaps = [torch.arange(s, s + length) for s, length, seg in self._runs if seg < 0]
            gap_index = torch.cat(gaps) if gaps else torch.empty(0, dtype=torch.long)
            cached = (ids.to(device), lengths.to(device), gap_index.to(device))
            self._device_cache[device] = cached
        return cached

    def views(self, flat: Tensor) -> list[Tensor]:
        """One view per whole tensor of the flat buffer ``flat``."""
        return [flat[o : o + n] for o, n in self.spans]

    def expand(self, values: Tensor, fill: float = 0.0) -> Tensor:
        """Per-element tensor: ``values[s]`` over segment s, ``fill`` over gaps."""
        ids, lengths, _ = self._tensors(values.device)
        ext = torch.cat([values, values.new_full((1,), fill)])
        return torch.repeat_interleave(ext[ids], lengths, output_size=self.numel)

    def zero_gaps_(self, flat: Tensor) -> None:
        if self.has_gaps:
            flat.index_fill_(0, self._tensors(flat.device)[2], 0.0)

    def norms(self, flat: Tensor) -> Tensor:
        """L2 norm of every segment (one fused launch)."""
        return torch.stack(torch._foreach_norm(self.views(flat)))

    def maxima(self, flat: Tensor) -> Tensor:
        views = self.views(flat)
        if hasattr(torch, "_foreach_max"):
            return torch.stack(torch._foreach_max(views))
        return torch.stack([v.max() for v in views])  # pragma: no cover - torch < 2.6


@dataclass
class _StepStats:
    phase: int = 0
    bytes_sent: float = 0.0
    reference_bytes: float = 0.0


class OneBitOptimizer(torch.optim.Optimizer):
    """Base of the 1-bit optimizers (see the module notes); subclasses implement the two updates."""

    #: ZeroStrategy hands a backend to optimizers that say this (lightning_zero.comm.compressed.protocol).
    uses_compressed_comm: ClassVar[bool] = True
    #: ZeRO stages the strategy may combine it with (refused otherwise, before training).
    supported_zero_stages: ClassVar[tuple[int, ...]] = (0,)
    #: ZeRO may re-point it at flat buffers: the engine passes tensor boundaries (``bind_flat_params``).
    zero_elementwise: ClassVar[bool] = True

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        *,
        freeze_step: int,
        comm_backend: Optional[CompressedBackend] = None,
        checkpoint_errors: bool = True,
    ) -> None:
        if int(freeze_step) < 1:
            raise ValueError(f"freeze_step must be >= 1 (the variance needs warm-up steps), got {freeze_step}")
        super().__init__(params, defaults)
        self.freeze_step = int(freeze_step)
        self.checkpoint_errors = checkpoint_errors
        self._backend: Optional[CompressedBackend] = comm_backend
        self._segments: dict[int, Segments] = {}
        """By ``id(param)``: tensor boundaries inside a flat parameter (``bind_flat_params``)."""
        self._errors: dict[int, ErrorFeedback] = {}
        """By parameter index (optimizer order): this rank's error buffers."""
        self._loaded_errors: dict[int, tuple[Tensor, Tensor]] = {}
        self._reset_reason: Optional[str] = None
        self._last = _StepStats()
        self._totals = _StepStats()

    # ------------------------------------------------------------------ the contract with the strategy
    def set_comm_backend(self, backend: Optional[CompressedBackend]) -> None:
        self._backend = backend

    @property
    def comm_backend(self) -> Optional[CompressedBackend]:
        return self._backend

    def bind_flat_params(self, param: Tensor, spans: Sequence[tuple[int, int]], sharded: bool = False) -> None:
        """Called by the ZeRO engine: ``param`` is a flat buffer holding whole tensors at ``spans``."""
        if sharded:
            raise ValueError(
                f"{type(self).__name__} works with ZeRO stage(s) {list(self.supported_zero_stages)} only: a "
                "sharded master holds part of the momentum that the 1-bit all-reduce must average."
            )
        self._segments[id(param)] = Segments(param.numel(), spans)

    def completed_steps(self) -> int:
        """Optimizer steps taken so far (from the state, so checkpoints restore it)."""
        steps = [int(st["step"]) for st in self.state.values() if "step" in st]
        return max(steps, default=0)

    @property
    def phase(self) -> str:
        """'warmup' (exact optimizer, averaged gradients) or 'compressed' (1-bit momentum exchange)."""
        return PHASES[int(self.completed_steps() >= self.freeze_step)]

    def needs_gradient_allreduce(self) -> bool:
        """Whether the gradients of the next step must arrive averaged (True during warm-up)."""
        return self.completed_steps() < self.freeze_step

    @property
    def comm_stats(self) -> dict[str, float]:
        """Scalars for TensorBoard, per rank, about the last step and the run so far.

        ``onebit/phase`` is 0 in warm-up and 1 when compressed. ``onebit/bytes_sent`` is what this
        rank's gradient or momentum exchange put on the wire in the last step; in warm-up that is
        a 16-bit all-reduce of the gradients (the mixed-precision case; fp32 training sends twice
        that). ``onebit/bytes_16bit_allreduce`` is what a 16-bit all-reduce of the same vector
        sends. ``*_total`` are sums over the run, and ``onebit/compression_ratio`` their ratio.
        """
        t = self._totals
        return {
            "onebit/phase": float(self._last.phase),
            "onebit/bytes_sent": self._last.bytes_sent,
            "onebit/bytes_16bit_allreduce": self._last.reference_bytes,
            "onebit/bytes_sent_total": t.bytes_sent,
            "onebit/bytes_16bit_allreduce_total": t.reference_bytes,
            "onebit/compression_ratio": t.reference_bytes / t.bytes_sent if t.bytes_sent else 1.0,
        }

    # ------------------------------------------------------------------ the step
    def _world(self) -> int:
        return self._backend.world_size if self._backend is not None else 1

    def _params(self) -> list[tuple[int, dict[str, Any], Tensor]]:
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                out.append((len(out), group, p))
        return out

    def segments_of(self, p: Tensor) -> Segments:
        seg = self._segments.get(id(p))
        if seg is None or seg.numel != p.numel():
            seg = Segments.whole(p.numel())
            self._segments[id(p)] = seg
        return seg

    def average_momentum_(self, index: int, m: Tensor) -> None:
        """The compressed all-reduce of one flat momentum (a no-op on one rank)."""
        backend = self._backend
        if backend is None or backend.world_size == 1:
            return
        backend.compressed_average_(m.view(-1), self._errors_for(index, m, backend))

    def _errors_for(self, index: int, m: Tensor, backend: CompressedBackend) -> ErrorFeedback:
        errors = self._errors.get(index)
        if errors is not None and errors.layout.numel == m.numel() and errors.layout.world == backend.world_size:
            return errors
        errors = backend.new_errors(m.numel(), m.device)
        loaded = self._loaded_errors.pop(index, None)
        if loaded is not None and loaded[0].shape == errors.worker.shape and loaded[1].shape == errors.server.shape:
            errors.worker.copy_(loaded[0])
            errors.server.copy_(loaded[1])
        elif self._reset_reason is not None:
            if backend.rank == 0:
                log.warning(f"{type(self).__name__}: 1-bit error buffers restart from zero ({self._reset_reason}).")
            self._reset_reason = None
        self._errors[index] = errors
        return errors

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compressed = self.completed_steps() >= self.freeze_step
        backend = self._backend
        before = (backend.counters.bytes_sent, backend.counters.reference_bytes) if backend is not None else (0.0, 0.0)
        params = self._params()
        if compressed:
            self._before_compressed_step(params)
        numel = 0
        for index, group, p in params:
            grad = p.grad
            if grad is None:
                if not compressed:
                    continue
                grad = torch.zeros_like(p)  # keep the collectives in lockstep across ranks
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            state = self.state[p]
            if not state:
                self._init_state(state, p)
            state["step"] += 1
            numel += p.numel()
            if compressed:
                self._compressed_update(index, group, p, grad, state)
            else:
                self._warmup_update(index, group, p, grad, state)
        self._record(compressed, before, numel)
        return loss

    def _record(self, compressed: bool, before: tuple[float, float], numel: int) -> None:
        backend = self._backend
        if compressed and backend is not None and backend.world_size > 1:
            sent = backend.counters.bytes_sent - before[0]
            ref = backend.counters.reference_bytes - before[1]
        else:
            sent = ref = allreduce_bytes(numel, self._world()) if not compressed else 0.0
        self._last = _StepStats(int(compressed), sent, ref)
        self._totals.bytes_sent += sent
        self._totals.reference_bytes += ref

    def _init_state(self, state: dict[str, Any], p: Tensor) -> None:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)

    # subclasses -------------------------------------------------------------------------------------
    def _before_compressed_step(self, params: list[tuple[int, dict[str, Any], Tensor]]) -> None:
        """Hook run once before each compressed step (LAMB freezes its momentum scales here)."""

    def _warmup_update(self, index: int, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict) -> None:
        raise NotImplementedError

    def _compressed_update(self, index: int, group: dict[str, Any], p: Tensor, grad: Tensor, state: dict) -> None:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        """Per-tensor statistics that live outside ``self.state`` (identical on every rank)."""
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        pass

    # ------------------------------------------------------------------ checkpoints
    def _comm_state(self, errors: Optional[dict[int, dict[int, tuple[Tensor, Tensor]]]]) -> dict[str, Any]:
        return {
            "version": _STATE_VERSION,
            "world_size": self._world(),
            "errors": errors,
            "extra": self._extra_state(),
        }

    def gather_comm_state(self) -> Optional[dict[str, Any]]:
        """Every rank's error buffers at rank 0 plus the per-tensor statistics (collective)."""
        backend = self._backend
        errors: Optional[dict[int, dict[int, tuple[Tensor, Tensor]]]] = None
        if self.checkpoint_errors and backend is not None and backend.world_size > 1:
            per_rank: dict[int, dict[int, tuple[Tensor, Tensor]]] = {r: {} for r in range(backend.world_size)}
            for index in sorted(self._errors):
                e = self._errors[index]
                workers = backend.gather_to_root(e.worker)
                servers = backend.gather_to_root(e.server)
                if workers is not None and servers is not None:
                    for r in range(backend.world_size):
                        per_rank[r][index] = (workers[r], servers[r])
            errors = per_rank if backend.rank == 0 else None
        return self._comm_state(errors)

    def load_comm_state(self, state: Optional[dict[str, Any]]) -> None:
        """Take this rank's error buffers (if saved for this world size) and the statistics."""
        self._errors.clear()
        self._loaded_errors = {}
        self._reset_reason = None
        if state is None:
            if self.completed_steps() > self.freeze_step:
                self._reset_reason = "the checkpoint has no 1-bit communication state"
            return
        self._load_extra_state(state.get("extra") or {})
        saved = state.get("errors")
        rank = self._backend.rank if self._backend is not None else 0
        if self.completed_steps() <= self.freeze_step:
            return  # saved before the first compressed step: the errors were zero, nothing is lost
        if not saved:
            self._reset_reason = "the checkpoint was saved without them (checkpoint_errors=False or one rank)"
        elif int(state.get("world_size", -1)) != self._world():
            self._reset_reason = f"saved on {state.get('world_size')} ranks, resumed on {self._world()}"
        else:
            mine = saved.get(rank, saved.get(str(rank), {}))
            self._loaded_errors = {int(k): (w, s) for k, (w, s) in mine.items()}
            self._reset_reason = "their saved layout does not match this run"

    def local_comm_state(self) -> dict[str, Any]:
        """This rank's error buffers (host copies) and the statistics, without any collective: what a
        sharded checkpoint stores per rank, and :meth:`load_comm_state` reads back."""
        rank = self._backend.rank if self._backend is not None else 0
        local = {i: (e.worker.detach().cpu().clone(), e.server.detach().cpu().clone()) for i, e in self._errors.items()}
        return self._comm_state({rank: local} if self.checkpoint_errors and local else None)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state plus this rank's communication state (see :meth:`gather_comm_state`)."""
        sd = super().state_dict()
        sd[COMM_STATE_KEY] = self.local_comm_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        sd = dict(state_dict)
        comm = sd.pop(COMM_STATE_KEY, None)
        super().load_state_dict(sd)
        for st in self.state.values():
            if "step" in st and torch.is_tensor(st["step"]):
                st["step"] = st["step"].detach().to("cpu", torch.float32)
        self.load_comm_state(comm)


def bias_corrections(beta1: float, beta2: float, step: int, variance_step: int, enabled: bool) -> tuple[float, float]:
    """Adam's bias corrections; the variance's is frozen with the variance at ``variance_step``."""
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**variance_step


