"""Host-side (CPU) Adam/AdamW state in four precisions: one object per flat partition.

The offload engine allocates one :class:`HostAdamState` per flat host partition, through its own
allocator (pinned memory), and steps it with :func:`step`; the state owns the master copy in every
precision. Checkpoints never see the compact layouts: :meth:`HostAdamState.export_fp32` and
:meth:`HostAdamState.import_fp32` speak torch's fp32 Adam layout (master, exp_avg, exp_avg_sq), so a
checkpoint written under one precision resumes under any other.

[Note: host state precisions]
=============  ===================================================  ============  ==================
precision      master / exp_avg / exp_avg_sq                        bytes/param   rounding
=============  ===================================================  ============  ==================
``fp32``       fp32 / fp32 / fp32 (today's layout, ``cpu_adam``)    12            nearest
``bf16_sr``    bf16 / bf16 / bf16                                    6            stochastic, all three
``bf16_kahan`` bf16 + bf16 compensation / bf16 / bf16                8            master: Kahan-compensated
                                                                                  (nearest); moments stochastic
``int8``       fp32 / 8-bit codes / 8-bit codes, 2 fp32 scales       6.03125       nearest (codes)
               per 256-element block
=============  ===================================================  ============  ==================

Why each: a bf16 master rounded to nearest loses every update smaller than half an ulp (2^-9
relative), which late in training is most of them; stochastic rounding keeps each update *in
expectation* (unbiased), Kahan compensation keeps it *exactly* in a second bf16 word (the pair is a
~16-bit-mantissa master) at 2 more bytes. The moments are stochastically rounded in both bf16
layouts, Kahan's included: exp_avg_sq decays by 1 - beta2 = 1e-3 of itself per step, below half a
bf16 ulp, so rounded to nearest it would never decay (AnyPrecisionAdamW's bf16 variance has that
bias). The int8 layout keeps the fp32 master (updates are never lost) and stores the moments as
8-bit float-like codes; see [Note: int8 state codes] in ``reference_lowp.py`` for why those codes
and not a linear int8. At 13B parameters the host state is 156 GB (fp32), 78 GB (bf16_sr),
104 GB (bf16_kahan), 78 GB (int8): the two 6-byte layouts fit a 128 GiB host with room for the
gradient landing buffers.

Random bits (``bf16_sr``, ``bf16_kahan`` moments) come from a hash of (seed, step, global element
index) (see [Note: stochastic rounding bits]): the engine passes each partition's global offset, so
ranks draw different bits, and chunked or threaded steps give the same result as one call.

[Note: adopting the fp32 master]
The engine fills an fp32 master from the model's weights first; a state built beside it and filled
from it (``zeros`` + ``import_fp32``) holds both for a moment, 4 bytes per parameter more than
either, which set the construction peak. :meth:`HostAdamState.adopt` builds the state in the master's
own memory instead: ``int8`` (and ``fp32``) keep the fp32 buffer as their master; the bf16 layouts
write the rounded master into the buffer's first half (chunk by chunk: element i's two bytes lie
below element i's four, so only values already read are overwritten) and take the second half for
``exp_avg``. Given ``master16`` (the 16-bit parameter partition of stage 3 with parameters in host
memory, which in a bf16 layout *is* the master's value: [Note: master_view]) the master lives there
and the whole fp32 buffer becomes the two moments: 2 bytes per parameter less than the state plus the
partition, the difference between a 13B model fitting 128 GiB of host memory or not.

[Note: master_view]
:meth:`HostAdamState.master_view` is the tensor the update writes the master into: fp32 for ``fp32``
and ``int8``, bf16 for ``bf16_sr`` and ``bf16_kahan``. For ``bf16_kahan`` it is only the high word:
the master's value is ``master + comp`` (what :meth:`export_fp32` returns); the compute weights are
the high word (what ``out16`` receives). Writing into it directly bypasses ``comp`` (use
:meth:`import_fp32` to load a master).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Literal, Optional, get_args

import torch
from torch import Tensor

from lightning_zero.offload.cpu import AdamHyper
from lightning_zero.optim import reference_lowp as ref

HostStatePrecision = Literal["fp32", "bf16_sr", "bf16_kahan", "int8"]
PRECISIONS: tuple[HostStatePrecision, ...] = get_args(HostStatePrecision)
INT8_BLOCK = 256
"""Elements per int8 quantisation block (one fp32 scale per moment per block). Narrowed ranges of an
int8 state start on a block boundary."""
Alloc = Callable[[int, torch.dtype], Tensor]
_EXPORT_CHUNK = 1 << 20  # a multiple of INT8_BLOCK: export/import temporaries stay O(chunk)


def default_alloc(numel: int, dtype: torch.dtype) -> Tensor:
    """Pageable host memory (the engine passes its pinned allocator instead)."""
    return torch.empty(numel, dtype=dtype)


def check_precision(precision: str) -> HostStatePrecision:
    if precision not in PRECISIONS:
        raise ValueError(f"host state precision {precision!r} is not one of {list(PRECISIONS)}")
    return precision  # type: ignore[return-value]


def bytes_per_param(precision: HostStatePrecision) -> float:
    """Host bytes per parameter of the state (master included) for whole blocks; see
    [Note: host state precisions]. ``HostAdamState.zeros(n, p)`` holds at most this times n plus one
    partial block's scales (8 bytes)."""
    check_precision(precision)
    return {"fp32": 12.0, "bf16_sr": 6.0, "bf16_kahan": 8.0, "int8": 6.0 + 8.0 / INT8_BLOCK}[precision]


def _zeroed(alloc: Alloc, numel: int, dtype: torch.dtype) -> Tensor:
    t = alloc(numel, dtype)
    if t.numel() != numel or t.dtype != dtype or not t.is_contiguous():
        raise ValueError(f"alloc({numel}, {dtype}) returned {t.dtype}[{t.numel()}] (contiguous: {t.is_contiguous()})")
    return t.zero_()


def _blocks(numel: int) -> int:
    return (numel + INT8_BLOCK - 1) // INT8_BLOCK


@dataclass
class HostAdamState:
    """The Adam state of one flat host range, master included (see [Note: host state precisions])."""

    precision: HostStatePrecision
    master: Tensor
    """fp32 (``fp32``, ``int8``) or bf16 (``bf16_*``); see [Note: master_view]."""
    exp_avg: Tensor
    """fp32, bf16, or uint8 codes (``int8``: sign + E4M3 of exp_avg / block absmax)."""
    exp_avg_sq: Tensor
    """fp32, bf16, or uint8 codes (``int8``: E4M4 of sqrt(exp_avg_sq) / block max)."""
    comp: Optional[Tensor] = None
    """``bf16_kahan``: the bf16 compensation (master's value is master + comp)."""
    exp_avg_scale: Optional[Tensor] = None
    """``int8``: one fp32 absmax per block."""
    exp_avg_sq_scale: Optional[Tensor] = None
    """``int8``: one fp32 max of sqrt(exp_avg_sq) per block."""
    base: int = 0
    """Index of element 0 within the state this one was narrowed from (0 for a root state)."""
    seed: int = 0
    """Seed of the stochastic rounding bits."""

    @property
    def numel(self) -> int:
        return self.master.numel()

    @classmethod
    def zeros(cls, numel: int, precision: HostStatePrecision, alloc: Alloc = default_alloc,
              seed: int = 0) -> "HostAdamState":
        """A zero state (zero master, zero moments) of ``numel`` elements, every tensor from ``alloc``."""
        check_precision(precision)

        def z(n: int, dtype: torch.dtype) -> Tensor:
            return _zeroed(alloc, n, dtype)

        if precision == "fp32":
            return cls(precision, z(numel, torch.float32), z(numel, torch.float32), z(numel, torch.float32), seed=seed)
        if precision == "int8":
            return cls(precision, z(numel, torch.float32), z(numel, torch.uint8), z(numel, torch.uint8),
                       exp_avg_scale=z(_blocks(numel), torch.float32),
                       exp_avg_sq_scale=z(_blocks(numel), torch.float32), seed=seed)  # fmt: skip
        bf = torch.bfloat16
        comp = z(numel, bf) if precision == "bf16_kahan" else None
        return cls(precision, z(numel, bf), z(numel, bf), z(numel, bf), comp=comp, seed=seed)

    @classmethod
    def adopt(cls, master: Tensor, precision: HostStatePrecision, alloc: Alloc = default_alloc,
              master16: Optional[Tensor] = None, seed: int = 0) -> "HostAdamState":
        """A fresh state (zero moments) of the fp32 ``master``, built in the memory ``master`` already
        holds: bit for bit what ``zeros(n, precision)`` then ``import_fp32(master)`` give, without the
        second copy (see [Note: adopting the fp32 master]). ``alloc`` is called only for what the
        layout needs beyond the fp32 buffer. ``master16`` (bf16 layouts): a bf16 buffer of ``n``
        elements that becomes the master. ``master``'s memory belongs to the state afterwards."""
        check_precision(precision)
        if master.dtype != torch.float32 or master.dim() != 1 or not master.is_contiguous():
            raise ValueError(f"adopt: needs a contiguous 1-D fp32 master, got {master.dtype}{tuple(master.shape)}")
        n = master.numel()
        if precision == "fp32":
            return cls(precision, master, _zeroed(alloc, n, torch.float32), _zeroed(alloc, n, torch.float32), seed=seed)
        if precision == "int8":
            return cls(precision, master, _zeroed(alloc, n, torch.uint8), _zeroed(alloc, n, torch.uint8),
                       exp_avg_scale=_zeroed(alloc, _blocks(n), torch.float32),
                       exp_avg_sq_scale=_zeroed(alloc, _blocks(n), torch.float32), seed=seed)  # fmt: skip
        bf = torch.bfloat16
        comp = _zeroed(alloc, n, bf) if precision == "bf16_kahan" else None
        words = master.view(bf)  # 2n bf16 words over the fp32 buffer
        if master16 is not None and (master16.dtype != bf or master16.numel() != n or not master16.is_contiguous()):
            raise ValueError(f"adopt: master16 must be a contiguous bf16 tensor of {n} elements, got "
                             f"{master16.dtype}[{master16.numel()}]")
        high = master16.view(-1) if master16 is not None else words[:n]
        for lo in range(0, n, _EXPORT_CHUNK):
            hi = min(n, lo + _EXPORT_CHUNK)
            m32 = master[lo:hi] if master16 is not None else master[lo:hi].clone()  # in place: read before written
            high[lo:hi].copy_(m32)
            if comp is not None:
                comp[lo:hi].copy_(m32 - high[lo:hi].to(torch.float32))
        if master16 is not None:  # every fp32 value is read: the buffer becomes the two moments
            exp_avg, exp_avg_sq = words[:n].zero_(), words[n:].zero_()
        else:
            exp_avg, exp_avg_sq = words[n:].zero_(), _zeroed(alloc, n, bf)
        return cls(precision, high, exp_avg, exp_avg_sq, comp=comp, seed=seed)

    def tensors(self) -> list[Tensor]:
        """Every tensor of the state (for byte counts, pinning checks)."""
        optional = (self.comp, self.exp_avg_scale, self.exp_avg_sq_scale)
        return [self.master, self.exp_avg, self.exp_avg_sq, *(t for t in optional if t is not None)]

    def narrow(self, lo: int, hi: int) -> "HostAdamState":
        """A view-state of elements [lo, hi): steps on it update this state in place. For ``int8``,
        ``lo`` must be a multiple of ``INT8_BLOCK`` and ``hi`` one too or the end (blocks share scales)."""
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"narrow({lo}, {hi}) outside [0, {self.numel}]")
        if self.precision == "int8":
            if lo % INT8_BLOCK or (hi % INT8_BLOCK and hi != self.numel):
                raise ValueError(f"int8 host state: narrow({lo}, {hi}) must start and end on a block of {INT8_BLOCK} "
                                 "(or end at the state's end)")
            assert self.exp_avg_scale is not None and self.exp_avg_sq_scale is not None
            b0, b1 = lo // INT8_BLOCK, _blocks(hi)
            return replace(self, master=self.master[lo:hi], exp_avg=self.exp_avg[lo:hi],
                           exp_avg_sq=self.exp_avg_sq[lo:hi], exp_avg_scale=self.exp_avg_scale[b0:b1],
                           exp_avg_sq_scale=self.exp_avg_sq_scale[b0:b1], base=self.base + lo)  # fmt: skip
        comp = None if self.comp is None else self.comp[lo:hi]
        return replace(self, master=self.master[lo:hi], exp_avg=self.exp_avg[lo:hi], exp_avg_sq=self.exp_avg_sq[lo:hi],
                       comp=comp, base=self.base + lo)  # fmt: skip

    def master_view(self) -> Tensor:
        """The tensor holding the master (fp32 or bf16; see [Note: master_view])."""
        return self.master

    def _chunks(self) -> list[tuple[int, int]]:
        return [(lo, min(lo + _EXPORT_CHUNK, self.numel)) for lo in range(0, self.numel, _EXPORT_CHUNK)]

    def export_fp32(self) -> tuple[Tensor, Tensor, Tensor]:
        """(master, exp_avg, exp_avg_sq) as new fp32 tensors in torch's Adam layout (``bf16_kahan``:
        master + comp). Temporaries beyond the three outputs are bounded by a chunk."""
        out = tuple(torch.empty(self.numel, dtype=torch.float32) for _ in range(3))
        for lo, hi in self._chunks():
            part = self.narrow(lo, hi)
            master, exp_avg, exp_avg_sq = (t[lo:hi] for t in out)
            if part.precision == "int8":
                assert part.exp_avg_scale is not None and part.exp_avg_sq_scale is not None
                master.copy_(part.master)
                exp_avg.copy_(ref.dequantize(part.exp_avg, part.exp_avg_scale, INT8_BLOCK, signed=True))
                w = ref.dequantize(part.exp_avg_sq, part.exp_avg_sq_scale, INT8_BLOCK, signed=False)
                exp_avg_sq.copy_(w * w)
            else:
                master.copy_(part.master)
                if part.comp is not None:
                    master.add_(part.comp.to(torch.float32))
                exp_avg.copy_(part.exp_avg)
                exp_avg_sq.copy_(part.exp_avg_sq)
        return out  # type: ignore[return-value]

    def import_fp32(self, master: Tensor, exp_avg: Optional[Tensor] = None, exp_avg_sq: Optional[Tensor] = None) -> None:
        """Load torch's fp32 layout (moments None: zeros, e.g. a fresh master from the model's weights).
        bf16 words are rounded to nearest (``bf16_kahan``: comp = master - high word, rounded);
        ``int8`` quantises per block."""
        for t in (master, exp_avg, exp_avg_sq):
            if t is not None and t.numel() != self.numel:
                raise ValueError(f"import_fp32: {t.numel()} elements for a state of {self.numel}")
        for lo, hi in self._chunks():
            part = self.narrow(lo, hi)
            m32 = master.reshape(-1)[lo:hi].to(torch.float32)
            ea = None if exp_avg is None else exp_avg.reshape(-1)[lo:hi].to(torch.float32)
            eas = None if exp_avg_sq is None else exp_avg_sq.reshape(-1)[lo:hi].to(torch.float32)
            part.master.copy_(m32)
            if part.comp is not None:
                part.comp.copy_(m32 - part.master.to(torch.float32))
            if part.precision == "int8":
                assert part.exp_avg_scale is not None and part.exp_avg_sq_scale is not None
                for codes, scale, value, quantize in (
                    (part.exp_avg, part.exp_avg_scale, ea, ref.quantize_m),
                    (part.exp_avg_sq, part.exp_avg_sq_scale, None if eas is None else ref.sqrt32(eas), ref.quantize_w),
                ):  # fmt: skip
                    if value is None:
                        codes.zero_()
                        scale.zero_()
                    else:
                        q, s = quantize(value, INT8_BLOCK)
                        codes.copy_(q)
                        scale.copy_(s)
            else:
                for dst, value in ((part.exp_avg, ea), (part.exp_avg_sq, eas)):
                    dst.zero_() if value is None else dst.copy_(value)


# ------------------------------------------------------------------------------------------- step
def load_host_op(precision: HostStatePrecision) -> Optional[object]:
    """The compiled op that steps ``precision`` (``cpu_adam`` for fp32, ``cpu_adam_lowp`` otherwise), or
    None after one warning per op when it cannot be built here; :func:`step` then runs the reference."""
    from lightning_zero.ops.registry import get_op

    return get_op("cpu_adam" if check_precision(precision) == "fp32" else "cpu_adam_lowp").try_load()


def step(
    op: Optional[object], state: HostAdamState, grad: Tensor, out16: Optional[Tensor], step: int, hyper: AdamHyper,
    grad_scale: float = 1.0, threads: int = 0, offset: int = 0,
) -> None:
    """One Adam/AdamW update of ``state`` in place.

    ``grad`` (fp32/bf16/fp16, ``state.numel`` elements) is divided by ``grad_scale``; ``out16`` (bf16 or
    fp16, optional) receives the updated compute weights in the same pass; ``step`` is 1-based, bias
    correction as torch's Adam. ``offset`` is the global index of the *root* state's element 0 (e.g. the
    partition's offset in the flat parameter group): the stochastic rounding bits of element i are drawn
    for ``offset + state.base + i``. ``op`` is :func:`load_host_op`'s result; None runs the pure-torch
    reference (``fp32``: torch's fused CPU Adam), with the same results (bit for bit for the low
    precisions).
    """
    if grad.numel() != state.numel or (out16 is not None and out16.numel() != state.numel):
        raise ValueError(f"grad/out16 of {grad.numel()}/{None if out16 is None else out16.numel()} elements "
                         f"for a state of {state.numel}")
    h = dict(lr=hyper.lr, beta1=hyper.beta1, beta2=hyper.beta2, eps=hyper.eps, weight_decay=hyper.weight_decay,
             adamw_mode=hyper.adamw_mode, step=step, grad_scale=grad_scale)  # fmt: skip
    if state.precision == "fp32":
        _fp32_step(op, state, grad, out16, h, threads)
    elif state.precision == "int8":
        assert state.exp_avg_scale is not None and state.exp_avg_sq_scale is not None
        args = (state.master, grad, state.exp_avg, state.exp_avg_scale, state.exp_avg_sq, state.exp_avg_sq_scale, out16)
        if op is None:
            ref.adam_int8_reference(*args, block=INT8_BLOCK, **h)
        else:
            _require(op, "adam_step_int8").adam_step_int8(*args, block=INT8_BLOCK, num_threads=threads, **h)
    else:
        args = (state.master, state.comp, grad, state.exp_avg, state.exp_avg_sq, out16)
        index = offset + state.base
        if op is None:
            ref.adam_bf16_reference(*args, seed=state.seed, offset=index, **h)
        else:
            _require(op, "adam_step_bf16").adam_step_bf16(*args, seed=state.seed, offset=index, num_threads=threads, **h)


def _require(op: object, name: str) -> object:
    if not hasattr(op, name):
        raise TypeError(f"{op!r} has no {name}: pass load_host_op(precision)")
    return op


def _fp32_step(op: Optional[object], state: HostAdamState, grad: Tensor, out16: Optional[Tensor], h: dict,
               threads: int) -> None:
    if op is not None:
        _require(op, "adam_step").adam_step(  # type: ignore[attr-defined]
            state.master, grad, state.exp_avg, state.exp_avg_sq, out16, num_threads=threads, **h)
        return
    from lightning_zero.optim.torch_adam import torch_adam_step

    scale = None if h["grad_scale"] == 1.0 else torch.tensor(h["grad_scale"])
    torch_adam_step(
        [state.master], [grad], [state.exp_avg], [state.exp_avg_sq], [torch.tensor(float(h["step"] - 1))], [out16],
        lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"], weight_decay=h["weight_decay"],
        adamw_mode=h["adamw_mode"], grad_scale=scale,
    )  # fmt: skip
