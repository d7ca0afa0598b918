"""Expert parallelism refused or checked before training (one process): bad degrees, layers built for
another EP size, unbound layers, what is not built yet; and the global-index naming of expert state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.experts import ExpertNames, refuse_full_format
from lightning_zero.config import ZeroConfig
from lightning_zero.moe import MoE
from lightning_zero.moe.parallel import bind_expert_parallel, globalize_expert_state, localize_expert_state
from lightning_zero.parallel_dims import ParallelDims
from lightning_zero.zero.shard_comm import ShardComm, place_param_groups
from tests.moe.reference import MLP

H = 6


@pytest.mark.parametrize("kwargs, match", [
    ({"expert_parallel": 0}, "integer >= 1"),
    ({"expert_parallel": True}, "integer >= 1"),
    ({"expert_parallel": 2, "tensor_parallel": 2}, "tensor_parallel=2 is not built yet"),
    ({"expert_parallel": 2, "pipeline_stages": 2, "stage": 1}, "pipeline_stages=2 is not built yet"),
    ({"expert_parallel": 2, "offload_optimizer": "cpu"}, "offload"),
])
def test_config_refuses(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


def test_strategy_takes_the_option() -> None:
    assert ZeroStrategy(stage=3, expert_parallel=2).config.expert_parallel == 2


def test_ep_must_divide_the_data_parallel_degree() -> None:
    with pytest.raises(ValueError, match="expert_parallel=4 does not divide the data-parallel degree 6"):
        ParallelDims(6, 0, ep=4)
    dims = ParallelDims(8, 5, ep=2)
    assert (dims.edp, dims.edp_rank, dims.ep_rank) == (4, 2, 1)


def test_layer_needs_its_group_or_fails_clearly() -> None:
    layer = MoE(H, lambda: MLP(H), num_experts=4, ep_size=2)
    assert layer.num_local_experts == 2 and not layer.ep_bound
    with pytest.raises(RuntimeError, match="ZeroStrategy\\(expert_parallel=2\\)"):
        layer(torch.randn(3, H))
    with pytest.raises(ValueError, match="must be divisible"):
        MoE(H, lambda: MLP(H), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="expert-parallel group has 1 ranks"):
        layer.set_ep_group(None)


def test_bind_checks_the_layers_against_the_strategy() -> None:
    with pytest.raises(ValueError, match="has no lightning_zero.moe.MoE layer"):
        bind_expert_parallel(nn.Linear(2, 2), 2, None)
    model = nn.Sequential(nn.Linear(H, H), MoE(H, lambda: MLP(H), num_experts=4))
    with pytest.raises(ValueError, match="'1' was built with ep_size=1 but the strategy has expert_parallel=2"):
        bind_expert_parallel(model, 2, None)
    assert bind_expert_parallel(model, 1, None) == [model[1]]


def test_full_checkpoint_format_refused_under_expert_parallelism() -> None:
    refuse_full_format(1, "A full state dict")
    with pytest.raises(NotImplementedError, match="A full state dict with expert_parallel=2 is not built yet: use "
                       "checkpoint_format='sharded'"):
        refuse_full_format(2, "A full state dict")


def test_checkpoint_names_are_the_single_process_ones() -> None:
    """checkpoint/experts.py [Note: experts in sharded checkpoints]: a rank's names by global index, and
    every EP rank's names listed from one rank's, in the single-process model's state-dict order."""
    full = nn.Sequential(nn.Linear(H, H), MoE(H, lambda: MLP(H), num_experts=4), nn.Linear(H, H))
    assert ExpertNames.of(full) is None  # nothing to rename
    part = nn.Sequential(nn.Linear(H, H), MoE(H, lambda: MLP(H), num_experts=4, ep_size=2), nn.Linear(H, H))
    part[1].ep_rank = 1
    names = ExpertNames.of(part)
    assert names is not None
    stored = [names.stored(k) for k in part.state_dict()]
    assert [k for k in stored if ".experts." in k] == [k for k in full.state_dict() if ".experts.2." in k or ".experts.3." in k]
    assert names.stored("0.weight") == "0.weight" and not names.is_expert("1.gate.weight")
    expanded = list(names.expand(stored))
    assert [n for n, _, _ in expanded] == list(full.state_dict())
    assert {(n.split(".")[2], mine.split(".")[2], r) for n, mine, r in expanded if r is not None} == {
        ("0", "2", 0), ("1", "3", 0), ("2", "2", 1), ("3", "3", 1)}
    assert names.on_rank("1.experts.3.fc.weight", 0) == "1.experts.1.fc.weight"


def test_param_groups_split_into_dense_and_expert_flat_groups() -> None:
    layer = MoE(H, lambda: MLP(H), num_experts=2)
    dense, expert = ShardComm(None, None, 4, 0), ShardComm(None, None, 2, 0)
    gate, experts = [layer.gate.weight], list(layer.experts.parameters())
    placed = place_param_groups([gate + experts[:2], experts[2:]], dense, expert)
    assert [(pi, c.size, len(ps)) for pi, c, ps in placed] == [(0, 4, 1), (1, 4, 0), (0, 2, 2), (1, 2, len(experts) - 2)]
    assert [(pi, c.size) for pi, c, _ in place_param_groups([gate + experts], dense, None)] == [(0, 4)]


def test_expert_state_round_trip_by_global_index() -> None:
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(H, H), MoE(H, lambda: MLP(H), num_experts=4))
    state = full.state_dict()
    merged = {}
    for rank in range(2):
        part = nn.Sequential(nn.Linear(H, H), MoE(H, lambda: MLP(H), num_experts=4, ep_size=2))
        part[1].ep_rank = rank  # as set_ep_group does on EP rank `rank`
        part[1]._mark_experts()
        part.load_state_dict(localize_expert_state(state, part))
        assert {p.lz_expert_index for p in part[1].experts.parameters()} == {2 * rank, 2 * rank + 1}
        merged.update(globalize_expert_state(part.state_dict(), part))
    assert merged.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(merged[k], v), k
