"""The example GPT's LightningModule: :class:`GPTModule` trains :class:`gpt.GPT` (or its pipeline form,
``gpt_pipeline.py``) with AdamW/Adam/SGD/1-bit optimizers and a warm-up + cosine LR schedule.

What a ZeRO strategy meets here beyond the network: two parameter groups with different weight decay,
an LR scheduler stepped every step, a network built in ``configure_model`` (ZeRO-3's sharded
initialisation, with :meth:`GPTModule.zero_init_module` as its per-module initialiser), tensor
parallelism applied there, and checkpoints that load into either form of the network.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

import lightning.pytorch as L
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_zero import ZeroStrategy
from lightning_zero.callbacks import ProgressiveLayerDrop
from lightning_zero.logging import MoEMetrics
from lightning_zero.moe import aux_loss
from lightning_zero.parallel import parallelize, tp_plan_gpt
from lightning_zero.pipeline import PipelineModule

if __package__:  # imported as examples.gpt_module: [Note: one example, two import roots] (gpt.py)
    from .gpt import GPT, INIT_STD, Block, GPTConfig, flops_per_token, lm_loss
    from .gpt_pipeline import convert_gpt_state_dict, gpt_pipeline
else:  # examples/ on sys.path (examples/train.py)
    from gpt import GPT, INIT_STD, Block, GPTConfig, flops_per_token, lm_loss
    from gpt_pipeline import convert_gpt_state_dict, gpt_pipeline


@dataclass
class OptimConfig:
    """Optimizer and LR schedule of :class:`GPTModule`; ``conf/optimizer/*.yaml`` are presets of it."""

    name: str = "adamw"
    """One of 'adamw', 'adam', 'sgd', 'onebit_adam', 'onebit_lamb' (the 1-bit ones need strategy=zero0)."""
    lr: float = 1e-3
    """Peak learning rate, reached at the end of warm-up."""
    weight_decay: float = 0.1
    """Applied to Linear weights only; biases, LayerNorm weights and embeddings get none."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam/AdamW moment decay rates."""
    eps: float = 1e-8
    """Adam/AdamW denominator epsilon."""
    momentum: float = 0.9
    """SGD momentum."""
    fused: Optional[bool] = None
    """Ask torch for its fused Adam/AdamW kernel; None keeps torch's default."""
    warmup_steps: int = 20
    """Linear warm-up from 0 to lr over this many optimizer steps."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at lr * min_lr_ratio at max_steps."""
    freeze_fraction: float = 0.15
    """1-bit optimizers: the exact warm-up (variance still adapting) lasts this fraction of max_steps."""


OPTIMIZERS = ("adamw", "adam", "sgd", "onebit_adam", "onebit_lamb")


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak LR: linear warm-up, then cosine decay to min_lr_ratio, flat afterwards."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """Next-token cross-entropy training of the GPT, with AdamW/Adam/SGD and warm-up + cosine LR.

    ``self.model`` is the plain :class:`GPT` (default), or with ``pipeline=True`` :func:`gpt_pipeline`
    (a PipelineModule, needed by pipeline stages). The steps work with either, whichever
    ``_build_model`` (or a subclass's ``configure_model``) put there. The plain form has an
    ``example_input_array`` (one sequence of token ids), so Lightning's model summary measures its
    FLOPs and shapes. ``max_steps`` is the horizon of the cosine schedule; None takes the
    trainer's estimate at ``configure_optimizers`` time. The module exposes ``flops_per_token`` for
    :class:`lightning_zero.logging.ZeroMetrics`.
    """

    def __init__(
        self,
        model: Union[GPTConfig, Mapping[str, Any]],
        lr: float = OptimConfig.lr,
        weight_decay: float = OptimConfig.weight_decay,
        betas: tuple[float, float] = OptimConfig.betas,
        warmup_steps: int = OptimConfig.warmup_steps,
        max_steps: Optional[int] = None,
        optimizer: str = OptimConfig.name,
        eps: float = OptimConfig.eps,
        momentum: float = OptimConfig.momentum,
        fused: Optional[bool] = OptimConfig.fused,
        min_lr_ratio: float = OptimConfig.min_lr_ratio,
        pipeline: bool = False,
        freeze_fraction: float = OptimConfig.freeze_fraction,
        expert_parallel: int = 1,
        deferred: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"Unknown optimizer {optimizer!r}; valid choices are {list(OPTIMIZERS)}.")
        self.config = model if isinstance(model, GPTConfig) else GPTConfig(**dict(model))
        self.optim = OptimConfig(
            name=optimizer, lr=lr, weight_decay=weight_decay, betas=(float(betas[0]), float(betas[1])), eps=eps,
            momentum=momentum, fused=fused, warmup_steps=warmup_steps, min_lr_ratio=min_lr_ratio,
            freeze_fraction=freeze_fraction,
        )
        self.max_steps = max_steps
        self.use_pipeline = bool(pipeline)
        self.expert_parallel = int(expert_parallel)
        """The MoE layers' ep_size: the strategy's ``expert_parallel`` (examples/train.py passes it)."""
        # Plain containers only (exactly this constructor's arguments), so load_from_checkpoint can rebuild
        # the module and TensorBoard can show them.
        optim = asdict(self.optim)
        self.save_hyperparameters(
            {"model": asdict(self.config), "max_steps": max_steps, "optimizer": optim.pop("name"), **optim,
             "pipeline": self.use_pipeline, "expert_parallel": self.expert_parallel}
        )
        self.flops_per_token = flops_per_token(self.config)
        if self.config.pld and self.use_pipeline:
            raise ValueError("model.pld needs the plain GPT (its block loop drops layers); pipeline stages run a fixed layer list.")
        if self.config.moe_experts and self.use_pipeline:
            raise ValueError("model.moe_experts with pipeline stages is not built yet.")
        self.deferred = bool(deferred) and not self.use_pipeline
        """Build the plain GPT in ``configure_model`` (examples/train.py): inside the strategy's context, so
        ZeRO-3 creates it on the meta device and materialises only this rank's partition, and ddp/zero0-2
        build it on the device directly. Not a hyper-parameter: ``load_from_checkpoint`` builds eagerly.
        The pipeline form is always built here (its layers are created lazily, per stage, anyway)."""
        self.model = None if self.deferred else self._build_model()
        if self.config.compile and self.model is not None:
            self.compile_network()

    def compile_network(self) -> None:
        """``model.compile=true``: torch.compile every transformer :class:`Block` on its own (``.compile()``,
        parameter names unchanged), PyTorch's "regional compilation": the 24 blocks of GPT-1.3B share one
        graph, compiled in a fraction of the whole network's time, and the same code runs compiled under
        every strategy (ddp, FSDP's per-block units, ZeRO-3's units with their gathers outside the
        compiled regions, pipeline stages). The embeddings, final norm and head stay eager. The pipeline
        form's layers exist once the strategy placed them: it is compiled at fit start. Idempotent."""
        if self.model is None:
            return
        options = {"mode": self.config.compile_mode} if self.config.compile_mode else {}
        for module in self.model.modules():
            if isinstance(module, Block) and module._compiled_call_impl is None:
                module.compile(**options)

    @override
    def on_fit_start(self) -> None:
        if self.config.compile:
            self.compile_network()  # the pipeline form's layers are built by now

    @override
    def configure_callbacks(self) -> list[L.Callback]:
        """``model.moe_experts > 0``: MoEMetrics (aux loss, tokens per expert, dropped fraction to the loggers);
        ``model.pld=true``: Progressive Layer Dropping on the configured schedule."""
        callbacks: list[L.Callback] = [MoEMetrics()] if self.config.moe_experts else []
        if self.config.pld:
            callbacks.append(ProgressiveLayerDrop(theta=self.config.pld_theta, gamma=self.config.pld_gamma))
        return callbacks

    @property  # type: ignore[override]
    def example_input_array(self) -> Optional[Tensor]:
        """What Lightning's model summary runs through ``forward`` on every rank before training, to
        measure FLOPs and shapes: one sequence of token ids for the plain :class:`GPT` (so the summary
        does not report 0 FLOPs). None, and the FLOPs column stays unmeasured (Lightning prints 0),
        where a model call outside the step methods cannot run: the pipeline form (its forward is the
        schedule between stages) and ZeRO-3's partitioned parameters (gathered only inside steps;
        gathering the whole model here could exceed a rank's memory). A value set explicitly wins."""
        if self._example_input_array is not None:
            return self._example_input_array
        if not isinstance(getattr(self, "model", None), GPT) or self._params_partitioned():
            return None
        return torch.zeros((1, self.config.seq_len), dtype=torch.long)

    @example_input_array.setter
    def example_input_array(self, example: Optional[Tensor]) -> None:
        self._example_input_array = example

    def _params_partitioned(self) -> bool:
        """Whether the trainer's strategy releases parameters between steps (ZeRO stage 3)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        return isinstance(strategy, ZeroStrategy) and strategy.config.stage == 3

    def zero_init_module(self, module: nn.Module) -> None:
        """GPT-2 initialisation of one module, for ZeRO-3's sharded construction.

        ZeRO-3 materialises a ``configure_model``-built network one unit at a time and calls this hook
        for each module it materialises (after the module's own ``reset_parameters``), so the result
        matches :meth:`GPT.reset_parameters` (or, in a PipelineModule, the layers' own initialisation:
        every :class:`Block`'s residual projections scaled) without the whole model ever existing on
        one rank.
        """
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return
        std = INIT_STD
        if id(module) in self._residual_projections():
            std /= math.sqrt(2 * self.config.n_layer)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def _residual_projections(self) -> set[int]:
        """ids of every block's residual projections, in whichever form ``self.model`` has."""
        model = getattr(self, "model", None)
        if model is None:
            return set()
        return {id(p) for m in model.modules() if isinstance(m, Block) for p in m.residual_projections()}

    @override
    def configure_model(self) -> None:
        """``strategy.tensor_parallel > 1``: each block's MLP split over ``self.device_mesh["tp"]`` with
        the ready plan (:func:`lightning_zero.parallel.tp_plan_gpt`), as under Lightning's
        ModelParallelStrategy; ZeRO then partitions each rank's TP shard over the data-parallel ranks.
        The pipeline form holds only this stage's layers by now; its blocks get the same split over the tp
        ranks of the stage (lightning_zero/parallel/stage.py). With ``deferred=True`` the network itself is
        built here first. Idempotent (Lightning calls it again for validate/test)."""
        if self.model is None:
            self.model = self._build_model()
            if self.config.compile:
                self.compile_network()
        mesh = self.device_mesh
        if mesh is None or "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
            return
        if not any(isinstance(p, DTensor) for p in self.model.parameters()):
            parallelize(self.model, mesh["tp"], tp_plan_gpt(self.model, mesh["tp"]))

    def _build_model(self) -> Union[PipelineModule, GPT]:
        """The one place the network is constructed.

        Subclasses may return None here and build it in ``configure_model`` instead (ZeRO-3's sharded
        initialisation, see ``benchmarks/peers_worker.py``). A PipelineModule builds its layers lazily,
        on first use: built in ``configure_model``, call its ``materialize()`` there, so that the layers
        are created inside the strategy's sharded context.
        """
        return gpt_pipeline(self.config) if self.use_pipeline else GPT(self.config, ep_size=self.expert_parallel)

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Token ids -> logits (under pipeline stages: computed by the last stage, returned on every rank)."""
        if isinstance(self.model, PipelineModule):
            return self.model.predict(idx)
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        if isinstance(self.model, PipelineModule):
            # Under pipeline stages this runs the whole schedule (backward included when training) and
            # returns the mean loss over micro-batches on every rank.
            return self.model((x, y))
        loss = lm_loss(self(x), y)
        if self.config.moe_experts and self.training:  # the load-balancing loss of this forward's MoE layers
            loss = loss + aux_loss(self.model)
        return loss

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Checkpoints of either form load into either (keys renamed by :func:`convert_gpt_state_dict`).
        A sharded checkpoint's ``state_dict`` is an empty marker (the strategy reads the pieces by
        name): left alone, so resuming it needs the form it was saved in; ``load_from_checkpoint``
        consolidates it first and converts as usual."""
        state = checkpoint.get("state_dict")
        model = getattr(self, "model", None)
        if isinstance(state, Mapping) and len(state) and model is not None:
            to_pipeline = isinstance(model, PipelineModule)
            checkpoint["state_dict"] = convert_gpt_state_dict(state, self.config, to_pipeline=to_pipeline)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        # Rank-local loss: sync_dist here would add a collective to every step.
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def param_groups(self) -> list[dict[str, Any]]:
        """Two groups: decay for Linear weights; none for biases, LayerNorm weights and embeddings."""
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        seen: set[int] = set()
        for module in self.model.modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                (decay if isinstance(module, nn.Linear) and name == "weight" else no_decay).append(param)
        return [
            {"params": decay, "weight_decay": self.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @override
    def configure_optimizers(self) -> Any:
        o = self.optim
        groups = self.param_groups()
        optimizer: torch.optim.Optimizer
        max_steps = self.max_steps if self.max_steps is not None and self.max_steps > 0 else None
        if max_steps is None:
            max_steps = int(self.trainer.estimated_stepping_batches)
        if o.name in ("onebit_adam", "onebit_lamb"):
            from lightning_zero.optim import OneBitAdam, OneBitLamb

            freeze = max(1, int(o.freeze_fraction * max_steps))
            cls = OneBitAdam if o.name == "onebit_adam" else OneBitLamb
            optimizer = cls(groups, lr=o.lr, freeze_step=freeze, betas=o.betas, eps=o.eps)
        elif o.name == "adamw":
            optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)
        elif o.name == "adam":
            optimizer = torch.optim.Adam(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=o.fused)
        else:
            optimizer = torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
        horizon, warmup, floor = max_steps, o.warmup_steps, o.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, warmup, horizon, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


__all__ = ["GPTModule", "OptimConfig", "OPTIMIZERS", "lr_lambda"]
