"""Comparisons shared by the sharded-checkpoint tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

LOSS_TOL = 1e-4
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
GROUP_KEYS = ("params", "lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad", "maximize")


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Exact equality of nested dicts/lists of tensors and numbers (a 0-dim tensor equals its number)."""
    if torch.is_tensor(a) and torch.is_tensor(b):
        assert a.shape == b.shape, (where, a.shape, b.shape)
        assert a.dtype == b.dtype, (where, a.dtype, b.dtype)
        assert torch.equal(a, b), (where, float((a.double() - b.double()).abs().max()) if a.is_floating_point() else "")
    elif torch.is_tensor(a) or torch.is_tensor(b):
        ta, tb = (x if torch.is_tensor(x) else torch.tensor(x) for x in (a, b))
        assert ta.numel() == 1 and tb.numel() == 1 and float(ta) == float(tb), (where, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), (where, sorted(map(str, set(a) ^ set(b)))[:10])
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), (where, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def assert_same_weights(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], where: str = "") -> None:
    assert got and set(got) == set(ref), (where, sorted(set(got) ^ set(ref))[:10])
    bad = {k: float((got[k].double() - ref[k].double()).abs().max()) for k in ref
           if not (got[k].shape == ref[k].shape and torch.equal(got[k].to(ref[k].dtype), ref[k]))}
    assert not bad, (where, bad)
    assert all(got[k].dtype == ref[k].dtype for k in ref), where


def assert_same_optimizer(got: dict[str, Any], ref: dict[str, Any], where: str = "") -> None:
    """Torch per-parameter optimizer state: every state tensor (Adam's moments, step) exactly; the groups'
    parameter indices and hyper-parameters."""
    assert set(got["state"]) == set(ref["state"]), (where, sorted(got["state"]), sorted(ref["state"]))
    assert ref["state"], where
    for idx, st in ref["state"].items():
        assert set(ADAM_KEYS) <= set(st), (where, idx, sorted(st))
        assert_same(got["state"][idx], st, f"{where}.state[{idx}]")
    assert len(got["param_groups"]) == len(ref["param_groups"]), where
    for i, (g, r) in enumerate(zip(got["param_groups"], ref["param_groups"])):
        for k in GROUP_KEYS:
            if k in r or k in g:
                assert k in r and k in g, (where, i, k)
                assert_same(g[k], r[k], f"{where}.param_groups[{i}].{k}")


def global_losses(per_rank: list[dict[str, Any]], key: str = "losses") -> dict[int, float]:
    """Mean over ranks of each rank's loss at each step (equal slices of one global batch)."""
    series = [dict(r[key]) for r in per_rank]
    steps = set(series[0])
    assert steps and all(set(s) == steps for s in series), [sorted(s) for s in series]
    return {s: sum(x[s] for x in series) / len(series) for s in sorted(steps)}


def assert_losses_close(got: dict[int, float], ref: dict[int, float], steps: list[int], tol: float = LOSS_TOL) -> None:
    assert sorted(got) == steps, (sorted(got), steps)
    rel = {s: abs(got[s] - ref[s]) / abs(ref[s]) for s in steps}
    assert max(rel.values()) < tol, {s: (got[s], ref[s]) for s in steps}


def load(path: Path | str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def state_bytes(ckpt: dict[str, Any]) -> tuple[int, int]:
    """(fp32 weight bytes, Adam exp_avg + exp_avg_sq bytes) of a consolidated checkpoint."""
    weights = sum(v.numel() * v.element_size() for v in ckpt["state_dict"].values()
                  if torch.is_tensor(v) and v.is_floating_point())
    moments = sum(v.numel() * v.element_size() for opt in ckpt["optimizer_states"] for st in opt["state"].values()
                  for k, v in st.items() if k in ADAM_KEYS)
    return weights, moments


def rank_files(ckpt_dir: Path | str, rank: int) -> list[Path]:
    return sorted(p for p in Path(ckpt_dir).iterdir() if p.name.startswith(f"__{rank}_") and p.name.endswith(".distcp"))


def partials(directory: Path | str) -> list[str]:
    """Temporary ``.lz-partial-*`` entries anywhere under ``directory``."""
    return [os.path.join(root, n) for root, dirs, files in os.walk(directory) for n in dirs + files
            if n.startswith(".lz-partial")]


def assert_complete_sharded(path: Path | str) -> None:
    path = Path(path)
    assert path.is_dir(), f"{path} is not a directory"
    names = set(os.listdir(path))
    assert ".metadata" in names and "meta.pt" in names, sorted(names)
    assert any(n.startswith("__0_") and n.endswith(".distcp") for n in names), sorted(names)
