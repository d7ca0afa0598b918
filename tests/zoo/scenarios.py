"""Scenario ``zoo.train`` (tests/helpers/harness.py): trains one zoo model under several strategies in one
process group.

Params: ``{"model": MODEL, "specs": [SPEC, ...]}`` with MODEL a key of ``tests.zoo.models.MODELS`` and SPEC
one of those :func:`make_strategy` knows. For each spec in turn (everything seeded identically first) rank 0
records ``SPEC`` (``OUT/<spec>.rank0.pt``) as soon as that run is over, holding:

* ``losses`` (rank 0; the GAN: ``g_losses`` and ``d_losses``) and ``weights``: the final full state
  dict (ddp: ``model.state_dict()``; ZeRO: ``strategy.full_state_dict()``, collective);
* ``per_rank``: each rank's losses, validation losses, buffers and memory figures (all_gather_object);
* ``param_bytes`` / ``frozen_bytes``: the whole model's parameter bytes as ddp holds them;
* ``moved``: each trainable tensor's relative change over the run (rank 0);
* ``zero_gradient_names``: tensors whose true gradient is zero (see ``GAN.zero_gradient_names``);
* ``error``: None, or each rank's traceback when a run failed (the next spec still runs, as long as
  both ranks can meet at a barrier afterwards; if they cannot, the worker exits).

Memory is counted from tensor storage (tests/helpers/memory.py), see :class:`ZooProbe`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Optional

import torch

warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

import lightning_zero  # noqa: E402
from tests.helpers.memory import storage_bytes  # noqa: E402
from tests.helpers.harness import barrier_or_exit, ScenarioContext, scenario  # noqa: E402
from tests.zoo.models import STEPS, ZooModule, build, describe  # noqa: E402

COLLECTIVE_TIMEOUT_S = 90
"""A run whose ranks stop meeting in collectives fails after this long instead of hanging CI."""

FIND_UNUSED = {"gan"}
"""Models that ddp itself cannot train without ``find_unused_parameters=True`` (toggle_optimizer
freezes the other network, so the discriminator gets no gradient in the generator's backward)."""

OPTIMIZER_STEPS_PER_BATCH = {"gan": 2}
"""Manual optimization counts each ``optimizer.step()`` as a global step: two per GAN batch."""


def make_strategy(model_name: str, spec: str) -> Any:
    kind = spec.removesuffix("_again")
    timeout = {"timeout_s": float(COLLECTIVE_TIMEOUT_S)}
    if kind == "ddp":
        return DDPStrategy(
            find_unused_parameters=model_name in FIND_UNUSED, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        )
    if kind in ("zero1", "zero2"):
        return lightning_zero.ZeroStrategy(stage=int(kind[-1]), bucket_size_mb=0.002, **timeout)
    # Tiny models: with the default persistence threshold (100k parameters) every block would stay
    # gathered and the stage-3 memory claim would be vacuous. 0 partitions every unit.
    if kind == "zero3":
        return lightning_zero.ZeroStrategy(stage=3, param_persistence_threshold=0, **timeout)
    if kind == "zero2_offload":  # the masters in host memory, stepped by the CPU step
        return lightning_zero.ZeroStrategy(stage=2, offload_optimizer="cpu", bucket_size_mb=0.002, **timeout)
    if kind == "zero2_partial":  # half of each optimizer partition on the host, half stepped on the "device"
        return lightning_zero.ZeroStrategy(stage=2, offload_optimizer="cpu", offload_ratio=0.5, bucket_size_mb=0.002,
                                           **timeout)
    if kind == "zero3_offload":
        return lightning_zero.ZeroStrategy(
            stage=3, offload_optimizer="cpu", offload_params="cpu", param_persistence_threshold=0, **timeout
        )
    # activation offload: every block checkpointed, recomputed in backward (a batch norm must not fold its
    # statistics in twice, an HF layer must not take its keys into the cache twice: activations/recompute.py)
    if kind == "zero2_act":
        return lightning_zero.ZeroStrategy(stage=2, bucket_size_mb=0.002, activation_offload=True, **timeout)
    if kind == "zero3_act":
        return lightning_zero.ZeroStrategy(stage=3, param_persistence_threshold=0, activation_offload=True,
                                           activation_offload_device_fraction=0.5, **timeout)
    raise ValueError(f"unknown spec {spec!r}")


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _engine_shards(trainer: pl.Trainer, **kwargs: Any) -> list[torch.Tensor]:
    """This rank's parameter partitions (``engine.param_shards()``, being added to the engines; on an
    engine without it the figure counts the model's parameters only and the tests fail on the numbers)."""
    out: list[torch.Tensor] = []
    for engine in getattr(trainer.strategy, "engines", []):
        fn = getattr(engine, "param_shards", None)
        if fn is None:
            continue
        try:
            out += [t for t in fn(**kwargs) if t is not None]
        except TypeError:  # no `trainable` keyword yet
            continue
    return out


class ZooProbe(pl.Callback):
    """Parameter bytes on this rank, from tensor storage (each storage once, released ZeRO-3
    parameters count 0; partitions that are views of counted storage are not counted twice):

    * ``block_fwd_bytes``: max over training forwards of every watched block of (all model parameters
      + the engines' parameter shards), measured when the block's forward starts (after the engine's
      own pre-hook gathered it) and when it ends (before any other post-hook can release it);
    * ``frozen_bytes``: max over steps, after each training step, of (frozen parameters + the
      engines' frozen shards).
    """

    def __init__(self) -> None:
        self.block_fwd_bytes = 0
        self.frozen_bytes = 0
        self.block_calls = 0
        self._handles: list = []
        self._trainer: Optional[pl.Trainer] = None
        self._module: Optional[ZooModule] = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: ZooModule) -> None:  # after strategy.setup
        self._trainer, self._module = trainer, pl_module
        for block in pl_module.zoo_blocks():
            self._handles.append(block.register_forward_pre_hook(lambda m, a: self._measure()))
            self._handles.append(block.register_forward_hook(lambda m, a, o: self._measure(), prepend=True))

    def _measure(self) -> None:
        module, trainer = self._module, self._trainer
        if module is None or trainer is None or not module.training or not torch.is_grad_enabled() or _in_backward():
            return
        self.block_calls += 1
        held = storage_bytes(list(module.parameters()) + _engine_shards(trainer))
        self.block_fwd_bytes = max(self.block_fwd_bytes, held)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: ZooModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        frozen = [p for p in pl_module.parameters() if not p.requires_grad]
        if frozen:
            self.frozen_bytes = max(self.frozen_bytes, storage_bytes(frozen + _engine_shards(trainer, trainable=False)))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: ZooModule) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def make_trainer(model_name: str, spec: str, model: ZooModule, probe: ZooProbe) -> pl.Trainer:
    has_val = type(model).validation_step is not pl.LightningModule.validation_step
    return pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=make_strategy(model_name, spec),
        precision="32-true",
        max_steps=STEPS * OPTIMIZER_STEPS_PER_BATCH.get(model_name, 1),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2 if has_val else 0,
        val_check_interval=getattr(model, "VAL_EVERY", None) if has_val else None,
        gradient_clip_val=getattr(model, "GRADIENT_CLIP_VAL", None),
        accumulate_grad_batches=getattr(model, "ACCUMULATE", 1),
        use_distributed_sampler=False,
        callbacks=[probe],
    )


def _barrier_or_exit() -> None:
    """After a failed run: continue only once every rank got here (tests/helpers/harness.py)."""
    barrier_or_exit("zoo", 2 * COLLECTIVE_TIMEOUT_S + 30)  # long enough for a rank blocked in a collective to time out first


def run(ctx: ScenarioContext, model_name: str, spec: str) -> None:
    pl.seed_everything(0, workers=True)
    model = build(model_name)
    sizes = describe(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    probe = ZooProbe()
    error: Optional[str] = None
    weights: dict[str, torch.Tensor] = {}
    started = time.perf_counter()
    trainer = None
    try:
        trainer = make_trainer(model_name, spec, model, probe)
        trainer.fit(model)
        if spec.startswith("ddp"):
            weights = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        else:
            weights = trainer.strategy.full_state_dict()  # collective: every rank
    except Exception:  # noqa: BLE001 - recorded and reported by the tests
        error = traceback.format_exc()
        print(f"[zoo rank {dist.get_rank()}] {model_name}/{spec} failed:\n{error}", file=sys.stderr)
        _barrier_or_exit()
    seconds = time.perf_counter() - started
    mine = {
        "error": error,
        "losses": list(model.losses),
        "g_losses": list(getattr(model, "g_losses", [])),
        "d_losses": list(getattr(model, "d_losses", [])),
        "val_losses": list(model.val_losses),
        "buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()},
        "block_fwd_bytes": probe.block_fwd_bytes,
        "block_calls": probe.block_calls,
        "frozen_bytes": probe.frozen_bytes,
        "seconds": seconds,
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() == 0:
        errors = [r["error"] for r in gathered]
        result = {
            "model": model_name,
            "spec": spec,
            "error": None if not any(errors) else "\n".join(f"rank {i}: {e}" for i, e in enumerate(errors) if e),
            "losses": mine["losses"],
            "g_losses": mine["g_losses"],
            "d_losses": mine["d_losses"],
            "weights": weights,
            "per_rank": gathered,
            "moved": {  # how far training took each trainable tensor from its initial value
                n: float((weights[n].double() - w0.double()).norm() / w0.double().norm().clamp_min(1e-12))
                for n, w0 in initial.items() if n in weights
            },
            "zero_gradient_names": list(getattr(model, "zero_gradient_names", list)()),
            **sizes,
        }
        ctx.record(spec, result)
    del trainer


@scenario("zoo.train")
def train(ctx: ScenarioContext) -> None:
    for spec in ctx.params["specs"]:
        run(ctx, ctx.params["model"], spec)
