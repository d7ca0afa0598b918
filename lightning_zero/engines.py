"""Engines: the ZeRO engines of one model (one per optimizer) and the per-step events both front doors call.

The Trainer's strategy (strategy.py) and Fabric's (fabric/strategy.py) each hold one ``Engines`` (built
empty with the strategy, filled by apply.py's :func:`~lightning_zero.apply.apply_zero`) and call, in
their framework's order: :meth:`begin_step` (buffers from rank 0, stage 3's root unit gathered, the
first batch of each kind under ReadWatch), :meth:`sync_blocked` (gradient accumulation),
:meth:`post_backward`, :meth:`step` (unscale, clip, step, the non-finite policy), :meth:`gathered_params`,
:meth:`teardown` and, after a failure, :meth:`fail` / :meth:`abandon`. Every event goes to every engine;
what an event means for a stage is the engine's own method (zero/engine.py [Note: events, not engine
classes]), so nothing here asks which engine class it holds.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Generator, Iterator, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed import protocol as compressed_comm
from lightning_zero.config import ZeroConfig
from lightning_zero.failures import FailureBoard, PeerWatchdog, hold_sigterm, print_once, start_watchdog
from lightning_zero.frozen_fp32 import FrozenFp32
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.precision import ZeroPrecision, explain_cast_layout_mismatch
from lightning_zero.zero.buffers import BufferSync
from lightning_zero.zero.compile import CompilePlan
from lightning_zero.zero.engine import ZeroEngine
from lightning_zero.zero.read_watch import ReadWatch, explain_released_read
from lightning_zero.zero.rebind import rebind_groups

log = logging.getLogger(__name__)


class NonFiniteStepError(RuntimeError):
    """A non-finite gradient stopped the run (``nonfinite='error'``, or ``max_nonfinite_steps`` in a row)."""


class Engines:
    """The engines of the module a strategy set up, by optimizer, and what happens to them each step.

    ``precision`` returns the strategy's current precision plugin (Lightning's connector may replace it
    after the strategy is built)."""

    def __init__(self, config: ZeroConfig, precision: Callable[[], ZeroPrecision]) -> None:
        self.config = config
        self._precision = precision
        self.by_optimizer: dict[int, ZeroEngine] = {}
        """id(optimizer) -> its engine."""
        self.module: Optional[Module] = None
        """The module the engines manage (set by apply.py's ``prepare_module``)."""
        self.dims: Optional[ParallelDims] = None
        self.orig_dtypes: dict[str, torch.dtype] = {}
        """The module's state-dict dtypes before the cast: what checkpoints restore."""
        self.rounded_start: list[str] = []
        """Trainable parameters whose masters were taken from 16-bit copies (:func:`rounded_params`); cleared by
        a checkpoint load, refused at the first training step otherwise."""
        self.frozen_fp32: Optional[FrozenFp32] = None
        """Exact fp32 shares of frozen parameters the cast layout computes in 16 bits (frozen_fp32.py)."""
        self.orig_buffer_dtypes: dict[str, torch.dtype] = {}
        """Every buffer's dtype before the cast, non-persistent ones too: what a fit hands back (after_fit.py)."""
        self.step_fence: Optional[Callable[[], None]] = None
        """Called before every optimizer step: an async checkpoint save still copying the states the step
        changes is waited for there, on the device (checkpoint/async_stage.py [Note: async staging])."""
        self.guards: list[RemovableHandle] = []
        self.buffer_sync: Optional[BufferSync] = None
        self.compile_plan: Optional[CompilePlan] = None
        """What zero/compile.py compiled or made eager at the last setup (None: nothing to do)."""
        self.watched: set[str] = set()
        """Step kinds whose first batch ran under stage 3's ReadWatch (read_watch.py)."""
        self._watch: Optional[ReadWatch] = None
        self._watchdog: Optional[PeerWatchdog] = None
        self.failed = False
        """Set by a failure: teardown then releases everything without a collective."""
        self._steps_seen: dict[int, int] = {}
        """Optimizer steps taken or skipped, by engine id (for messages)."""
        self._nonfinite_skipped = 0
        """Steps skipped for a non-finite gradient (fp32/bf16; fp16's skips are its scaler's)."""
        self._nonfinite_in_a_row = 0

    @property
    def precision(self) -> ZeroPrecision:
        """The strategy's precision plugin now."""
        return self._precision()

    # ------------------------------------------------------------------ the engines
    def __iter__(self) -> Iterator[ZeroEngine]:
        return iter(list(self.by_optimizer.values()))

    def __len__(self) -> int:
        return len(self.by_optimizer)

    @property
    def engines(self) -> list[ZeroEngine]:
        return list(self.by_optimizer.values())

    def of(self, optimizer: Any) -> Optional[ZeroEngine]:
        """The engine of ``optimizer`` (a LightningOptimizer is unwrapped); None: not set up here."""
        return self.by_optimizer.get(id(getattr(optimizer, "_optimizer", optimizer)))

    def route_zero_grad(self, optimizers: list[Any]) -> None:
        """engine.py [Note: the optimizer keeps the model's parameters]: ``zero_grad`` discards what the
        engine accumulated."""
        for opt in optimizers:
            engine = self.of(opt)
            if engine is not None:
                opt.zero_grad = engine.zero_grad

    def inner_units(self) -> list[Any]:
        """The units below the root of the first engine that has units (stage 3), for compile."""
        return next((u for u in (e.inner_units() for e in self) if u is not None), [])

    def unit_modules(self) -> list[Module]:
        """Every engine's unit modules below the root (stage 3), for activation offload."""
        return [u.module for e in self for u in (e.inner_units() or []) if u.module is not None]

    def unshard_to_plain(self) -> None:
        """A second setup: parameters of the previous engines get their full storage back first."""
        for engine in self:
            engine.unshard_to_plain()

    def install_module_hooks(self) -> None:
        """Validate/test/predict after fit: the engines' forward hooks back on."""
        for engine in self:
            engine.install_module_hooks()

    def remove_guards(self) -> None:
        for guard in self.guards:
            guard.remove()
        self.guards = []

    # ------------------------------------------------------------------ step boundaries
    @contextmanager
    def gathered_params(self, module: Optional[Module] = None, writeback: bool = False) -> Generator[None, None, None]:
        """Full parameters of ``module`` (default: all) inside the block, e.g. for generation or export.

        Below stage 3 the parameters are full already; ``writeback`` puts changes made inside into the
        masters. Under stage 3 it is collective: every rank must enter it.
        """
        with ExitStack() as stack:
            for engine in self:
                stack.enter_context(engine.gathered_params(module, writeback))
            yield

    def watch_first(self, kind: Optional[str]) -> None:
        """A new batch: the previous one's watch ends; the first batch of each kind runs under ReadWatch
        until the next batch (read_watch.py)."""
        self.end_watch()
        if kind is not None and kind not in self.watched:
            watch = ReadWatch.over(self.engines)
            if watch is not None:
                self.watched.add(kind)
                self._watch = watch
                watch.__enter__()

    def end_watch(self) -> None:
        if self._watch is not None:
            watch, self._watch = self._watch, None
            watch.__exit__(None, None, None)

    def set_gathering(self, on: bool) -> None:
        """While a step method runs, a first batch's ReadWatch gathers what it reads outside units."""
        if self._watch is not None:
            self._watch.gathering = on

    def start_step(self, kind: str) -> None:
        """Buffers from rank 0 (buffers.py); stage-3 root and resident units gathered."""
        if self.rounded_start and kind == "train":
            names, self.rounded_start = self.rounded_start, []
            raise RuntimeError(
                f"Parameter '{names[0]}'{f' and {len(names) - 1} more' if len(names) > 1 else ''} held the previous "
                "fit's 16-bit training copy when this fit set up (its fp32 master was not handed back after that "
                "fit: no room, as warned then), so training would start from rounded weights, unlike ddp. Resume "
                "from a checkpoint of that fit (`trainer.fit(model, ckpt_path=...)`), or, before fitting again, "
                "load the fp32 weights `trainer.strategy.full_state_dict()` gives after a fit into the module."
            )
        if self.buffer_sync is not None and kind in ("train", "val"):
            self.buffer_sync.sync(reduces=kind == "train" and all(engine.require_sync for engine in self))
        for engine in self:
            engine.begin_step()

    @contextmanager
    def begin_step(self, kind: str) -> Generator[None, None, None]:
        """:meth:`start_step`, and a first batch's ReadWatch gathers what the step reads outside units."""
        self.start_step(kind)
        watch = self._watch
        if watch is not None:
            watch.gathering = True
        try:
            yield
        finally:
            if watch is not None:
                watch.gathering = False

    def end_eval_step(self) -> None:
        for engine in self:
            engine.end_eval_step()

    # ------------------------------------------------------------------ backward and step
    @contextmanager
    def sync_blocked(self) -> Generator[None, None, None]:
        """Gradient accumulation: stages 0/1 keep accumulating locally; stage 2 reduces anyway."""
        for engine in self:
            engine.require_sync = False
        try:
            yield None
        finally:
            for engine in self:
                engine.require_sync = True

    @staticmethod
    def before_backward(engine: ZeroEngine) -> None:
        """1-bit optimizers decide per step whether gradients are all-reduced at all."""
        engine.reduce_gradients = compressed_comm.gradient_allreduce_needed(engine.optimizer)

    def post_backward(self) -> None:
        for engine in self:
            engine.post_backward()

    def step(self, engine: ZeroEngine, clip: Optional[float], step_index: Optional[int] = None,
             clip_value: Optional[float] = None) -> bool:
        """Unscale, clip, step and write back through ``engine``; False (and a warning) when the step
        was skipped on every rank: an fp16 overflow, or a non-finite gradient under ``nonfinite='skip'``
        (zero/engine.py [Note: non-finite steps]); ``nonfinite='error'``, or too many skips in a row,
        raise :class:`NonFiniteStepError` on every rank. ``step_index``: the step's number for messages
        (default: this optimizer's steps so far, skipped ones included). ``clip``: max global norm;
        ``clip_value``: max absolute value of each gradient element (zero/engine.py [Note: clipping by value])."""
        if self.step_fence is not None:
            self.step_fence()
        precision = self._precision()
        scaler = precision.scaler
        policy = self.config.nonfinite
        step = self._steps_seen.get(id(engine), 0) if step_index is None else step_index
        self._steps_seen[id(engine)] = step + 1
        scale_can_drop = scaler is not None and scaler.scale > scaler.config.min_scale
        # fp16 overflows the scale can still absorb are the scaler's: no search for the culprit
        rebind_groups(engine.groups, engine.param_names)  # zero/rebind.py [Note: replaced parameter storage]
        stepped = engine.step(clip, scaler, check_finite=policy != "ignore" and not scale_can_drop, clip_value=clip_value)
        if stepped:
            self._nonfinite_in_a_row = 0
            return True
        if scaler is not None and (policy == "ignore" or scale_can_drop):
            rank_zero_only(log.warning)(
                f"fp16 gradient overflow: step skipped on every rank, loss scale now {precision.loss_scale:g}"
            )
            return False
        self._nonfinite_in_a_row += 1
        if scaler is None:
            self._nonfinite_skipped += 1  # fp16's skips are counted by its scaler
        where = _where_nonfinite(engine)
        what = f"Non-finite gradient norm ({engine.grad_norm}) at step {step}: {where}"
        if policy == "error":
            raise NonFiniteStepError(f"{what}. Stopping (nonfinite='error'); nonfinite='skip' skips such steps.")
        if self._nonfinite_in_a_row >= self.config.max_nonfinite_steps:
            raise NonFiniteStepError(
                f"{what}. {self._nonfinite_in_a_row} non-finite steps in a row (max_nonfinite_steps="
                f"{self.config.max_nonfinite_steps}): the run diverged or its data holds NaN/inf; stopping."
            )
        rank_zero_only(log.warning)(
            f"{what}. Step skipped on every rank (weights and optimizer state unchanged; "
            f"{self._nonfinite_in_a_row} in a row of max_nonfinite_steps={self.config.max_nonfinite_steps})."
        )
        return False

    # ------------------------------------------------------------------ readers
    @property
    def grad_norm(self) -> Optional[float]:
        """Global gradient norm (unscaled, before clipping) of the last step, for logging."""
        norms = [e.grad_norm for e in self if e.grad_norm is not None]
        return float(sum(n * n for n in norms) ** 0.5) if norms else None

    @property
    def loss_scale(self) -> Optional[float]:
        return self._precision().loss_scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank so far: fp16 overflows and non-finite steps (``nonfinite='skip'``)."""
        scaler = self._precision().scaler
        return (scaler.overflows if scaler is not None else 0) + self._nonfinite_skipped

    # ------------------------------------------------------------------ failure and teardown
    def start_watchdog(self) -> None:
        """failures.py [Note: failing once]: a peer's failure ends this rank, swap files removed."""
        self.failed = False
        if self._watchdog is None:
            self._watchdog = start_watchdog([self.remove_swap_dirs])

    def fail(self, exception: BaseException, settle: Callable[[], None]) -> None:
        """A failure on this rank: reported in full once across ranks (failures.py [Note: failing
        once]); teardown will release engines without collectives; ``settle`` (an async checkpoint save
        still writing gets a bounded wait) runs before the engines are abandoned. Torch's error on a
        released ZeRO-3 parameter becomes one that says where and what to do; its dtype mismatch under the
        cast layout gets the layout's hint (precision.py :func:`explain_cast_layout_mismatch`)."""
        self.end_watch()
        self.failed = True
        C.destroy_groups_at_exit(False)  # a peer may be gone: no destroy at exit ([Note: destroy at exit])
        hold_sigterm()  # the cleanup below and in teardown runs to its end
        if self._watchdog is not None:
            self._watchdog.own_failure = True
        settle()
        # Engines abandoned first (background steps joined, swap files removed; no collective), before the
        # report below, which may wait on the store for a second: Lightning's launcher SIGKILLs every
        # rank the moment a failed peer exits, and swap files must not outlive the job. Teardown repeats
        # it (idempotent).
        self.abandon()
        if not isinstance(exception, KeyboardInterrupt):
            print_once(FailureBoard.for_default_group(exception), exception)  # the main thread's own store client
        released = {id(p): self.param_name(p) for e in self for p in e.sharded_params()}
        message = explain_released_read(exception, released) if released else None
        message = message or explain_cast_layout_mismatch(exception, self.precision)
        if message is not None:
            exception.args = (message,)

    def abandon(self) -> None:
        """Every engine released without a collective (background steps joined, swap files removed)."""
        for engine in self:
            engine.abandon()

    def param_name(self, param: Parameter) -> str:
        for engine in self:
            name = engine.param_names.get(id(param))
            if name is not None:
                return name
        return "a parameter"

    def remove_swap_dirs(self) -> None:
        """The watchdog's cleanup when a peer failed and this process is ended (no collective)."""
        for engine in self:
            path = engine.swap_dir()
            if path:
                shutil.rmtree(path, ignore_errors=True)

    def teardown(self, wait_for_checkpoint: Callable[[], None]) -> None:
        """Watchdog joined; engines finish (offload: a delayed step, swap files) and drop their hooks,
        or after a failure are abandoned without a collective. Engines stay: a save after training
        still gathers their shards; released stage-3 modules get a guard naming the fix."""
        self.end_watch()
        if self._watchdog is not None:  # joined: a daemon thread inside a store call at interpreter exit aborts it
            self._watchdog.stop()
            self._watchdog.join(timeout=5.0)
            self._watchdog = None
        C.destroy_groups_at_exit(not self.failed)  # comm/collectives.py [Note: destroy at exit]
        if self.failed:  # after an exception: no collective (a peer may be gone), threads joined, swap removed
            self.abandon()
            return
        wait_for_checkpoint()  # an async save still writing: training ends when it is on disk
        for engine in self:
            engine.teardown()  # offload: finish a delayed step, release swap files
            engine.remove_hooks()
            if self.module is not None:
                self.guards += engine.guard_released(self.module)


def _where_nonfinite(engine: ZeroEngine) -> str:
    """Collective (every rank skipped the same step): the first non-finite gradient any rank found in
    its shard, as words."""
    found = [f for f in C.all_gather_object(engine.nonfinite_where, None) if isinstance(f, tuple)]  # (group, name)
    if not found:
        return "every gradient element is finite, the sum of their squares overflowed (gradients above ~1e19)"
    group, name = min(found, key=lambda f: f[0])
    return f"first non-finite gradient in param group {group} ('{name}')"


def check_optimizers_own_their_params(optimizers: list[Optimizer], names: dict[int, str]) -> None:
    """Each parameter in at most one optimizer: its partition and optimizer state exist once."""
    owner: dict[int, int] = {}
    for i, opt in enumerate(optimizers):
        for pg in opt.param_groups:
            for p in pg["params"]:
                j = owner.setdefault(id(p), i)
                if j != i:
                    raise ValueError(
                        f"Parameter '{names.get(id(p), '?')}' is in optimizer {j} ({type(optimizers[j]).__name__}) and in "
                        f"optimizer {i} ({type(opt).__name__}). ZeRO keeps one partition and one optimizer state per "
                        "parameter: give every parameter to exactly one optimizer."
                    )


def check_real_params(optimizers: list[Optimizer], names: dict[int, str]) -> None:
    """Refuse trainable complex parameters (a Fourier neural operator's spectral weights), before the first step.

    Every stage keeps trainable parameters as views of real flat buffers, so a complex one came back as a real
    tensor and the model's own forward failed ("expected scalar type ComplexFloat but found Float"), naming
    nothing of ours. torch's optimizers step a complex parameter as its real view (``torch.view_as_real``),
    which is the fix offered: the same model stored as real pairs trains as ddp trains the complex one.
    Frozen complex parameters are left alone (no stage partitions them)."""
    for opt in optimizers:
        for pg in opt.param_groups:
            for p in pg["params"]:
                if p.is_complex() and p.requires_grad:
                    raise ValueError(
                        f"Parameter '{names.get(id(p), '?')}' is complex ({p.dtype}): ZeRO partitions real parameters "
                        "only. Store it as real pairs, `nn.Parameter(torch.view_as_real(w))`, and use "
                        "`torch.view_as_complex(self.w)` in forward: torch's optimizers step a complex parameter as "
                        "exactly that real view, so the model trains as before."
                    )


def check_fp32_params(optimizers: list[Optimizer], names: dict[int, str], dtypes: dict[str, torch.dtype]) -> None:
    """Refuse trainable parameters the user built in another floating dtype than fp32, before the first step.

    Every stage keeps an fp32 master of each trainable parameter and steps that. ddp (any precision: autocast
    leaves the parameters' dtypes alone) steps a bf16/fp16 parameter in its own dtype, optimizer states too, and
    an fp64 one in fp64: measured, an ``nn.Embedding(...).to(torch.bfloat16)`` under ``32-true`` trained 0.5%
    apart from ddp's in 6 AdamW steps under stages 1 and 2, silently. ``dtypes``: the dtypes the user built
    (``Engines.orig_dtypes``, recorded before any cast of the cast layout). Frozen parameters are left alone (a
    bf16 base under fp32 LoRA adapters trains as under ddp)."""
    for opt in optimizers:
        for pg in opt.param_groups:
            for p in pg["params"]:
                name = names.get(id(p), "?")
                dtype = dtypes.get(name, p.dtype)
                if p.requires_grad and dtype.is_floating_point and dtype != torch.float32:
                    raise ValueError(
                        f"Parameter '{name}' is trainable in {dtype}: ZeRO keeps an fp32 master of every trainable "
                        f"parameter and steps that, where ddp would step it (and its optimizer state) in {dtype}, "
                        "so it would train differently. Build it in fp32 (`module.float()`) and choose 16-bit "
                        "compute with the precision (`precision='bf16-mixed'`), or freeze it."
                    )


def rounded_params(optimizers: list[Optimizer], names: dict[int, str], dtypes: dict[str, torch.dtype]) -> list[str]:
    """Trainable fp32 parameters that hold the cast layout's 16-bit copy when engines are built (the previous fit
    could not hand the masters back: after_fit.py warned there was no room): masters taken from them are rounded
    (:meth:`Engines.start_step` refuses to train from them unless a checkpoint replaced them)."""
    return [names.get(id(p), "?") for opt in optimizers for pg in opt.param_groups for p in pg["params"]
            if p.requires_grad and dtypes.get(names.get(id(p), "?"), p.dtype) == torch.float32
            and p.dtype != torch.float32]


def check_supported_layers(module: Module) -> None:
    """Refuse, before the first step, layers whose weight ZeRO cannot follow:

    * ``nn.Embedding``/``nn.EmbeddingBag`` with ``sparse=True``: every stage reduces gradients through
      dense flat buffers (the first backward failed with torch's "copy_() between dense and sparse");
      frozen ones have no gradient and pass;
    * ``nn.Embedding``/``nn.EmbeddingBag`` with ``max_norm``: the forward renormalises the rows it looks
      up in place, on the module's weight; ddp's optimizer steps from those values, ZeRO's steps from
      its own partitioned masters and writes them back, so stages 1 and 2 silently trained another model
      (weights off by 4x-9x after 12 steps) and stage 3 failed mid-run at the first release (frozen
      too: stage 3 partitions frozen weights).
    """
    for name, sub in module.named_modules():
        if not isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)):
            continue
        if sub.sparse and sub.weight.requires_grad:
            raise ValueError(
                f"'{name}' ({type(sub).__name__}) has sparse=True: ZeRO partitions dense gradients only, so "
                "build it with sparse=False (the default; ddp gives it the same update) or freeze it."
            )
        if sub.max_norm is not None:
            raise ValueError(
                f"'{name}' ({type(sub).__name__}) has max_norm={sub.max_norm}: it renormalises its weight in place "
                "during forward, which ZeRO's partitioned optimizer state (stage 3: its partitioned weight) would "
                "overwrite, so build it without max_norm."
            )
