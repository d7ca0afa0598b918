"""Per-module parameters, forward FLOPs and forward/backward latency of one profiled step.

[Note: attribution]
Forward FLOPs are inclusive, as in DeepSpeed's profiler: an op counts for every module whose forward
is running when it is dispatched (forward pre-hooks push a module, forward hooks pop it), so a
block's count is the sum of its children's plus what it computes itself, and the root's count is
the whole forward, including ops outside every submodule (a tied head's ``F.linear``). Ops running
inside backward (``torch._C._current_graph_task_id() != -1``): gradients and the recomputation of
checkpointed regions, whose forward hooks fire again there but are not pushed, count as backward
FLOPs of the step (a total: backward ops belong to no forward call).

[Note: latency]
Forward latency is the time between a module's forward pre-hook and forward hook. Backward latency
runs from the moment the gradient of the module's first output is computed (a multi-grad hook, mode
'any', on its outputs) to the moment the gradients of all its grad-requiring inputs (or, if none,
its parameters) are (mode 'all'): under activation checkpointing that includes the recomputation.
On CUDA the points are events recorded on the current stream (autograd runs backward on the stream
of the forward op), read after one synchronisation when the step is over; on CPU, wall-clock reads.
Several calls of one module in a step (pipeline micro-batches, a tied embedding) add up. All hooks
are removed at :meth:`ModuleProfiler.stop`: the other steps pay nothing.

[Note: parameters under ZeRO]
Parameter counts are ``p.numel()`` of the distinct parameters of each subtree. Stage 3 keeps every
parameter's shape while its storage is released (zero/sharded_group.py [Note: parameters keep their
shape]), so this is the un-partitioned count, and a parameter of a gathered unit is counted once. A
pipeline stage holds its own layers only: its counts are the stage's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

from lightning_zero.profiler.flops import OpFlopCounter

Stamp = Union[float, "torch.cuda.Event"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


@dataclass
class ModuleStats:
    """What one module did in the profiled step."""

    name: str
    """Qualified name (the root is ``''``)."""
    type: str
    depth: int
    """0 for the root, 1 for its children, ..."""
    params: int = 0
    fwd_flops: int = 0
    fwd_calls: int = 0
    fwd_time_s: float = 0.0
    bwd_time_s: Optional[float] = None
    """None when no backward of this module was seen (evaluation, or no gradient reached it)."""
    _fwd: list = field(default_factory=list, repr=False)
    _bwd: list = field(default_factory=list, repr=False)
    _bwd_open: list = field(default_factory=list, repr=False)

    @property
    def fwd_macs(self) -> int:
        return self.fwd_flops // 2

    @property
    def fwd_flops_per_s(self) -> Optional[float]:
        return self.fwd_flops / self.fwd_time_s if self.fwd_time_s > 0 else None


@dataclass
class ProfileResult:
    """All modules' stats in module order (the root first), and the step's totals."""

    modules: list[ModuleStats]
    fwd_flops: int
    """FLOPs dispatched outside backward: the forward, including ops outside every module (the root's
    own count misses them when a step calls a submodule directly, as pipeline stages do)."""
    bwd_flops: int
    """FLOPs dispatched inside backward: gradients and recomputation."""
    device: torch.device

    @property
    def root(self) -> ModuleStats:
        return self.modules[0]

    @property
    def total_flops(self) -> int:
        return self.fwd_flops + self.bwd_flops

    @property
    def params(self) -> int:
        return self.root.params

    def by_name(self) -> dict[str, ModuleStats]:
        return {m.name: m for m in self.modules}


class ModuleProfiler:
    """Hooks every module of ``root`` and counts ops between :meth:`start` and :meth:`stop`.

    ``with ModuleProfiler(model) as prof: loss = model(x).sum(); loss.backward()`` then ``prof.result``.
    """

    def __init__(self, root: nn.Module, device: Optional[torch.device] = None) -> None:
        self.root = root
        if device is None:
            first = next(root.parameters(), None)
            device = first.device if first is not None else torch.device("cpu")
        self.device = device
        self.cuda = device.type == "cuda"
        self.stats: dict[int, ModuleStats] = {}
        self.modules: list[tuple[nn.Module, ModuleStats]] = []
        for name, module in root.named_modules():
            s = ModuleStats(name, type(module).__name__, 0 if not name else name.count(".") + 1)
            self.stats[id(module)] = s
            self.modules.append((module, s))
        self._stack: list[ModuleStats] = []
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._counter: Optional[OpFlopCounter] = None
        self.fwd_flops = 0
        self.bwd_flops = 0
        self.result: Optional[ProfileResult] = None

    # ------------------------------------------------------------------ time stamps
    def _stamp(self) -> Stamp:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @staticmethod
    def _elapsed(a: Stamp, b: Stamp) -> float:
        if isinstance(a, float):
            return float(b) - a  # type: ignore[arg-type]
        return a.elapsed_time(b) / 1e3  # type: ignore[union-attr,arg-type]

    # ------------------------------------------------------------------ hooks
    def _sink(self, flops: int, func: Any) -> None:
        if _in_backward():
            self.bwd_flops += flops
            return
        self.fwd_flops += flops
        seen: set[int] = set()
        for s in self._stack:
            if id(s) not in seen:
                seen.add(id(s))
                s.fwd_flops += flops

    def _pre(self, s: ModuleStats):
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if _in_backward():  # recomputation under activation checkpointing: backward's work
                return
            self._stack.append(s)
            s.fwd_calls += 1
            s._fwd.append([self._stamp(), None])
            if torch.is_grad_enabled():
                ins = [t for t in _tensors((args, kwargs)) if t.requires_grad]
                if not ins:
                    ins = [p for p in module.parameters() if p.requires_grad]
                s._bwd_open.append(ins)

        return hook

    def _post(self, s: ModuleStats):
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if _in_backward():
                return
            if self._stack and self._stack[-1] is s:
                self._stack.pop()
            elif s in self._stack:  # an exception or odd nesting: keep the stack consistent
                self._stack.remove(s)
            s._fwd[-1][1] = self._stamp()
            ends = s._bwd_open.pop() if s._bwd_open else []
            outs = [t for t in _tensors(output) if t.requires_grad]
            if outs and ends:
                pair: list = [None, None]
                s._bwd.append(pair)

                def started(grads: Any, pair: list = pair) -> None:
                    if pair[0] is None:
                        pair[0] = self._stamp()

                def ended(grads: Any, pair: list = pair) -> None:
                    pair[1] = self._stamp()

                self._grad_handles.append(torch.autograd.graph.register_multi_grad_hook(outs, started, mode="any"))
                self._grad_handles.append(torch.autograd.graph.register_multi_grad_hook(ends, ended, mode="all"))

        return hook

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "ModuleProfiler":
        for module, s in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._pre(s), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(s), with_kwargs=True, always_call=True))
        self._counter = OpFlopCounter(self._sink)
        self._counter.__enter__()
        return self

    def stop(self) -> ProfileResult:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        for h in self._handles + self._grad_handles:
            h.remove()
        self._handles, self._grad_handles = [], []
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for module, s in self.modules:
            s.params = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
            s.fwd_time_s = sum(self._elapsed(a, b) for a, b in s._fwd if b is not None)
            done = [(a, b) for a, b in s._bwd if a is not None and b is not None]
            s.bwd_time_s = sum(self._elapsed(a, b) for a, b in done) if done else None
            s._fwd, s._bwd, s._bwd_open = [], [], []
        # the root row is the whole forward of the step, also when the step calls submodules directly
        # (a LightningModule's training_step calling self.model(...)) or computes outside every module
        self.modules[0][1].fwd_flops = self.fwd_flops
        self.result = ProfileResult([s for _, s in self.modules], self.fwd_flops, self.bwd_flops, self.device)
        return self.result

    def __enter__(self) -> "ModuleProfiler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


__all__ = ["ModuleProfiler", "ModuleStats", "ProfileResult"]
