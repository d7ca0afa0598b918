"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` on the checkpoint formats of checkpoint/.

[Note: one format, two front doors]
A Fabric state is a dict of named objects (``{"model": model, "optimizer": opt, "step": 3}``); a
Trainer checkpoint is Lightning's dict (``state_dict``, ``optimizer_states``, loops, ...). Under
``checkpoint_format="sharded"`` both are written by the same ShardedCheckpointer: the set-up model
becomes the ``state_dict.*`` pieces, the optimizers in the state (in its order) the
``optimizer_states.<k>.*`` pieces, and everything else goes to ``meta.pt`` as it is (``state_dict()``
of other stateful objects). ``meta.pt`` also records which Fabric keys held the model and the
optimizers, so ``fabric.load`` puts them back under their names, whatever world size, stage or
offload setting wrote them. The Trainer resumes such a directory with ``fit(ckpt_path=...)``
(strategy_io.py adds the version entry Lightning requires): weights, optimizer states (Adam's step
counts included) and the other entries come back; loop counters, which a Fabric loop keeps itself,
start at zero, and a LightningModule's ``on_load_checkpoint`` sees the Fabric entries. Under
``checkpoint_format="full"`` rank 0 writes one ``torch.save`` file with the full weights and torch's
per-parameter optimizer states (gathered), as Fabric's ``ddp`` would.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning
from lightning.fabric.strategies.strategy import _apply_filter, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch.nn import Module
from torch.optim import Optimizer

from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint.consolidate import load_consolidated
from lightning_zero.checkpoint.sharded import ShardedOptimizerState, ShardedStateDict, read_meta
from lightning_zero.checkpoint.strategy_io import StrategyCheckpoints

RESERVED = ("state_dict", "optimizer_states")
"""Keys of the sharded format's markers: not usable as names in a Fabric state."""


class FabricCheckpoints:
    """Fabric's checkpoint hooks of ZeroFabricStrategy (see the Note), on the strategy's
    :class:`StrategyCheckpoints` (whose hooks have the Trainer's signatures). ``convert``: Fabric's
    ``Strategy._convert_stateful_objects_in_state`` (the state's objects as state dicts, filtered)."""

    def __init__(self, core: StrategyCheckpoints, convert: Callable[..., dict[str, Any]]) -> None:
        self.core = core
        self._convert = convert

    # ------------------------------------------------------------------ what a state holds
    def _roles(self, state: dict[str, Any]) -> tuple[Optional[str], list[str]]:
        """The key of the set-up model (None: not in the state) and the keys of set-up optimizers."""
        module = self.core.engines.module
        mine = {id(o) for o in self.core.owner.optimizers}
        module_keys = [k for k, v in state.items() if module is not None and v is module]
        if len(module_keys) > 1:
            raise ValueError(f"The model appears under several keys of the state: {module_keys}.")
        opt_keys = [k for k, v in state.items() if isinstance(v, Optimizer) and id(v) in mine]
        return (module_keys[0] if module_keys else None), opt_keys

    # ------------------------------------------------------------------ save
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """Full fp32 weights (gathered: collective)."""
        if module is not self.core.engines.module:
            return module.state_dict()
        return self.core.full_state_dict()

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """torch's per-parameter format, gathered from the partitions (collective)."""
        return self.core.full_optimizer_state(optimizer)

    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Union[Module, Optimizer, Any]],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        if not self.core.sharded():
            if storage_options is None and atomic.Path(path).is_dir():
                raise IsADirectoryError(f"{path} is a directory (a sharded checkpoint?); cannot write a full checkpoint file there.")
            converted = self._convert(state, filter=filter or {})
            module_key, opt_keys = self._roles(state)
            self.core.refuse_nonfinite_full(
                {"model": converted.get(module_key) if module_key is not None else None, "optimizer": [converted[k] for k in opt_keys]}, path)
            self.core.write_full(converted, path, storage_options)
            return
        module_key, opt_keys = self._roles(state)
        if filter and any(k in filter for k in [module_key, *opt_keys] if k is not None):
            raise ValueError(
                "fabric.save(filter=...) on the model or its optimizers needs checkpoint_format='full': a sharded "
                "checkpoint writes every partition of them."
            )
        if storage_options is not None:
            raise TypeError("storage_options is not supported by sharded checkpoints (checkpoint_format='sharded').")
        clash = [k for k in RESERVED if k in state]
        if clash:
            raise ValueError(f"Keys {clash} are reserved by the sharded checkpoint format; rename them in the state.")
        rest = {k: v for k, v in state.items() if k != module_key and k not in opt_keys}
        checkpoint: dict[str, Any] = {}
        for key, obj in rest.items():
            value = obj.state_dict() if isinstance(obj, (_Stateful, Module, Optimizer)) else obj
            _apply_filter(key, filter or {}, value, checkpoint)
        checkpoint["state_dict"] = ShardedStateDict()
        optimizers = [o for k in opt_keys if isinstance(o := state[k], Optimizer)]  # all of them (_roles)
        if optimizers:
            checkpoint["optimizer_states"] = [ShardedOptimizerState(i) for i in range(len(optimizers))]
        info = self.core.sharded_info(checkpoint)
        info.update(front_end="fabric", fabric_keys={"module": module_key, "optimizers": opt_keys},
                    lightning_version=lightning.__version__)
        self.core.checkpointer.save(self.core.rank_view(optimizers), checkpoint, path, self.core.host_state, info)

    # ------------------------------------------------------------------ load
    def load_checkpoint(
        self,
        path: _PATH,
        state: Optional[Union[Module, Optimizer, dict[str, Union[Module, Optimizer, Any]]]] = None,
        strict: bool = True,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        if atomic.is_sharded_checkpoint(Path(path)):
            return self._load_sharded(Path(path), state, strict)
        if Path(path).is_dir():
            raise FileNotFoundError(
                f"{path} is a directory but not a complete lightning_zero sharded checkpoint (it lacks .metadata or "
                f"{atomic.META_FILE}: an interrupted save, or another library's format)."
            )
        checkpoint = self.core.owner.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if not state:
            return checkpoint
        if isinstance(state, Module):  # fabric.load_raw: a state dict, or a consolidated checkpoint's
            self.load_module_state_dict(state, _raw_weights(checkpoint, state), strict)
            return {}
        if isinstance(state, Optimizer):
            self.core.load_full_optimizer_state(state, checkpoint)
            return {}
        _validate_keys_for_strict_loading(state.keys(), checkpoint.keys(), strict=strict)
        for name, obj in list(state.items()):
            if name not in checkpoint:
                continue
            if isinstance(obj, Module):
                self.load_module_state_dict(obj, checkpoint.pop(name), strict)
            elif isinstance(obj, Optimizer):
                self.core.load_full_optimizer_state(obj, checkpoint.pop(name))
            elif isinstance(obj, _Stateful):
                obj.load_state_dict(checkpoint.pop(name))
            else:
                state[name] = checkpoint.pop(name)
        return checkpoint

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        if module is not self.core.engines.module:
            module.load_state_dict(state_dict, strict=strict)
            return
        self.core.load_full_weights(state_dict, strict)

    def _load_sharded(self, path: Path, state: Any, strict: bool) -> dict[str, Any]:
        meta = read_meta(path)
        info = meta["lightning_zero"]
        saved = dict(meta["lightning"])
        keys = info.get("fabric_keys") or {"module": None, "optimizers": []}
        if not state:  # the whole checkpoint, consolidated in host memory, under the Fabric names
            full = load_consolidated(path)
            weights, opt_states = full.pop("state_dict", {}), full.pop("optimizer_states", [])
            full[keys["module"] or "state_dict"] = weights
            names = keys["optimizers"] or [f"optimizer_{i}" for i in range(len(opt_states))]
            full.update(zip(names, opt_states))
            return full
        if isinstance(state, Module):
            state = {keys["module"] or "model": state}
        elif isinstance(state, Optimizer):
            state = {(keys["optimizers"] or ["optimizer"])[0]: state}
        module_key, opt_keys = self._roles(state)
        known = set(saved) | {k for k in [keys["module"], *keys["optimizers"]] if k}
        if keys["module"] is None and module_key is not None:
            known.add(module_key)  # a Trainer checkpoint: its weights are the model's
        if not keys["optimizers"]:
            known |= set(opt_keys[: len(info.get("optimizers", []))])
        _validate_keys_for_strict_loading(state.keys(), known, strict=strict)
        view_optimizers = opt_keys
        if keys["optimizers"] and set(opt_keys) == set(keys["optimizers"]):
            view_optimizers = list(keys["optimizers"])  # the order they were saved in
        if module_key is not None:
            self.core.checkpointer.load_weights(
                self.core.rank_view(), str(path), strict, False, self.core.host_state, self.core.refresh_from_masters
            )
        if view_optimizers:
            self.core.checkpointer.load_optimizers(
                self.core.rank_view([state[k] for k in view_optimizers]), str(path), self.core.host_state
            )
        for name, obj in list(state.items()):
            if name == module_key or name in opt_keys or name not in saved:
                continue
            if isinstance(obj, (_Stateful, Module, Optimizer)):
                obj.load_state_dict(saved.pop(name))
            else:
                state[name] = saved.pop(name)
        return saved


def _raw_weights(checkpoint: dict[str, Any], module: Module) -> dict[str, Any]:
    """A raw state dict as is; a consolidated lightning_zero (or Lightning) checkpoint's ``state_dict``."""
    inner = checkpoint.get("state_dict")
    if isinstance(inner, dict) and "state_dict" not in module.state_dict(keep_vars=True):  # names only
        return inner
    return checkpoint
