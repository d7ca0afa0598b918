"""Tensor parallel x ZeRO (stages 0-3) against one process without any parallelism (CPU, gloo, fp32).

HF ``LlamaForCausalLM`` from a tiny config (4 heads, 2 KV heads, 2 layers) and the example GPT, each
parallelized in ``configure_model`` with the ready plans over ``self.device_mesh["tp"]``; fixed global
batch 8, AdamW, gradient clipping by the global norm at a value that binds (so the norm must count
TP-sharded parameters' pieces over tp and replicated ones once), 6 steps. One ``torchrun`` per world
size; the oracle is a plain torch loop on rank 0 (tests/parallel/tp_worker.py). The model is built in
``__init__`` (from the oracle's seed, or from another seed and then loaded from a saved state_dict of the
oracle's model, as a pretrained checkpoint is), which every stage must keep bit for bit, or built in
``configure_model``: there stage 3 builds it on the meta device and materialises it unit by unit, TP
shards included, and the module's ``zero_init_module`` copies the oracle's initial weights in (each rank
its TP shard's block).
CPU offload of the optimizer (stages 1-3, also partial: offload_ratio 0.5) and of stage 3's parameters,
and NVMe offload of both (swap files in a temporary directory), run on the same local shards and are held
to the same oracle.
"""

from __future__ import annotations

import pytest

from tests.helpers.compare import max_rel as _rel, tensor_rel
from tests.helpers.launch import run_worker

TOL = 1e-4
SCENARIO = "parallel.tp"


def _check_parity(got: dict, ref: dict) -> None:
    assert _rel(got["losses"], ref["losses"]) < TOL
    assert set(got["weights"]) == set(ref["weights"])
    for name, w in ref["weights"].items():
        g = got["weights"][name]
        assert g.shape == w.shape, name
        rel = tensor_rel(g, w)
        assert rel < TOL, (name, rel)
    for r in got["per_rank"]:  # every rank saw the same global losses
        assert _rel(r["losses"], ref["losses"]) < TOL


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """One launch: every stage with the weights built in ``__init__`` (``init``) and loaded there from a
    saved state_dict (``load``; stage 1's with optimizer offload), stage 3 also built on meta in
    configure_model (``zero3``, ``zero3_nvme`` on two ranks), and stage 3 with CPU optimizer offload
    (built) and with CPU optimizer and parameter offload (loaded)."""
    llama = "tp=2,model=llama"
    runs = {"zero1": f"zero1:{llama},build=init", "zero2": f"zero2:{llama},build=init",
            "zero3": f"zero3:{llama}", "zero3_init": f"zero3:{llama},build=init",
            "zero1_offload": f"zero1:{llama},build=load,offload_optimizer=cpu",
            "zero2_load": f"zero2:{llama},build=load",
            "zero3_load": f"zero3:{llama},build=load",
            "zero3_offload_opt": f"zero3:{llama},build=init,offload_optimizer=cpu",
            "zero3_offload": f"zero3:{llama},build=load,offload_optimizer=cpu,offload_params=cpu",
            "ref": "ref:model=llama"}
    return run_worker(tmp_path_factory.mktemp("tp4"), 4, runs, timeout=1800, scenario=SCENARIO)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    runs = {"zero0": "zero0:tp=2,model=llama", "zero1": "zero1:tp=2,model=llama", "gpt2": "zero2:tp=2,model=gpt",
            "zero2_partial_offload": "zero2:tp=2,model=llama,offload_optimizer=cpu,offload_ratio=0.5",
            "zero3_nvme": "zero3:tp=2,model=llama,offload_optimizer=nvme,offload_params=nvme",
            "zero2_bf16": "zero2:tp=2,model=llama,precision=bf16-mixed",
            "ref": "ref:model=llama", "ref_gpt": "ref:model=gpt"}
    return run_worker(tmp_path_factory.mktemp("tp2"), 2, runs, timeout=1200, scenario=SCENARIO)


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero3_init", "zero2_load", "zero3_load"])
def test_dp2_x_tp2_matches_one_process(four_ranks: dict[str, dict], stage: str) -> None:
    """Per step from step 0: the weights built or loaded in ``__init__`` are the ones trained at every
    stage (stage 3 re-created the ones parallelize_module re-registered inside configure_model: first
    loss off by 2e-3, zero/materialize.py [Note: the user's weights are kept]); a model built in
    configure_model (meta under stage 3) is initialised through ``zero_init_module``."""
    got = four_ranks[stage]
    _check_parity(got, four_ranks["ref"])
    coords = sorted((r["dp_rank"], r["tp_rank"]) for r in got["per_rank"])
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert got["per_rank"][0]["grad_norm"] > 0.05  # clipping was active


@pytest.mark.parametrize("name", ["zero1_offload", "zero3_offload_opt", "zero3_offload"])
def test_cpu_offload_dp2_x_tp2_matches_one_process(four_ranks: dict[str, dict], name: str) -> None:
    """ZeRO-Offload (stages 1 and 3) and ZeRO-Infinity with CPU parameters (stage 3) on local TP shards,
    from weights built or loaded in ``__init__``: the host step and the norm summed from the chunks as
    they land (replicated elements counted once)."""
    _check_parity(four_ranks[name], four_ranks["ref"])


@pytest.mark.parametrize("name,ref", [("zero0", "ref"), ("zero1", "ref"), ("gpt2", "ref_gpt"),
                                      ("zero2_partial_offload", "ref"), ("zero3_nvme", "ref")])
def test_tp2_on_two_ranks_matches_one_process(two_ranks: dict[str, dict], name: str, ref: str) -> None:
    _check_parity(two_ranks[name], two_ranks[ref])


def test_bf16_mixed_tp_trains_close_to_fp32(two_ranks: dict[str, dict]) -> None:
    """Mixed precision keeps working under TP: the DTensor parameters take the 16-bit compute dtype with
    their local shards (parallel/dtensor.py [Note: a DTensor's dtype is its own]; an fp32 DTensor around
    bf16 storage failed at setup; ``module.to(bf16)`` swapped the DTensor gradients out of the flat buffer,
    so the TP weights never stepped: losses 6e-3 and projections 80% off), and training tracks the fp32
    oracle within bf16's precision (measured: losses 4e-4, weights at most 9% after 6 Adam steps)."""
    got = two_ranks["zero2_bf16"]
    for r in got["per_rank"]:
        assert r["dtensor_dtypes"] == r["local_dtypes"] == ["torch.bfloat16"]
    assert _rel(got["losses"], two_ranks["ref"]["losses"]) < 2e-3
    for name, w in two_ranks["ref"]["weights"].items():
        rel = float((got["weights"][name].double() - w.double()).norm() / w.double().norm())
        assert rel < 0.2, (name, rel)


def test_module_sees_the_mesh(four_ranks: dict[str, dict]) -> None:
    for r in four_ranks["zero2"]["per_rank"]:
        assert r["mesh_seen"] == (("pp", "dp", "tp"), (1, 2, 2))
        assert r["strategy_mesh"] == (1, 2, 2)
        assert r["dtensor_params"] == 14  # 7 projections x 2 layers


@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3", "zero3_init"])
def test_optimizer_state_is_split_over_tp_and_dp(four_ranks: dict[str, dict], stage: str) -> None:
    """Counted by tensor storage: Adam's two fp32 moments cover this rank's 1/dp of its TP shard, and the
    TP shard is the sharded weights' 1/tp plus the replicated ones."""
    for r in four_ranks[stage]["per_rank"]:
        assert r["state_bytes"] == 2 * 4 * r["shard_numel"]
        padding = r["shard_numel"] * r["dp"] - r["local_numel"]
        assert 0 <= padding < r["dp"] * 8 * r["buckets"]
        assert r["local_numel"] < 0.6 * r["full_numel"]
        assert r["state_bytes"] < 0.6 * 2 * 4 * r["full_numel"] / r["dp"]


@pytest.mark.parametrize("name", ["zero3", "zero3_init"])
def test_stage3_parameters_are_split_over_tp_and_dp(four_ranks: dict[str, dict], name: str) -> None:
    """Counted by storage between steps: every parameter released (its TP shard's storage too); what a rank
    keeps is its dp partition of its TP shard (fp32: the master is the gather source), with Adam's two
    states beside it: 1/(tp*dp) of the model, plus the replicated embeddings, head and norms, which only
    the dp ranks split (15% more for this tiny Llama, whose embeddings are large)."""
    for r in four_ranks[name]["per_rank"]:  # built on meta or in __init__: released alike
        assert r["held_param_bytes"] == 0
        assert r["param_shard_bytes"] == 4 * r["shard_numel"]
        assert r["state_bytes"] == 2 * 4 * r["shard_numel"]
        assert r["shard_numel"] * r["dp"] * r["tp"] < 1.2 * r["full_numel"]
        assert r["shard_numel"] * r["dp"] >= r["local_numel"]

