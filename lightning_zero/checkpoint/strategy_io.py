"""ZeroStrategy's checkpoint hooks: Lightning's save/load/remove calls routed to the sharded format
(sharded.py) or the full one (zero/state_dict.py).

How Lightning drives them: ``Trainer.save_checkpoint`` calls ``lightning_module_state_dict`` and
``optimizer_state`` (through its checkpoint connector), then ``save_checkpoint``; ``ModelCheckpoint``
calls ``remove_checkpoint`` for checkpoints that fall out of the top-k; resuming calls
``load_checkpoint`` and later ``load_model_state_dict`` / ``load_optimizer_state_dict``. In the
sharded format the first two return markers (no gather), and the two loads read the pieces.

The strategy holds a :class:`StrategyCheckpoints` built from its :class:`~lightning_zero.engines.Engines`
(config, process groups, engines, the module they manage and its original dtypes) and from itself as a
:class:`CheckpointOwner` (its CheckpointIO, its optimizers, whether it is rank 0, its device), and
forwards Lightning's hooks to it; Fabric's hooks (fabric/checkpoint.py) use the same object.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol

import torch
from lightning.fabric.plugins import CheckpointIO
from torch import Tensor
from torch.optim import Optimizer

from lightning_zero.checkpoint import atomic, save_errors, tp_full
from lightning_zero.checkpoint import layout as L
from lightning_zero.checkpoint.experts import ExpertNames, refuse_full_format
from lightning_zero.checkpoint.sharded import (
    ShardedCheckpointer,
    ShardedOptimizerState,
    ShardedStateDict,
    all_host_state,
    read_meta,
)
from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed import protocol as compressed_comm
from lightning_zero.parallel.dtensor import local_tensor
from lightning_zero.zero import state_dict as zsd

if TYPE_CHECKING:
    from lightning_zero.engines import Engines
    from lightning_zero.pipeline.integration import PipelineIntegration

log = logging.getLogger(__name__)


def refuse_bypassed_io(plugin: Optional[CheckpointIO], checkpoint_format: str) -> None:
    """Refuse a CheckpointIO plugin of the user's (``Trainer(plugins=[...])``) that sharded checkpoints would bypass.

    Sharded checkpoints are written and read by the ranks themselves (sharded.py), not through a CheckpointIO, so
    a plugin that sends files elsewhere (object storage) or writes in the background (``AsyncCheckpointIO``) would
    silently not be used. Full checkpoints (``checkpoint_format='full'``) go through it; Lightning's default
    ``TorchCheckpointIO`` (what sharded writing replaces) is accepted either way."""
    from lightning.fabric.plugins import TorchCheckpointIO

    if plugin is None or type(plugin) is TorchCheckpointIO or checkpoint_format != "sharded":
        return
    raise ValueError(
        f"The checkpoint plugin {type(plugin).__name__} is not used by sharded checkpoints "
        "(checkpoint_format='sharded', the default: each rank writes its own shard directly). Use "
        "checkpoint_format='full' to write one file through it, or drop the plugin; for saves in the background "
        "use checkpoint_async=True."
    )


class CheckpointOwner(Protocol):
    """What the checkpoints need of the strategy that holds them (both front doors have these)."""

    @property
    def checkpoint_io(self) -> CheckpointIO: ...

    @property
    def optimizers(self) -> list[Optimizer]: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def root_device(self) -> torch.device: ...


class StrategyCheckpoints:
    """Checkpoint hooks of the ZeRO strategies (see the module docstring)."""

    def __init__(self, engines: "Engines", owner: CheckpointOwner) -> None:
        self.engines = engines
        self.owner = owner
        self.pipeline: Optional["PipelineIntegration"] = None
        """The Trainer's pipeline integration (pipeline_stages > 1): merges and splits per-stage states."""
        self._checkpointer: Optional[ShardedCheckpointer] = None

    # ------------------------------------------------------------------ set-up
    def setup_checkpointer(self) -> None:
        """Collective: a gloo group of every rank for checkpoint I/O (sharded.py)."""
        cfg = self.engines.config
        refuse_bypassed_io(getattr(self.owner, "_checkpoint_io", None), cfg.checkpoint_format)
        group = C.new_gloo_group(cfg.timeout_s) if C.is_initialized() and C.world_size() > 1 else None
        self._checkpointer = ShardedCheckpointer(group, cfg.checkpoint_threads, cfg.checkpoint_fsync, cfg.checkpoint_async)
        self.engines.step_fence = self._checkpointer.fence  # async saves reading the states in place (async_stage.py)

    def reserve_async_staging(self) -> None:
        """Async saves copy this rank's partitions into host memory: reserve it while training starts.
        Estimate: fp32 masters three times (weights and Adam's two moments), frozen partitions once."""
        if not self.engines.config.checkpoint_async:
            return
        total = 0
        for engine in self.engines:
            total += sum(3 * fg.master.numel() * fg.master.element_size() for fg in engine.groups)
            total += sum(fg.master.numel() * fg.master.element_size() for fg in engine.frozen_groups)
        module = self.engines.module
        assert module is not None
        total += sum(b.numel() * b.element_size() for b in module.buffers())
        total += self.engines.frozen_fp32.nbytes() if self.engines.frozen_fp32 is not None else 0
        self.checkpointer.reserve(int(total * 1.01) + 2**20, pin=self.owner.root_device.type == "cuda")

    @property
    def checkpointer(self) -> ShardedCheckpointer:
        if self._checkpointer is None:  # a single process never went through setup_environment's group
            self.setup_checkpointer()
        assert self._checkpointer is not None
        return self._checkpointer

    def sharded(self) -> bool:
        return self.engines.config.checkpoint_format == "sharded"

    def rank_view(self, optimizers: Optional[list[Optimizer]] = None) -> L.RankView:
        """What this rank holds; ``optimizers``: those a checkpoint covers, in its order (default: all)."""
        dims = self.engines.dims
        opts = list(self.owner.optimizers if optimizers is None else optimizers)
        engines = [self.engines.of(o) for o in opts]
        # engines of no listed optimizer still hold weights (an evaluation-only run's: inference/engine.py);
        # they come after the optimizers' (``engines[k]`` is optimizer k's)
        engines += [e for e in self.engines if not any(e is x for x in engines)]
        return L.RankView(
            module=self.engines.module,
            optimizers=opts,
            engines=engines,
            dp_rank=dims.dp_rank if dims is not None else 0,
            dp_size=dims.dp if dims is not None else 1,
            pp_rank=dims.pp_rank if dims is not None else 0,
            pp_size=dims.pp if dims is not None else 1,
            global_rank=C.rank(),
            orig_dtypes=dict(self.engines.orig_dtypes),
            experts=ExpertNames.of(self.engines.module),
            edp_rank=dims.edp_rank if dims is not None else 0,
            edp_size=dims.edp if dims is not None else 1,
            frozen=self.engines.frozen_fp32,
        )

    def host_state(self) -> Any:
        return all_host_state(list(self.engines))

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous checkpoint save has finished (raises its error, if any)."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def wait_or_abandon(self, timeout_s: float) -> None:
        """After a failure: an async save still writing gets a bounded wait (no collective, no new group)."""
        if self._checkpointer is not None:
            self._checkpointer.wait_or_abandon(timeout_s=timeout_s)

    # ------------------------------------------------------------------ save
    def _refuse_full_format(self, what: str) -> None:
        """The full format (one gathered state dict) is not built under expert parallelism (experts.py
        [Note: experts in sharded checkpoints]). Under tensor parallelism it is: tp_full.py."""
        refuse_full_format(self.engines.config.expert_parallel, what)

    def _tp_group(self) -> Optional[Any]:
        """The tensor-parallel group when DTensor parameters are split over tp (None otherwise)."""
        dims = self.engines.dims
        return dims.tp_group if dims is not None and dims.tp > 1 else None

    def full_state_dict(self) -> dict[str, Any]:
        """Full fp32 weights by name, loadable by the plain model: gathered onto every rank
        (collective: every rank must call it)."""
        self._refuse_full_format("A full state dict (checkpoint_format='full', full_state_dict())")
        module = self.engines.module
        assert module is not None
        masters: dict[int, Tensor] = {}
        for engine in self.engines:
            masters.update(zsd.full_master_params(engine))
        named = module.state_dict(keep_vars=True)  # keep_vars: past stage 3's guard (zero/released_guard.py)
        keyed = {k: masters[id(v)] for k, v in named.items() if id(v) in masters}
        out = {}
        for k, v in named.items():
            value = local_tensor(keyed.get(k, v))  # a DTensor's TP block: made full below (tp_full.py)
            want = self.engines.orig_dtypes.get(k)
            if torch.is_tensor(value) and value.numel() and value.untyped_storage().nbytes() == 0:
                raise RuntimeError(f"'{k}' is a released ZeRO-3 parameter that no engine holds a partition of.")
            if torch.is_tensor(value) and want is not None and value.dtype != want:
                value = value.to(want)
            out[k] = value.detach() if torch.is_tensor(value) else value
        out.update(self._frozen_full(named))
        if self._tp_group() is not None:
            out = tp_full.full_weights(out, named, self._tp_group())
        out = {k: v.cpu() if torch.is_tensor(v) else v for k, v in out.items()}
        pipeline = self.pipeline
        return pipeline.merge_state_dict(out) if pipeline is not None else out

    def _frozen_full(self, named: Mapping[str, Any]) -> dict[str, Tensor]:
        """The exact fp32 values of the frozen parameters frozen_fp32.py keeps (collective, in state-dict order)."""
        frozen = self.engines.frozen_fp32
        if not frozen:
            return {}
        done: dict[int, Tensor] = {}
        for k, v in named.items():
            if frozen.holds(v) and id(v) not in done:
                done[id(v)] = frozen.full(v, self.owner.root_device)
        return {k: done[id(v)] for k, v in named.items() if id(v) in done}

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded format: a marker (the pieces are written by ``save_checkpoint``, nothing is
        gathered); full format: :meth:`full_state_dict`."""
        if self.sharded():
            return ShardedStateDict()
        return self.full_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap LightningOptimizer
        if self.sharded():
            return ShardedOptimizerState([id(o) for o in self.owner.optimizers].index(id(optimizer)))
        return self.full_optimizer_state(optimizer)

    def full_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """torch's per-parameter format, gathered from the partitions (collective)."""
        self._refuse_full_format("A full optimizer state (checkpoint_format='full')")
        engine = self.engines.of(optimizer)
        if engine is None:
            return optimizer.state_dict()
        with engine.masters_in_optimizer():  # 1-bit optimizers index their state by the groups' tensors
            state = compressed_comm.add_comm_state(optimizer, zsd.gather_optimizer_state(engine))
        if self._tp_group() is not None:  # DTensor parameters' states are their TP blocks (tp_full.py)
            state = tp_full.full_optimizer_state(state, zsd.params_by_index(engine), self._tp_group())
        pipeline = self.pipeline
        return pipeline.gather_optimizer_state(state) if pipeline is not None else state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if not isinstance(checkpoint.get("state_dict"), ShardedStateDict):
            if storage_options is None and atomic.Path(filepath).is_dir():
                raise IsADirectoryError(f"{filepath} is a directory (a sharded checkpoint?); cannot write a full checkpoint file there.")
            self.refuse_nonfinite_full(checkpoint, filepath)
            self.write_full(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("storage_options is not supported by sharded checkpoints (checkpoint_format='sharded').")
        for engine in self.engines:  # zero/flat_group.py [Note: writes outside the optimizer]
            zsd.adopt_param_writes(engine)
        self.checkpointer.save(self.rank_view(), checkpoint, filepath, self.host_state, self.sharded_info(checkpoint))

    def write_full(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        """Rank 0 writes a full checkpoint file through the CheckpointIO; a local path goes through a hidden
        file renamed into place, so a failed write (a full disk) leaves the previous file as it was. The
        outcome is shared: every rank raises the same one-line error (save_errors.py)."""
        local = "://" not in str(filepath) and storage_options is None
        final = Path(filepath)
        outcome: Any = None  # (errno, strerror, free bytes) of a failed write, shared by rank 0
        if self.owner.is_global_zero:
            target = atomic.new_partial_name(final) if local else filepath
            free = save_errors.free_bytes(final.parent) if local else None
            try:
                self.owner.checkpoint_io.save_checkpoint(checkpoint, target, storage_options=storage_options)
                if local:
                    os.replace(target, final)
            except OSError as e:
                if local:
                    Path(target).unlink(missing_ok=True)
                outcome = (e.errno or 5, e.strerror or str(e), free)
        outcome = C.broadcast_object(outcome, 0, self.checkpointer.group)
        if outcome is not None:
            needed = sum(t.numel() * t.element_size() for t in save_errors.tensors_of(checkpoint).values())
            kept = save_errors.previous_checkpoint(final, None) if local else None
            raise save_errors.save_failed(final, OSError(outcome[0], outcome[1]), needed, outcome[2], kept) from None

    def refuse_nonfinite_full(self, checkpoint: Mapping[str, Any], filepath: Any) -> None:
        """Collective: a full checkpoint whose weights or optimizer states hold NaN or inf is refused on
        every rank, before rank 0 writes (save_errors.py)."""
        kept = {k: checkpoint.get(k) for k in ("state_dict", "optimizer_states", "model", "optimizer")}
        found = save_errors.first_nonfinite(save_errors.tensors_of({k: v for k, v in kept.items() if v is not None}))
        findings = C.all_gather_object(found, self.checkpointer.group)
        if any(f is not None for f in findings):
            final = Path(filepath)
            save_errors.refuse_nonfinite(findings, final, save_errors.previous_checkpoint(final, None))

    def sharded_info(self, checkpoint: Mapping[str, Any]) -> dict[str, Any]:
        """What ``meta.pt`` says about the run that wrote a sharded checkpoint."""
        cfg = self.engines.config
        dims = self.engines.dims
        return {
            "stage": cfg.stage,
            "world_size": C.world_size(),
            "dp": dims.dp if dims is not None else 1,
            "pp": dims.pp if dims is not None else 1,
            "tp": dims.tp if dims is not None else 1,
            "ep": dims.ep if dims is not None else 1,
            "offload_optimizer": cfg.offload_optimizer,
            "offload_params": cfg.offload_params,
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
        }

    def remove_checkpoint(self, filepath: Any) -> None:
        """Delete a checkpoint completely, file or directory (rank 0), after a pending async save."""
        self.checkpointer.remove(filepath)

    # ------------------------------------------------------------------ load
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A sharded directory: its ``meta.pt`` (Lightning's entries) with markers for the weights and
        optimizer states, read later piece by piece; a file: the usual ``torch.load``."""
        path = Path(checkpoint_path)
        if atomic.is_sharded_checkpoint(path):
            meta = read_meta(path)
            ckpt = dict(meta["lightning"])
            ckpt["state_dict"] = ShardedStateDict(str(path))
            info = meta["lightning_zero"]
            if info.get("front_end") == "fabric":  # fabric/checkpoint.py [Note: one format, two front doors]
                ckpt.setdefault("pytorch-lightning_version", info.get("lightning_version", "2.0.0"))
                ckpt.setdefault("lr_schedulers", [])
            if info.get("has_optimizer_states"):
                ckpt["optimizer_states"] = [ShardedOptimizerState(k, str(path)) for k in range(len(info["optimizers"]))]
            return ckpt
        if path.is_dir():
            raise FileNotFoundError(
                f"{path} is a directory but not a complete lightning_zero sharded checkpoint (it lacks .metadata or "
                f"{atomic.META_FILE}: an interrupted save, or another library's format)."
            )
        torch.cuda.empty_cache()
        return self.owner.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=weights_only)

    def refresh_from_masters(self) -> None:
        for engine in self.engines:
            engine.after_master_load()

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        self.engines.rounded_start = []  # the masters are the checkpoint's now (engines.py rounded_params)
        self.wait_for_checkpoint()  # a pending async save may still read the masters in place (async_stage.py)
        sd = checkpoint["state_dict"]
        if isinstance(sd, ShardedStateDict):
            assert sd.path is not None
            self.checkpointer.load_weights(self.rank_view(), sd.path, strict, self.pipeline is not None,
                                           self.host_state, self.refresh_from_masters)
            return
        self.load_full_weights(sd, strict)

    def load_full_weights(self, sd: Mapping[str, Any], strict: bool) -> None:
        """A full state dict into the module and the engines' masters (stage 3: the masters only)."""
        self._refuse_full_format("Loading a full checkpoint file")
        module = self.engines.module
        assert module is not None
        if self._tp_group() is not None:  # each rank loads its TP blocks (tp_full.py)
            sd = tp_full.local_weights(sd, module.state_dict(keep_vars=True))
        sharded = {id(p) for e in self.engines for p in e.sharded_params()}
        if sharded:  # stage 3: sharded parameters go to the masters only (their storage is released)
            names = {k for k, v in module.state_dict(keep_vars=True).items() if id(v) in sharded}
            missing = [k for k in names if k not in sd]
            if strict and missing:
                raise KeyError(f"Checkpoint lacks parameters {missing[:5]}{'...' if len(missing) > 5 else ''}")
            result = module.load_state_dict({k: v for k, v in sd.items() if k not in names}, strict=False)
            if strict and [k for k in result.missing_keys if k not in names] + list(result.unexpected_keys):
                raise KeyError(f"State dict mismatch: {result}")
        else:
            module.load_state_dict(sd, strict=strict)
        frozen = self.engines.frozen_fp32
        for k, v in module.state_dict(keep_vars=True).items():
            if frozen is not None and frozen.holds(v) and k in sd:  # frozen_fp32.py: the exact values too
                frozen.set_full(v, sd[k])
        if not len(self.engines):
            return
        values = {}
        for k, v in module.state_dict(keep_vars=True).items():
            if k in sd:
                values[id(v)] = local_tensor(sd[k]).to(torch.float32)  # stays on the host: shards are sliced out of it
        for engine in self.engines:
            zsd.load_master_params(engine, values)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self.wait_for_checkpoint()
        saved = checkpoint["optimizer_states"]
        if saved and isinstance(saved[0], ShardedOptimizerState):
            assert saved[0].path is not None
            self.checkpointer.load_optimizers(self.rank_view(), saved[0].path, self.host_state)
            return
        for opt, state in zip(self.owner.optimizers, saved):
            self.load_full_optimizer_state(opt, state)

    def load_full_optimizer_state(self, opt: Optimizer, state: dict[str, Any]) -> None:
        """torch's per-parameter format into the partitions this rank holds."""
        self._refuse_full_format("Loading a full checkpoint file's optimizer state")
        pipeline = self.pipeline
        if pipeline is not None:  # this stage's entry (pipeline/checkpoint.py)
            state = pipeline.local_optimizer_state(state)
        engine = self.engines.of(opt)
        if engine is None:
            opt.load_state_dict(state)
        else:
            if self._tp_group() is not None:  # each rank loads its TP blocks (tp_full.py)
                state = tp_full.local_optimizer_state(state, zsd.params_by_index(engine))
            zsd.load_optimizer_state(engine, state)
            with engine.masters_in_optimizer():
                compressed_comm.restore_comm_state(opt, state)
