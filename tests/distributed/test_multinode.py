"""Multi-node, simulated (issue #32): 2 "nodes" x 2 ranks on this machine, each node its own torchrun with
``--nnodes 2`` and its ``--node-rank``, train at stage 3 with CPU offload exactly as 1 node x 4 ranks does,
and what depends on ranks per node (the offload's host-memory and disk checks) reads the launcher's count."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.launch import run_worker, run_worker_nodes

SPEC = "zero3:oopt=cpu,steps=6,n_train=256,val_every=4,persist=0"


def test_two_nodes_match_one_node(tmp_path: Path) -> None:
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = run_worker(tmp_path / "one", 4, {"z3o": SPEC})["z3o"]
    two = run_worker_nodes(tmp_path / "two", 2, 2, {"z3o": SPEC})["z3o"]

    assert len(one["losses"]) == 12 and one["losses"] == two["losses"]  # bit for bit, every micro-batch (6 steps x 2)
    assert one["weights"].keys() == two["weights"].keys()
    for name, w in one["weights"].items():
        assert torch.equal(w, two["weights"][name]), name

    # the launcher's layout reached the strategy and the offload engines on every rank
    assert [r["node"]["node_rank"] for r in two["per_rank"]] == [0, 0, 1, 1]
    assert {r["node"]["num_nodes"] for r in two["per_rank"]} == {2}
    assert {n for r in two["per_rank"] for n in r["node"]["offload_ranks_per_node"]} == {2}
    assert {n for r in one["per_rank"] for n in r["node"]["offload_ranks_per_node"]} == {4}
