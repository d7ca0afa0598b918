"""Expert parallelism (lightning_zero/moe/dispatch.py) on 2 gloo processes against a single process.

E=4 experts, ``ep_group`` = both ranks, each rank holding 2 experts and routing its own tokens (a
different number per rank, so the all-to-all splits are uneven). Without token dropping the layer is a
per-token function, so the oracle is one single-process MoE holding all 4 experts (same weights) run
on the union of both ranks' tokens: per-token outputs, the gradients of every expert parameter (on the
rank that holds it) and the sum over ranks of the gate's gradient must agree within 1e-5 (fp32). With
dropping the capacity is per rank, as in DeepSpeed, so there the oracle runs the single-process layer
on each rank's tokens separately. A skewed gate that sends every token to rank 0's experts checks the
edge of a rank that receives nothing (its experts still run, on zero rows, and get zero gradients).

The fixed-capacity dispatch (``dispatch="capacity"``, moe/capacity.py) is checked in the same launch against
the sorted one on the same weights and tokens (equal token counts per rank, as it requires): outputs, token
gradients and every parameter gradient within 1e-6, with top-1 and top-2 and with and without drops.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.comm import collectives as C
from lightning_zero.moe import MoE
from tests.helpers.launch import free_port
from tests.moe.reference import MLP

WORLD, H, E = 2, 6, 4
TOKENS = ((2, 3), (2, 5))  # [batch, seq] of rank 0 and rank 1
CASES = {  # name: (top_k, drop_tokens, capacity_factor, skewed gate)
    "top1": (1, False, 1.0, False),
    "top2": (2, False, 1.0, False),
    "top1_drop": (1, True, 0.5, False),
    "top2_drop": (2, True, 0.5, False),
    "top1_skewed": (1, False, 1.0, True),
}


CAPACITY_TOKENS = (3, 4)  # [batch, seq] on both ranks: the fixed-capacity exchange needs equal token counts
CAPACITY_CASES = {  # name: (top_k, capacity_factor)
    "cap_top1_drop": (1, 0.5), "cap_top2_drop": (2, 0.5), "cap_top1_roomy": (1, 2.0), "cap_top2": (2, 1.25),
}


def _layer(top_k: int, drop: bool, factor: float, ep_group=None, dispatch: str = "sorted") -> MoE:
    return MoE(H, lambda: MLP(H), num_experts=E, top_k=top_k, capacity_factor=factor, eval_capacity_factor=factor,
               min_capacity=1, drop_tokens=drop, aux_loss_coef=1.0, ep_group=ep_group, dispatch=dispatch)


def _inputs() -> dict:
    torch.manual_seed(11)
    cases = {}
    for name, (top_k, drop, factor, skewed) in CASES.items():
        layer = _layer(top_k, drop, factor)
        xs = [torch.randn(*shape, H) for shape in TOKENS]
        if skewed:  # positive tokens, experts 2 and 3 (rank 1's) strongly disfavoured
            xs = [x.abs() for x in xs]
            with torch.no_grad():
                layer.gate.weight[2:] = -5.0
        probes = [torch.randn(*shape, H) for shape in TOKENS]
        cases[name] = dict(state=layer.state_dict(), xs=xs, probes=probes)
    for name, (top_k, factor) in CAPACITY_CASES.items():
        layer = _layer(top_k, True, factor)
        cases[name] = dict(state=layer.state_dict(), xs=[torch.randn(*CAPACITY_TOKENS, H) for _ in range(WORLD)],
                           probes=[torch.randn(*CAPACITY_TOKENS, H) for _ in range(WORLD)])
    return cases


def _load_local(layer: MoE, state: dict) -> None:
    """``state`` (all E experts, global names) -> ``layer``'s local experts."""
    local = {k: v for k, v in state.items() if not k.startswith("experts.")}
    for j in range(layer.num_local_experts):
        prefix = f"experts.{layer.global_expert_index(j)}."
        local.update({f"experts.{j}." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    layer.load_state_dict(local)


def _host_reads(rank: int, group, case: dict, dispatch: str) -> int:
    """``Tensor.tolist`` / ``item`` calls in one expert-parallel forward + backward (dispatch.py [Note: one
    host read per layer]: the sent and received counts are read together)."""
    layer = _layer(2, True, 1.25, ep_group=group, dispatch=dispatch)
    calls = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def counting(original):
        def counted(t, *args, **kwargs):
            calls[0] += 1
            return original(t, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    try:
        layer(case["xs"][rank]).sum().backward()
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    return calls[0]


def _capacity_vs_sorted(rank: int, group, case: dict, top_k: int, factor: float) -> dict:
    """The same tokens through the sorted and the fixed-capacity dispatch: outputs and gradients of each."""
    got = {}
    for dispatch in ("sorted", "capacity"):
        layer = _layer(top_k, True, factor, ep_group=group, dispatch=dispatch)
        _load_local(layer, case["state"])
        x = case["xs"][rank].clone().requires_grad_()
        out = layer(x)
        (out * case["probes"][rank]).sum().backward()
        got[dispatch] = dict(out=out.detach(), x_grad=x.grad, dropped=float(layer.last_stats.dropped_fraction),
                             grads={n: p.grad.clone() for n, p in layer.named_parameters()})
    return got


def _worker(rank: int, port: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(100 + rank)  # expert initialisation differs per rank; the weights are loaded below
    inputs = torch.load(Path(tmp) / "inputs.pt")
    group = C.new_group(range(WORLD))
    results: dict = {}
    for name, (top_k, drop, factor, _) in CASES.items():
        case = inputs[name]
        layer = _layer(top_k, drop, factor, ep_group=group)
        _load_local(layer, case["state"])
        x = case["xs"][rank].clone().requires_grad_()
        out = layer(x)
        (out * case["probes"][rank]).sum().backward()
        results[name] = dict(
            out=out.detach(), x_grad=x.grad,
            expert_grads={layer.global_expert_index(j): {n: p.grad.clone() for n, p in e.named_parameters()}
                          for j, e in enumerate(layer.experts)},
            gate_grad=layer.gate.weight.grad.clone(), aux=layer.aux_loss.detach(),
            dropped=float(layer.last_stats.dropped_fraction), counts=layer.last_stats.expert_counts.tolist(),
            local=layer.num_local_experts,
        )
    for name, (top_k, factor) in CAPACITY_CASES.items():
        results[name] = _capacity_vs_sorted(rank, group, inputs[name], top_k, factor)
    results["host_reads"] = {dispatch: _host_reads(rank, group, inputs["cap_top2"], dispatch)
                             for dispatch in ("sorted", "capacity")}
    try:
        MoE(H, lambda: MLP(H), num_experts=3, ep_group=group)
        results["bad_ep"] = None
    except ValueError as err:
        results["bad_ep"] = str(err)
    # the collective itself, uneven and with an empty split: rank r sends r + 1 rows to rank 0, none to 1
    send = torch.full((rank + 1, 2), float(rank))
    recv = torch.empty((3 if rank == 0 else 0, 2))
    C.all_to_all_single(recv, send, [1, 2] if rank == 0 else [0, 0], [rank + 1, 0], group)
    results["a2a"] = recv
    C.barrier()
    dist.destroy_process_group()
    torch.save(results, Path(tmp) / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    tmp = tmp_path_factory.mktemp("moe_ep")
    inputs = _inputs()
    torch.save(inputs, tmp / "inputs.pt")
    mp.spawn(_worker, args=(free_port(), str(tmp)), nprocs=WORLD, join=True)
    return inputs, [torch.load(tmp / f"rank{r}.pt") for r in range(WORLD)]


def _reference(name: str, case: dict) -> tuple[list[torch.Tensor], MoE, list[dict]]:
    """Outputs per rank, the single-process layer holding the (accumulated) gradients and, with
    dropping, each rank's routing statistics from the layer alone on that rank's tokens."""
    top_k, drop, factor, _ = CASES[name]
    layer = _layer(top_k, drop, factor)
    layer.load_state_dict(case["state"])
    if not drop:  # one pass over the union of the ranks' tokens
        flat = torch.cat([x.reshape(-1, H) for x in case["xs"]])
        out = layer(flat)
        (out * torch.cat([p.reshape(-1, H) for p in case["probes"]])).sum().backward()
        sizes = [x.shape[0] * x.shape[1] for x in case["xs"]]
        outs = [o.detach().view(x.shape) for o, x in zip(torch.split(out, sizes), case["xs"])]
        return outs, layer, []
    outs, per_rank = [], []  # per-rank capacity: the layer on each rank's tokens, gradients accumulated
    for x, probe in zip(case["xs"], case["probes"]):
        out = layer(x)
        (out * probe).sum().backward()
        outs.append(out.detach())
        per_rank.append(dict(stats=layer.last_stats, aux=layer.aux_loss.detach()))
    return outs, layer, per_rank


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_single_process(run: tuple[dict, list[dict]], name: str) -> None:
    inputs, ranks = run
    outs, ref, per_rank = _reference(name, inputs[name])
    ref_experts = dict(ref.experts.named_parameters())
    seen = set()
    for rank, res in enumerate(ranks):
        got = res[name]
        assert got["local"] == E // WORLD
        torch.testing.assert_close(got["out"], outs[rank], rtol=1e-5, atol=1e-5)
        for index, grads in got["expert_grads"].items():
            seen.add(index)
            for pname, grad in grads.items():
                torch.testing.assert_close(grad, ref_experts[f"{index}.{pname}"].grad, rtol=1e-5, atol=1e-5,
                                           msg=f"rank {rank} expert {index} {pname}")
        if per_rank:  # dropping: per-rank statistics equal those of the layer alone on the same tokens
            alone = per_rank[rank]
            assert got["dropped"] == float(alone["stats"].dropped_fraction) and got["dropped"] > 0
            assert got["counts"] == alone["stats"].expert_counts.tolist()
            torch.testing.assert_close(got["aux"], alone["aux"])
    assert seen == set(range(E))
    torch.testing.assert_close(ranks[0][name]["gate_grad"] + ranks[1][name]["gate_grad"], ref.gate.weight.grad,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CAPACITY_CASES))
def test_fixed_capacity_dispatch_equals_sorted_dispatch(run: tuple[dict, list[dict]], name: str) -> None:
    drops = []
    for rank, res in enumerate(run[1]):
        sorted_, capacity = res[name]["sorted"], res[name]["capacity"]
        torch.testing.assert_close(capacity["out"], sorted_["out"], rtol=0, atol=1e-6)
        torch.testing.assert_close(capacity["x_grad"], sorted_["x_grad"], rtol=0, atol=1e-6)
        assert capacity["grads"].keys() == sorted_["grads"].keys()
        for pname, grad in sorted_["grads"].items():
            torch.testing.assert_close(capacity["grads"][pname], grad, rtol=0, atol=1e-6, msg=f"rank {rank} {pname}")
        assert capacity["dropped"] == sorted_["dropped"]
        drops.append(sorted_["dropped"])
    if name.endswith("_drop"):  # half the balanced load: both paths must agree on a real drop
        assert max(drops) > 0
    if name.endswith("_roomy"):  # and where nothing is dropped, unfilled slots only
        assert max(drops) == 0


def test_one_host_read_per_layer_under_expert_parallelism(run: tuple[dict, list[dict]]) -> None:
    for res in run[1]:
        assert res["host_reads"] == {"sorted": 1, "capacity": 0}


def test_skewed_routing_leaves_rank1_idle_with_zero_gradients(run: tuple[dict, list[dict]]) -> None:
    _, ranks = run
    for res in ranks:
        assert res["top1_skewed"]["counts"][2:] == [0, 0]
    for grads in ranks[1]["top1_skewed"]["expert_grads"].values():
        assert all(not g.any() for g in grads.values())


def test_experts_not_divisible_by_ep_size_fail_clearly(run: tuple[dict, list[dict]]) -> None:
    for res in run[1]:
        assert res["bad_ep"] is not None and "num_experts (3) must be divisible by" in res["bad_ep"]


def test_uneven_all_to_all_single(run: tuple[dict, list[dict]]) -> None:
    torch.testing.assert_close(run[1][0]["a2a"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    assert run[1][1]["a2a"].shape == (0, 2)


def test_all_to_all_single_is_a_copy_without_a_group() -> None:
    src = torch.arange(6.0).view(3, 2)
    dst = torch.empty(3, 2)
    C.all_to_all_single(dst, src, [3], [3], None)
    assert torch.equal(dst, src)
