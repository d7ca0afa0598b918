"""Lightning callbacks the ZeRO engines cannot follow: refused when ``fit`` sets up, before any step.

[Note: callbacks that edit parameters or param groups mid-training]
The engines partition the optimizer's param groups once, at setup (zero/engine.py [Note: the optimizer
keeps the model's parameters]); stage 3 also releases the module's parameters between forwards. These
Lightning callbacks work behind that partition's back:

* ``BaseFinetuning`` (``BackboneFinetuning`` and user subclasses) unfreezes parameters and calls
  ``optimizer.add_param_group`` at some epoch. The engines would refuse the first step after it (the
  param groups changed), possibly hours into the run, so the callback is refused at once. Lightning's
  own ``ddp`` is no oracle here either: DDP registers only the parameters that require a gradient when
  it wraps the module, so a backbone unfrozen later is never all-reduced and the replicas part
  (measured, tests/callbacks). Lightning refuses the callback under DeepSpeed for the same reason.
* ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) read the module's
  parameters between steps or epochs (stage 3: released placeholders) and copy the averaged weights into
  them when training ends, behind the fp32 masters that checkpoints and ``full_state_dict`` read
  (measured, tests/callbacks: stages 1-2 trained like ddp but ended with the last weights instead of the
  average, 0.2 relative apart; stage 3 crashed). Lightning refuses SWA under FSDP and DeepSpeed.
* ``ModelPruning`` re-registers each pruned ``weight`` as ``weight_orig`` times a mask at an epoch's end
  (``torch.nn.utils.prune``) and rebinds the parameter's storage when it makes pruning permanent: stages
  1-2 trained differently from the first pruned epoch on and ended un-pruned (measured); stage 3 crashed.

Freezing a parameter by hand mid-training (``requires_grad_(False)`` in a hook) trains as under ddp
(it gets no gradient and is not stepped: unused.py); unfreezing one that was frozen at setup is refused
at that step by the engine (it has no partition).

[Note: a LightningModule compiled whole]
``trainer.fit(torch.compile(model))`` reaches the strategy as the LightningModule with its ``forward`` and
``*_step`` methods wrapped by dynamo (Lightning's ``from_compiled``), and Lightning then refuses every
strategy but single-device, ddp and fsdp with a line naming only those three. ZeRO compiles the network
itself, unit by unit, with its gathers and releases outside the compiled regions (zero/compile.py), so
the refusal here names that road instead: the uncompiled module and ``compile=True``, or the inner
network compiled inside the LightningModule, which every stage accepts.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

REFUSED: dict[str, str] = {
    "BaseFinetuning": (
        "{name} unfreezes parameters and adds optimizer param groups during training, but the ZeRO strategy "
        "partitions the param groups once, when fit starts (Lightning's ddp would not all-reduce the unfrozen "
        "parameters either). Train in two fits instead: one with the frozen parameters' requires_grad=False, "
        "then a new Trainer whose configure_optimizers lists every parameter."
    ),
    "WeightAveraging": (
        "{name} reads the module's parameters after every step and overwrites them when training ends, which the "
        "ZeRO strategy partitions (the fp32 masters that checkpoints read would keep the last weights): keep a "
        "torch.optim.swa_utils.AveragedModel yourself, or train with strategy='ddp'."
    ),
    "ModelPruning": (
        "{name} re-registers the pruned parameters (torch.nn.utils.prune) during training, after the ZeRO strategy "
        "partitioned them: prune before fit (and make it permanent), or train with strategy='ddp'."
    ),
    "StochasticWeightAveraging": (
        "{name} reads and overwrites the module's parameters outside the training step, which the ZeRO "
        "strategy partitions (as Lightning refuses it under FSDP and DeepSpeed): keep a "
        "torch.optim.swa_utils.AveragedModel yourself, or train with strategy='ddp'."
    ),
}
"""Lightning callback class (or base class) name -> why it is refused (``{name}``: the user's class)."""


def check_callbacks(callbacks: Iterable[Any]) -> None:
    """Raise a ValueError naming the first callback of ``callbacks`` the ZeRO engines cannot follow
    ([Note: callbacks that edit parameters or param groups mid-training])."""
    from lightning.pytorch import callbacks as lightning_callbacks

    # WeightAveraging is new in Lightning 2.6
    classes = {key: getattr(lightning_callbacks, key) for key in REFUSED if hasattr(lightning_callbacks, key)}
    for cb in callbacks:
        for key, cls in classes.items():
            if isinstance(cb, cls):
                raise ValueError(REFUSED[key].format(name=type(cb).__name__))


COMPILED_WHOLE = (
    "trainer.fit(torch.compile(model)) (or validate, test, predict): a LightningModule compiled whole is not "
    "accepted by the ZeRO strategy (nor by Lightning for strategies other than single-device, ddp and fsdp). "
    "ZeRO compiles the network itself, unit by unit, with its parameter gathers outside the compiled regions: "
    "pass the LightningModule uncompiled and set "
    "ZeroStrategy(compile=True) (Hydra: strategy.compile=true; torch.compile's arguments in compile_options), or "
    "compile the inner network inside the LightningModule (self.net = torch.compile(net)), which every stage accepts."
)
"""The refusal of [Note: a LightningModule compiled whole]."""


def check_not_compiled_whole(model: Any) -> None:
    """Raise a RuntimeError when ``model`` is a LightningModule Lightning unwrapped from ``torch.compile``
    ([Note: a LightningModule compiled whole])."""
    if getattr(model, "_compiler_ctx", None) is not None:
        raise RuntimeError(COMPILED_WHOLE)


class RefusesCompiledWhole:
    """Mixin of the Trainer strategy: its module slot refuses a LightningModule compiled whole.

    The Trainer sets ``strategy._lightning_module`` right after unwrapping ``torch.compile`` and before its own
    check, so the refusal here comes first, with our line ([Note: a LightningModule compiled whole])."""

    @property
    def _lightning_module(self) -> Optional[Any]:
        return self.__dict__.get("_lz_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, model: Optional[Any]) -> None:
        check_not_compiled_whole(model)
        self.__dict__["_lz_lightning_module"] = model
