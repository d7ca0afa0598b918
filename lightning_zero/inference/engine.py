"""ZeRO-Inference: stage 3 for a run that only evaluates (``predict``, ``validate``, ``test`` without ``fit``).

[Note: an engine without an optimizer]
Under stage 3 a run that never fits has no optimizer, and Lightning does not call
``configure_optimizers`` for it (strategy.py passes no optimizers outside ``fit``). Building no engine
would leave every rank with the whole model (what happened before this file existed): correct outputs,
but none of stage 3's memory. :class:`InferenceEngine` is the stage-3 engine with every parameter in
its frozen partitions (stage3.py [Note: frozen parameters]): one shard per rank in the compute dtype,
gathered unit by unit before each unit's forward and released after it, prefetched in the recorded
order; no fp32 master, no gradient buffer, no optimizer state exists. A meta-built model is
materialised unit by unit, as for training. The engine's optimizer is a placeholder with no param
groups (:class:`NoOptimizer`) whose ``step`` refuses.

[Note: streamed weights]
With ``offload_params='cpu'`` (``zero3_offload``) each rank's shard lives in pinned host memory and a
unit's chunk is copied to the device right before its all-gather (offload/params.py's
``stage_to_device``, asynchronous from pinned memory), so prefetching a unit prefetches its upload and
the device holds only the gathered working set: the root unit (embeddings, head, final norm) and the
``prefetch_units`` units ahead. With 'nvme' (``zero3_offload_nvme``) each chunk is a swap file read
ahead through offload/params.py's ``NvmeParamStore`` ring. The optimizer offload setting means nothing
here (there is no optimizer). Training engines learn their prefetch order from the first backward;
this one records it in the first evaluation step's forwards (``records_order_without_grad``) and
freezes it when that step ends.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Generator, Optional

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as C
from lightning_zero.config import InferenceConfig, OffloadConfig, Stage3Config
from lightning_zero.offload.nvme import NvmeSwapper, SwapDir
from lightning_zero.offload.params import NvmeParamStore, copy_done, ring_depth, stage_to_device
from lightning_zero.offload.pinned import HostPool, can_pin
from lightning_zero.parallel.dtensor import local_tensor, point_local
from lightning_zero.zero.stage3 import Stage3Engine


class NoOptimizer(torch.optim.Optimizer):
    """The placeholder optimizer of an :class:`InferenceEngine`: no param groups, no state, no step."""

    zero_elementwise = True

    def __init__(self) -> None:  # torch.optim.Optimizer.__init__ refuses an empty parameter list
        self.defaults: dict[str, Any] = {}
        self.state: defaultdict = defaultdict(dict)
        self.param_groups: list[dict[str, Any]] = []

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        raise RuntimeError("This ZeRO-3 engine was built for evaluation only (no optimizer): call trainer.fit "
                           "to train; it builds the optimizer's engines then.")


class InferenceEngine(Stage3Engine):
    """Stage 3 over frozen partitions only ([Note: an engine without an optimizer]); the shards on the
    device, in pinned host memory or in NVMe swap files ([Note: streamed weights])."""

    records_order_without_grad = True
    single_rank_shortcuts = True

    def __init__(self, module: nn.Module, dp_group: Optional[C.ProcessGroup], compute_dtype: torch.dtype,
                 device: torch.device, *, stage3: Stage3Config, offload: OffloadConfig, global_rank: int,
                 param_group: Optional[C.ProcessGroup] = None, materialize: Optional[Callable] = None,
                 param_names: Optional[dict[int, str]] = None, tp_group: Optional[C.ProcessGroup] = None) -> None:
        self.params_where = offload.offload_params
        """'none' (the device), 'cpu' (pinned host memory) or 'nvme' (swap files under ``nvme_path``)."""
        self._pin = can_pin(device, offload.pin_memory)
        self.host = HostPool(pin=self._pin)
        weakref.finalize(self, self.host.release)
        self._swapper: Optional[NvmeSwapper] = None
        self._param_store: Optional[NvmeParamStore] = None
        if self.params_where != "none":
            self.single_rank_shortcuts = False  # the partitions live in host memory (sharded_group.py)
        if self.params_where == "nvme":
            swap_dir = SwapDir(Path(str(offload.nvme_path)).expanduser(), global_rank)
            self._swapper = NvmeSwapper(swap_dir, offload.nvme_io_threads)
            self._finalizer = weakref.finalize(self, self._swapper.close)  # files removed with the engine
        frozen = [p for p in module.parameters() if p.is_floating_point()]
        super().__init__(NoOptimizer(), dp_group, compute_dtype, device, 1, param_names=param_names,
                         tp_group=tp_group, module=module, param_group=param_group, stage3=stage3,
                         materialize=materialize, frozen_params=frozen)
        if self._swapper is not None:
            per_unit = max((len(u.buckets) for u in self.units), default=1)
            for fg in self.frozen_groups:
                fg.shard16 = fg.master  # the store swaps the gather source; here it is the partition itself
            self._param_store = NvmeParamStore(self._swapper, self.frozen_groups, self._pin,
                                               ring_depth(per_unit, self.prefetch_units))
            self._param_store.swap_out()

    # ---------------------------------------------------------------- where the partitions live
    def _frozen_group_kwargs(self, dtype: torch.dtype) -> dict[str, object]:
        kwargs = super()._frozen_group_kwargs(dtype)
        if self.params_where == "cpu":
            kwargs["master_factory"] = self.host.zeros  # pinned (on a GPU machine), its own pages
        elif self.params_where == "nvme":
            kwargs["master_factory"] = lambda n, dt: torch.zeros(n, dtype=dt)  # swapped out once built
        return kwargs

    def _gather_source(self, gi: int, bi: int) -> Tensor:
        if self.params_where == "none":
            return super()._gather_source(gi, bi)
        offset = len(self.groups)  # frozen groups follow the (here: no) trainable ones
        if self._param_store is None:
            return stage_to_device(super()._gather_source(gi, bi), self.device)
        out = stage_to_device(self._param_store.host_chunk(gi - offset, bi), self.device)
        self._param_store.release(gi - offset, bi, done=copy_done(self.device))
        return out

    def _prefetch(self, upcoming: Any) -> None:
        upcoming = list(upcoming)
        if self._param_store is not None and upcoming:  # read the files of these units ahead
            keys = [(gi - len(self.groups), bi) for idx in upcoming if idx not in self._gathered
                    for gi, bi in self.units[idx].buckets]
            self._param_store.prefetch(keys)
        super()._prefetch(upcoming)

    @contextmanager
    def host_state(self) -> Generator[None, None, None]:
        """NVMe: the partitions resident in host memory inside the block (checkpoint loads, unshard)."""
        with ExitStack() as stack:
            if self._param_store is not None:
                stack.enter_context(self._param_store.host_state())
            yield

    @contextmanager
    def gathered_params(self, module: Any = None, writeback: bool = False) -> Generator[None, None, None]:
        with self.host_state(), super().gathered_params(module, writeback):
            yield

    # ---------------------------------------------------------------- step boundaries
    def end_eval_step(self) -> None:
        super().end_eval_step()
        if self.order and not self._order_frozen:  # the first step's forwards are the order to prefetch by
            self._order_frozen = True
            self._last_pos = {u: i for i, u in enumerate(self.order)}

    def unshard_to_plain(self) -> None:
        """A ``fit`` after evaluation: every parameter gets its full storage back, on the device."""
        with self.host_state():
            super().unshard_to_plain()
        for fg in self.all_groups:
            for p in fg.params:
                if local_tensor(p).device != torch.device(self.device):
                    point_local(p, local_tensor(p).to(self.device))

    def teardown(self) -> None:
        """NVMe: the swap files stay for a later evaluation or ``fit``; they are removed with the engine (when
        a ``fit`` replaces it, or at exit) or by :meth:`abandon` after a failure."""

    def abandon(self) -> None:
        super().abandon()
        self.close()

    def close(self) -> None:
        """Swap files removed, I/O threads stopped (NVMe)."""
        if self._swapper is not None:
            self._finalizer()
            self._swapper = None
            self._param_store = None

    def swap_dir(self) -> Optional[str]:
        return str(self._swapper.dir.path) if self._swapper is not None else None


def build_inference_engine(engines: Any, module: nn.Module, *, device: torch.device, compute_dtype: torch.dtype,
                           global_rank: int) -> bool:
    """Fill ``engines`` (engines.py) with one :class:`InferenceEngine` when stage 3 evaluates a module no
    ``fit`` has set up; False (nothing built) where it does not apply: another stage,
    ``inference_partitions=False``, a pipeline (its stages hold their own layers), expert parallelism
    (frozen expert partitions are not built), or a module without floating-point parameters."""
    from lightning_zero.zero.materialize import make_unit_materializer

    config, dims = engines.config, engines.dims
    if config.stage != 3 or len(engines) or dims is None or dims.pp > 1 or dims.ep > 1:
        return False
    if not config.piece(InferenceConfig).inference_partitions:  # every rank materialises the whole model
        return False
    if not any(p.is_floating_point() for p in module.parameters()):
        return False
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    engine = InferenceEngine(
        module, dims.dp_group, compute_dtype, device, stage3=config.piece(Stage3Config),
        offload=config.piece(OffloadConfig), global_rank=global_rank, param_group=dims.dp_param_group,
        materialize=make_unit_materializer(module, device, getattr(module, "zero_init_module", None)),
        param_names=names, tp_group=dims.tp_group if dims.tp > 1 else None,
    )
    engines.by_optimizer = {id(engine.optimizer): engine}
    return True
