"""Checkpoints under expert parallelism: refused until they are built (issue #20, item 3).

Why refused: the formats of this package key a parameter's pieces by name and data-parallel rank, but
with ``expert_parallel`` > 1 the ranks of an expert-parallel group hold *different* experts under the
same local names (moe/layer.py [Note: expert parameters]): a save would keep one rank's experts under
every name and a load would hand them to every rank, a silently different model. Until experts are
stored by global index (moe/parallel.py [Note: expert state by global index]), every checkpoint entry
point of both front doors fails here, before any file is written or read.

A mixin placed first in the strategies' bases (so it wraps whatever the checkpoint mixins do), and
kept in its own file beside them: the checkpoint formats change independently of it.
"""

from __future__ import annotations

from typing import Any


def refuse_expert_checkpoints(expert_parallel: int) -> None:
    if expert_parallel > 1:
        raise NotImplementedError(
            f"Checkpoints with expert_parallel={expert_parallel} are not built yet (experts stored by global index, "
            "to resume at another EP size, is issue #20's next part): disable checkpointing "
            "(Trainer(enable_checkpointing=False), no save/load) or train with expert_parallel=1.")


class ExpertCheckpointGuard:
    """Refuses every checkpoint save/load of the Trainer's and Fabric's strategy under expert parallelism."""

    def _refuse_experts(self) -> None:
        refuse_expert_checkpoints(self.config.expert_parallel)  # type: ignore[attr-defined]

    # Trainer
    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().save_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().load_checkpoint(*args, **kwargs)  # type: ignore[misc]

    def lightning_module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().lightning_module_state_dict(*args, **kwargs)  # type: ignore[misc]

    def optimizer_state(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().optimizer_state(*args, **kwargs)  # type: ignore[misc]

    def load_model_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().load_model_state_dict(*args, **kwargs)  # type: ignore[misc]

    def load_optimizer_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().load_optimizer_state_dict(*args, **kwargs)  # type: ignore[misc]

    # Fabric
    def get_module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().get_module_state_dict(*args, **kwargs)  # type: ignore[misc]

    def get_optimizer_state(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().get_optimizer_state(*args, **kwargs)  # type: ignore[misc]

    def load_module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_experts()
        return super().load_module_state_dict(*args, **kwargs)  # type: ignore[misc]
