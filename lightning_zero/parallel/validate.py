"""Checks that turn a wrong tensor-parallel setup into one clear error before training.

torch's ``parallelize_module`` only warns about a plan key that names no module, and a model left
unparallelized under ``tensor_parallel > 1`` would train tp identical replicas of the full model on
ranks that share one batch: both fail here instead, naming the fix.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Mapping

from torch import nn
from torch.distributed.tensor import DTensor


def check_plan(module: nn.Module, plan: Mapping[str, object]) -> None:
    """Every key of ``plan`` (a module name; ``*`` matches one name atom, as in ``parallelize_module``)
    must name at least one submodule of ``module``."""
    names = [n for n, _ in module.named_modules() if n]
    missing = []
    for key in plan:
        atoms = key.split(".")
        if not any(len(n.split(".")) == len(atoms) and fnmatchcase(n, key) for n in names):
            missing.append(key)
    if missing:
        sample = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(
            f"The tensor-parallel plan names module(s) that do not exist in {type(module).__name__}: {missing}. "
            f"Plan keys are module names as module.named_modules() gives them (e.g. {sample})."
        )


def check_tensor_parallel(module: nn.Module, tp: int) -> None:
    """Under ``tensor_parallel=tp`` the module must have been parallelized over the mesh's ``tp`` dim."""
    dparams = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor)]
    if not dparams:
        raise ValueError(
            f"tensor_parallel={tp} but the module has no tensor-parallel (DTensor) parameters: apply a plan in "
            "configure_model, e.g. parallelize_module(self, self.device_mesh['tp'], "
            "lightning_zero.parallel.tp_plan_llama(self.model, self.device_mesh['tp'])), before the strategy sets up. "
            "Under pipeline stages every stage must hold tensor-parallel layers: parallelize the layers this stage "
            "holds (lightning_zero.parallel.stage_plan) and split the layers so that each stage has some."
        )
    for name, p in dparams:
        mesh = p.device_mesh
        if mesh.ndim != 1 or mesh.size() != tp or (mesh.mesh_dim_names or ("tp",)) != ("tp",):
            raise ValueError(
                f"Parameter '{name}' is a DTensor on {mesh}, not on the strategy's tensor-parallel mesh "
                f"(self.device_mesh['tp'], size {tp}): ZeRO partitions the data-parallel dim itself; pass "
                "self.device_mesh['tp'] to parallelize_module."
            )
