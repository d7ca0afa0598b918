"""Activation checkpointing whose checkpoints live in host memory (ZeRO-R's CPU checkpointing).

[Note: what is offloaded]
Under torch's non-reentrant checkpointing a region keeps *nothing* of what its ops save: every
saved tensor inside the region is replaced by a placeholder and recomputed in backward. What the
region does keep is its inputs (torch saves them through ``_make_saved_tensor``), so a transformer
trained with block-level checkpointing holds one ``batch x seq x d_model`` tensor per block: the
"checkpointed activations" DeepSpeed's ``cpu_checkpointing`` moves to the host. Those inputs are
saved *outside* the region's own hook, so a ``saved_tensors_hooks`` pair opened around the
checkpoint call sees exactly them (and nothing the region saves): :class:`HostOffloader`'s pack hook
copies each one into pinned host memory on a side stream (the device copy is freed once the copy has
run: ``record_stream`` keeps the caching allocator from reusing it earlier; large host copies take exact-size
blocks, host_blocks.py [Note: exact-size checkpoint blocks]), and its unpack hook, called
when backward reaches the region and recomputes it, brings it back. The values are copied bit for bit,
so losses and gradients equal plain non-reentrant checkpointing exactly.

[Note: prefetch]
Backward recomputes regions in the reverse order of their forwards. When region ``k`` is unpacked,
the input of the region packed just before it (``k - 1``, normally the next one backward needs) is
copied back on the side stream while region ``k`` recomputes and runs its backward; its unpack then
only waits for an event. A handle already unpacked is skipped (under pipeline schedules the previous
handle may belong to another micro-batch whose backward has run). Only one region ahead is fetched:
the point is to keep device memory at one or two checkpoints, not all of them.

[Note: on a machine without CUDA]
There is no device memory to save, but the pack hook still makes an honest host copy (a new
storage, the original released as on GPU), so tests on CPU measure where the checkpoints live and
check bitwise parity with plain checkpointing.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from lightning_zero.activations.host_blocks import EXACT_MIN_BYTES, HostBlocks
from lightning_zero.activations.recompute import replay_buffers, without_kv_cache

OFFLOAD_CHOICES = ("cpu", "none")
"""``offload`` values: 'cpu' (checkpoints in pinned host memory) or 'none' (plain non-reentrant checkpointing)."""

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass
class OffloadStats:
    """What an offloader moved (for memory reports and tests)."""

    live_bytes: int = 0
    """Bytes of host copies still referenced by an autograd graph."""
    peak_bytes: int = 0
    """Largest ``live_bytes`` seen."""
    packed: int = 0
    """Tensors copied to the host so far."""
    prefetched: int = 0
    """Tensors brought back ahead of their unpack ([Note: prefetch])."""


class _Handle:
    """One offloaded tensor: its host copy and, once fetched, the device copy on its way back."""

    __slots__ = ("host", "device", "offloaded", "fetched", "back", "prev", "unpacked", "events", "out", "__weakref__")

    def __init__(self, host: Tensor, device: torch.device, prev: Optional["_Handle"]) -> None:
        self.host = host
        self.device = device
        self.offloaded: Optional[torch.cuda.Event] = None
        self.fetched: Optional[torch.cuda.Event] = None
        self.back: Optional[Tensor] = None
        self.prev = weakref.ref(prev) if prev is not None else None
        self.unpacked = False
        self.events: list[torch.cuda.Event] = []
        """Every copy that reads or writes ``host`` (an exact-size block is reused only after them)."""
        self.out: Optional[Tensor] = None
        """The device tensor the first unpack returned: later unpacks of the same handle return it too."""


@dataclass
class HostOffloader:
    """``saved_tensors_hooks`` that keep saved tensors in (pinned) host memory ([Note: what is offloaded]).

    One offloader can serve many checkpointed regions; sharing it is what lets a region's unpack
    prefetch the previous region's input ([Note: prefetch]).
    """

    pin_memory: Optional[bool] = None
    """Page-lock the host copies (asynchronous, ~7x faster copies); None: when CUDA is available."""
    prefetch: bool = True
    """Bring the previous region's input back while this one recomputes."""
    min_bytes: int = 0
    """Tensors smaller than this stay where they are (a copy costs latency that tiny tensors do not repay)."""
    stats: OffloadStats = field(default_factory=OffloadStats)
    _last: Optional[weakref.ref] = field(default=None, repr=False)
    _streams: dict = field(default_factory=dict, repr=False)
    _blocks: Optional[HostBlocks] = field(default=None, repr=False)
    _region: dict = field(default_factory=dict, repr=False)
    """id -> (weak tensor, its version, handle) of what the open region packed ([Note: one copy per tensor])."""

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """The context manager to open around a checkpoint call. [Note: one copy per tensor] A tensor the region
        takes several times (``attn(x, x, x)``: query, key and value) is copied to the host once, not once per
        use, and its unpacks return one tensor. For an input that does not require grad that also keeps
        ``query is key`` true in the recomputation (nn.MultiheadAttention picks its packed projection by it);
        for one that does, autograd wraps each unpack in a tensor of its own, the recomputation takes the other
        projection and torch's checkpoint refuses it (a CheckpointError naming the saved tensors' shapes, not a
        silent difference): checkpoint the layer around such a module rather than the module itself."""
        self._region = {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._region = {}

    def _stream(self, device: torch.device) -> "torch.cuda.Stream":
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    # ------------------------------------------------------------------ hooks
    def pack(self, t: Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.device.type not in ("cpu", "cuda") or t.numel() * t.element_size() < self.min_bytes:
            return t  # weights stay where they are; so do tiny and exotic tensors
        seen = self._region.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        handle = self._pack(t)
        self._region[id(t)] = (weakref.ref(t), t._version, handle)
        return handle

    def _pack(self, t: Tensor) -> "_Handle":
        pin = self.pin_memory if self.pin_memory is not None else torch.cuda.is_available()
        nbytes = t.numel() * t.element_size()
        exact = pin and t.device.type == "cuda" and nbytes >= EXACT_MIN_BYTES  # [Note: exact-size checkpoint blocks]
        if exact:
            if self._blocks is None:
                self._blocks = HostBlocks(pin=True)
            block = self._blocks.take(nbytes)
            host = block.view(t.dtype).view(t.shape)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        last = self._last() if self._last is not None else None
        handle = _Handle(host, t.device, last)
        if exact:
            assert self._blocks is not None
            weakref.finalize(handle, self._blocks.give_back, block, handle.events)
        if t.device.type == "cuda":
            stream = self._stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))  # t is fully written
            with torch.cuda.stream(stream):
                host.copy_(t.detach(), non_blocking=True)
                handle.offloaded = torch.cuda.Event()
                handle.offloaded.record(stream)
                handle.events.append(handle.offloaded)
            t.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(t.detach())
        self.stats.packed += 1
        self.stats.live_bytes += nbytes
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.live_bytes)
        weakref.finalize(handle, _release, self.stats, nbytes)
        self._last = weakref.ref(handle)
        return handle

    def unpack(self, packed: Any) -> Tensor:
        if not isinstance(packed, _Handle):
            return packed
        handle = packed
        handle.unpacked = True
        if handle.device.type != "cuda":
            return handle.host
        if handle.out is not None:  # saved more than once ([Note: one copy per tensor])
            return handle.out
        if handle.back is None:
            self._fetch(handle)
        current = torch.cuda.current_stream(handle.device)
        assert handle.fetched is not None and handle.back is not None
        current.wait_event(handle.fetched)
        out, handle.back = handle.back, None
        out.record_stream(current)
        handle.out = out
        if self.prefetch:
            prev = handle.prev() if handle.prev is not None else None
            if prev is not None and not prev.unpacked and prev.back is None:
                self._fetch(prev)
                self.stats.prefetched += 1
        return out

    def _fetch(self, handle: _Handle) -> None:
        """Start copying ``handle`` back to its device on the side stream (after its offload copy)."""
        stream = self._stream(handle.device)
        with torch.cuda.stream(stream):
            if handle.offloaded is not None:
                stream.wait_event(handle.offloaded)
            back = torch.empty(handle.host.shape, dtype=handle.host.dtype, device=handle.device)
            back.copy_(handle.host, non_blocking=True)
            handle.fetched = torch.cuda.Event()
            handle.fetched.record(stream)
            handle.events.append(handle.fetched)
        handle.back = back


def _release(stats: OffloadStats, nbytes: int) -> None:
    stats.live_bytes -= nbytes


@dataclass
class _Checkpointed:
    """What :func:`checkpoint` did to a module (so it can be undone and is never done twice)."""

    forward: Callable[..., Any]
    offload: str
    offloader: Optional[HostOffloader]


def _wrap(fn: Callable[..., Any], offload: str, offloader: Optional[HostOffloader], preserve_rng_state: bool,
          module: Optional[nn.Module] = None) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved, nothing to recompute
            return fn(*args, **kwargs)
        kwargs = {**without_kv_cache(kwargs), **replay_buffers(module)}
        with offloader.hooks() if offloader is not None else contextlib.nullcontext():
            return torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    return run


def checkpoint(
    module_or_fn: Union[nn.Module, _F],
    offload: str = "cpu",
    *,
    offloader: Optional[HostOffloader] = None,
    preserve_rng_state: bool = True,
) -> Union[nn.Module, _F]:
    """Activation checkpointing of a module or function, its checkpoints offloaded to host memory.

    A function is returned wrapped: calling it runs ``fn`` under torch's non-reentrant checkpoint,
    with its inputs (the only tensors a checkpointed region keeps, [Note: what is offloaded]) in
    pinned host memory until backward recomputes it. A module is changed in place (its ``forward``
    is wrapped; names, parameters, state dict and hooks are untouched, so ZeRO-3 units and
    checkpoints see the same module) and returned; doing it twice is a no-op, :func:`remove_checkpoint`
    undoes it. ``offload='none'`` is plain non-reentrant checkpointing. Pass one ``offloader`` to
    several regions to prefetch across them ([Note: prefetch]); by default each call makes its own.
    Under ``torch.no_grad()`` the function simply runs.
    """
    if offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be one of {list(OFFLOAD_CHOICES)}, got {offload!r}.")
    if offload == "none":
        offloader = None
    elif offloader is None:
        offloader = HostOffloader()
    if isinstance(module_or_fn, nn.Module):
        module = module_or_fn
        if isinstance(getattr(module, "_lz_checkpointed", None), _Checkpointed):
            return module
        original = module.forward
        module._lz_checkpointed = _Checkpointed(original, offload, offloader)  # type: ignore[assignment]
        module.forward = _wrap(original, offload, offloader, preserve_rng_state, module)  # type: ignore[method-assign]
        return module
    if not callable(module_or_fn):
        raise TypeError(f"checkpoint() takes a module or a function, got {type(module_or_fn).__name__}.")
    return _wrap(module_or_fn, offload, offloader, preserve_rng_state)  # type: ignore[return-value]


def is_checkpointed(module: nn.Module) -> bool:
    return isinstance(getattr(module, "_lz_checkpointed", None), _Checkpointed)


def offloader_of(module: nn.Module) -> Optional[HostOffloader]:
    """The offloader of a module :func:`checkpoint` wrapped (None: not wrapped, or ``offload='none'``)."""
    state = getattr(module, "_lz_checkpointed", None)
    return state.offloader if isinstance(state, _Checkpointed) else None


def remove_checkpoint(module: nn.Module) -> nn.Module:
    """Undo :func:`checkpoint` on a module."""
    state = getattr(module, "_lz_checkpointed", None)
    if isinstance(state, _Checkpointed):
        del module.forward
        del module._lz_checkpointed
    return module


__all__ = ["checkpoint", "remove_checkpoint", "is_checkpointed", "offloader_of", "HostOffloader", "OffloadStats",
           "OFFLOAD_CHOICES"]
