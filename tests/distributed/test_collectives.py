"""lightning_zero/comm/collectives.py on 2 gloo processes: every function gives the right result and
none makes torch print a DeprecationWarning/FutureWarning (issue #14: torch 2.13 deprecated the names
``reduce_scatter_tensor`` / ``all_gather_into_tensor``; see [Note: current collective names]).

The warnings are recorded inside the worker (``warnings.simplefilter("always")``, so a warning that a
filter or an earlier call would hide is still seen); the 1-process short cuts of collectives.py never
reach torch, hence two processes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_zero.comm import collectives as C

WORLD = 2


def _exercise(rank: int) -> dict[str, bool]:
    """Call every collective of the module once (async variants too); True where the result is right."""
    ok: dict[str, bool] = {}
    n = 3
    mine = torch.arange(n, dtype=torch.float32) + 10 * rank
    full = torch.cat([torch.arange(n, dtype=torch.float32) + 10 * r for r in range(WORLD)])

    t = mine.clone()
    C.all_reduce(t, None, "sum")
    ok["all_reduce"] = torch.equal(t, sum(torch.arange(n, dtype=torch.float32) + 10 * r for r in range(WORLD)))
    t = mine.clone()
    C.all_reduce(t, None, "max")
    ok["all_reduce_max"] = torch.equal(t, torch.arange(n, dtype=torch.float32) + 10 * (WORLD - 1))

    for async_op in (False, True):
        out = torch.empty(n)
        work = C.reduce_scatter(out, full * (rank + 1), None, async_op=async_op)
        if async_op:
            work.wait()
        ok[f"reduce_scatter_async={async_op}"] = torch.equal(out, full[rank * n:(rank + 1) * n] * 3)
        out = torch.empty(WORLD * n)
        work = C.all_gather(out, mine, None, async_op=async_op)
        if async_op:
            work.wait()
        ok[f"all_gather_async={async_op}"] = torch.equal(out, full)
        out = torch.empty(WORLD * n)
        work = C.all_to_all(out, full + rank, None, async_op=async_op)
        if async_op:
            work.wait()
        ok[f"all_to_all_async={async_op}"] = torch.equal(
            out, torch.cat([full[rank * n:(rank + 1) * n] + r for r in range(WORLD)])
        )

    # uneven: rank j sends j + 1 elements (all equal to j) to every rank
    out = torch.empty(sum(r + 1 for r in range(WORLD)))
    C.all_to_all_single(out, torch.full((WORLD * (rank + 1),), float(rank)), [r + 1 for r in range(WORLD)],
                        [rank + 1] * WORLD, None)
    ok["all_to_all_single"] = torch.equal(out, torch.cat([torch.full((r + 1,), float(r)) for r in range(WORLD)]))

    parts = [torch.empty(n) for _ in range(WORLD)]
    C.all_gather_list(parts, mine, None)
    ok["all_gather_list"] = torch.equal(torch.cat(parts), full)
    t = mine.clone()
    C.broadcast(t, 1, None)
    ok["broadcast"] = torch.equal(t, full[n:])
    ok["broadcast_object"] = C.broadcast_object({"from": rank}, 0, None) == {"from": 0}
    ok["all_gather_object"] = C.all_gather_object(rank, None) == list(range(WORLD))
    ok["sum_scalar"] = float(C.sum_scalar(torch.tensor(rank + 1.0), None)) == 3.0

    peer = 1 - rank
    got = torch.empty(n)
    C.send_recv([(mine, peer)], [(got, peer)], None)
    ok["send_recv"] = torch.equal(got, full[peer * n:(peer + 1) * n])
    if rank == 0:
        C.send(mine, 1, None)
    else:
        got = torch.empty(n)
        C.recv(got, 0, None)
        ok["send/recv"] = torch.equal(got, full[:n])

    sub = C.new_group([0, 1])
    gloo = C.new_gloo_group()
    for name, group in (("new_group", sub), ("new_gloo_group", gloo)):
        out = torch.empty(WORLD * n)
        C.all_gather(out, mine, group)
        ok[name] = torch.equal(out, full) and C.world_size(group) == WORLD and C.rank(group) == rank
    # host_twin: a gloo group is its own twin; under another backend (NCCL, simulated) a gloo group of the same ranks
    real = C.backend
    C.backend = lambda group=None: "nccl"  # type: ignore[assignment]
    try:
        twin, world_twin = C.host_twin(sub), C.host_twin(None)
    finally:
        C.backend = real  # type: ignore[assignment]
    flags = torch.tensor([rank, 1 - rank], dtype=torch.uint8)
    C.all_reduce(flags, twin, "max")
    ok["host_twin"] = (C.host_twin(sub) is sub and twin is not sub and world_twin is not None
                       and dist.get_process_group_ranks(twin) == [0, 1] and dist.get_backend(twin) == "gloo"
                       and flags.tolist() == [1, 1])
    C.barrier()
    ok["backend"] = C.backend() == "gloo" and C.device_for(None, torch.device("meta")) == torch.device("cpu")
    return ok


def _worker(rank: int, store: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = _exercise(rank)
    C.destroy()
    noisy = [f"{w.category.__name__}: {w.message}" for w in caught
             if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"ok": ok, "deprecations": noisy}))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("collectives")
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp)), nprocs=WORLD, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_every_collective_gives_the_right_result(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["ok"] and all(res["ok"].values()), (rank, res["ok"])
    assert {"reduce_scatter_async=True", "all_gather_async=True", "send_recv"} <= set(results[0]["ok"])


def test_no_deprecation_warning_from_any_collective(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["deprecations"] == [], (rank, res["deprecations"])


def test_current_names_are_picked_by_feature_detection(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's current names where torch has them; the old ones (torch 2.4 ...) where it does not."""
    for new, old, picked in (("reduce_scatter_single", "reduce_scatter_tensor", C.REDUCE_SCATTER_FN),
                             ("all_gather_single", "all_gather_into_tensor", C.ALL_GATHER_FN)):
        assert picked == (new if hasattr(dist, new) else old)
        assert callable(getattr(dist, picked))
        monkeypatch.delattr(dist, new, raising=False)
        assert C._current_name(new, old) == old
