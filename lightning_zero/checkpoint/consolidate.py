"""A sharded checkpoint as one ordinary Lightning checkpoint, offline: no GPU, no process group.

``consolidate`` reads every flattened tensor whole (torch.distributed.checkpoint assembles the
writers' pieces, in batches of about ``batch_gb`` with a progress bar), gives the weights their
shapes and original dtypes back under the module's own names (tied names share one tensor), turns
the optimizer states into torch's per-parameter format (pipeline stages merged group by group), and
adds Lightning's own entries from ``meta.pt``. The result is what ``checkpoint_format='full'`` writes:
``MyModule.load_from_checkpoint``, ``torch.load`` and Lightning's ``ddp`` read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_zero.checkpoint import atomic
from lightning_zero.checkpoint import layout as L
from lightning_zero.checkpoint.sharded import dcp_load, read_dcp_metadata, read_meta
from lightning_zero.comm.compressed import COMM_STATE_KEY


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in meta.pt")
    return dtype


def _progress(total: int, enabled: bool, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, leave=False)


def read_full(path: atomic.PathLike, keys: Iterable[str], md: Metadata, progress: bool = False,
              batch_gb: float = 1.0, threads: int = 4) -> dict[str, Any]:
    """Every key's full value: flattened tensors as 1-D tensors, other entries as stored."""
    keys = list(dict.fromkeys(keys))
    sizes = {}
    for k in keys:
        m = md.state_dict_metadata[k]
        sizes[k] = m.size.numel() * m.properties.dtype.itemsize if isinstance(m, TensorStorageMetadata) else 0
    out: dict[str, Any] = {}
    bar = _progress(sum(sizes.values()), progress, f"reading {Path(path).name}")
    batch: dict[str, Any] = {}
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        dcp_load(batch, path, None, threads, no_dist=True)
        out.update(batch)
        bar.update(batch_bytes)
        batch, batch_bytes = {}, 0

    for k in keys:
        m = md.state_dict_metadata[k]
        if isinstance(m, TensorStorageMetadata):
            batch[k] = torch.empty(m.size, dtype=m.properties.dtype)
        else:
            assert isinstance(m, BytesStorageMetadata)
            batch[k] = None
        batch_bytes += sizes[k]
        if batch_bytes >= batch_gb * 1e9:
            flush()
    if batch:
        flush()
    bar.close()
    return out


def _weights(meta: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    shared: dict[str, Tensor] = {}
    for name, info in meta["weights"].items():
        if "value" in info:
            sd[name] = info["value"]
            continue
        key = info["key"]
        if key not in shared:
            flat = values[key]
            shared[key] = flat.view(tuple(info["shape"])).to(_dtype(info["dtype"]))
        sd[name] = shared[key]
    return sd


def _merged_records(stages: dict[int, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per param group, the pipeline stages' groups merged by position."""
    merged: list[dict[str, Any]] = []
    for pp in sorted(stages):
        for gi, rec in enumerate(stages[pp]):
            if gi == len(merged):
                merged.append({"hyper": dict(rec["hyper"]), "params": [], "flat": [], "scalar": []})
            m = merged[gi]
            m["params"] += [p for p in rec["params"] if p not in m["params"]]
            m["flat"] += [k for k in rec["flat"] if k not in m["flat"]]
            m["scalar"] += [k for k in rec["scalar"] if k not in m["scalar"]]
    return merged


def _optimizer_keys(k: int, records: list[dict[str, Any]], md: Metadata) -> list[str]:
    prefix = L.opt_prefix(k)
    keys = []
    for rec in records:
        for name in rec["params"]:
            for key in rec["flat"] + rec["scalar"]:
                skey = f"{prefix}state.{name}.{key}"
                if skey in md.state_dict_metadata:
                    keys.append(skey)
    return keys


def _optimizer_state(k: int, records: list[dict[str, Any]], values: dict[str, Any],
                     shapes: dict[str, tuple]) -> dict[str, Any]:
    """torch.optim's ``state_dict()`` format: parameters numbered in group order."""
    prefix = L.opt_prefix(k)
    index: dict[str, int] = {}
    state: dict[int, dict[str, Any]] = {}
    groups = []
    for rec in records:
        ids = []
        for name in rec["params"]:
            i = index.setdefault(name, len(index))
            ids.append(i)
            entry: dict[str, Any] = {}
            for key in rec["flat"]:
                v = values.get(f"{prefix}state.{name}.{key}")
                if v is not None:
                    entry[key] = v.view(shapes.get(name, v.shape))
            for key in rec["scalar"]:
                skey = f"{prefix}state.{name}.{key}"
                if skey in values:
                    entry[key] = values[skey]
            if entry:
                state[i] = entry
        groups.append({**rec["hyper"], "params": ids})
    return {"state": state, "param_groups": groups}


def _merged_comm(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(per_rank[0])
    errors: dict[int, Any] = {}
    for state in per_rank:
        errors.update(state.get("errors") or {})
    merged["errors"] = errors or None
    return merged


def load_consolidated(path: atomic.PathLike, progress: bool = False, weights_only: bool = False) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as an ordinary Lightning checkpoint dict, in host memory."""
    meta = read_meta(path)
    info = meta["lightning_zero"]
    md = read_dcp_metadata(path)
    weight_keys = [w["key"] for w in info["weights"].values() if "key" in w]
    opt_records = [_merged_records(o["stages"]) for o in info["optimizers"]]
    keys = list(weight_keys)
    if info.get("has_optimizer_states") and not weights_only:
        for k, records in enumerate(opt_records):
            keys += _optimizer_keys(k, records, md)
    comm_keys = {k: sorted(key for key in md.state_dict_metadata if key.startswith(f"{L.opt_prefix(k)}comm.rank"))
                 for k in range(len(opt_records))}
    if info.get("has_optimizer_states") and not weights_only:
        keys += [key for ks in comm_keys.values() for key in ks]
    values = read_full(path, keys, md, progress)
    ckpt = dict(meta["lightning"])
    ckpt["state_dict"] = _weights(info, values)
    if info.get("has_optimizer_states") and not weights_only:
        shapes = {n: tuple(w["shape"]) for n, w in info["weights"].items() if "shape" in w}
        ckpt["optimizer_states"] = [_optimizer_state(k, r, values, shapes) for k, r in enumerate(opt_records)]
        for k, ks in comm_keys.items():
            if ks:  # a 1-bit optimizer: every rank's error feedback in one entry, as the full format has it
                ckpt["optimizer_states"][k][COMM_STATE_KEY] = _merged_comm([values[key] for key in ks])
    return ckpt


def consolidate(path: atomic.PathLike, out: atomic.PathLike, safetensors: bool = False, progress: bool = True) -> Path:
    """Write the sharded checkpoint at ``path`` as one file ``out``: a Lightning checkpoint
    (``torch.save``), or with ``safetensors`` the weights alone in safetensors format."""
    out = Path(out)
    if not atomic.is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete lightning_zero sharded checkpoint (.metadata and meta.pt)")
    ckpt = load_consolidated(path, progress=progress, weights_only=safetensors)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError as e:  # pragma: no cover - safetensors comes with transformers
            raise ImportError("--safetensors needs the safetensors package: pip install safetensors") from e
        seen: set[int] = set()
        tensors = {}
        for name, t in ckpt["state_dict"].items():
            if torch.is_tensor(t):  # safetensors refuses shared storage: a tied name gets its own copy
                tensors[name] = t.contiguous() if id(t) not in seen else t.clone()
                seen.add(id(t))
        save_file(tensors, str(tmp), metadata={"format": "pt", "source": str(path)})
    else:
        torch.save(ckpt, tmp)
    tmp.replace(out)
    return out


def describe(path: atomic.PathLike, list_tensors: bool = False) -> str:
    """What a sharded checkpoint holds: step, stage, world size, tensors and bytes (``inspect``)."""
    meta = read_meta(path)
    info = meta["lightning_zero"]
    md = read_dcp_metadata(path)
    p = Path(path)
    weight_bytes = opt_bytes = 0
    for key, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            n = m.size.numel() * m.properties.dtype.itemsize
            if key.startswith(L.WEIGHT_PREFIX):
                weight_bytes += n
            else:
                opt_bytes += n
    per_rank: dict[str, int] = {}
    for f in sorted(p.glob("__*_*.distcp")):
        rank = f.name.split("_")[2]
        per_rank[rank] = per_rank.get(rank, 0) + f.stat().st_size
    n_weights = sum(1 for w in info["weights"].values() if "key" in w)
    lines = [
        f"checkpoint   {p}",
        f"step         {info.get('global_step')} (epoch {info.get('epoch')})",
        f"saved by     ZeRO stage {info.get('stage')} on world size {info.get('world_size')} "
        f"(data parallel {info.get('dp')}, pipeline stages {info.get('pp')}, tensor parallel {info.get('tp', 1)}, expert parallel "
        f"{info.get('ep', 1)}; offload optimizer "
        f"{info.get('offload_optimizer')}, params {info.get('offload_params')})",
        f"weights      {n_weights} tensors, {weight_bytes / 2**20:.1f} MiB as stored",
        f"optimizers   {len(info['optimizers'])}" + (f", state {opt_bytes / 2**20:.1f} MiB"
                                                     if info.get("has_optimizer_states") else " (weights only)"),
        "files        " + ", ".join(f"rank {r}: {b / 2**20:.1f} MiB" for r, b in per_rank.items()),
    ]
    if list_tensors:
        for name, w in info["weights"].items():
            if "key" in w:
                lines.append(f"  {name:60s} {str(tuple(w['shape'])):20s} {w['dtype']}")
    return "\n".join(lines)


def default_output(path: atomic.PathLike, safetensors: bool) -> Path:
    p = Path(path)
    return p.with_name(p.stem + (".safetensors" if safetensors else ".consolidated.ckpt"))


__all__ = ["consolidate", "load_consolidated", "describe", "read_full", "default_output"]

