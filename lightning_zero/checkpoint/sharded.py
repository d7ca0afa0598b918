"""Save and load sharded checkpoints: the strategy's one entry point (see layout.py for the keys,
storage.py for the files, atomic.py for the rename, pieces.py for the resharding).

[Note: sharded save and load]
Save (every rank): the pieces this rank owns are collected (inside ``engine.host_state()``, so
NVMe-offloaded states are readable), torch.distributed.checkpoint writes them into a hidden partial
directory over a gloo group of its own, rank 0 adds ``meta.pt`` (Lightning's own entries: epoch,
loops, callbacks, hyper-parameters; the names, shapes and dtypes of the weights; the optimizers'
param groups) and renames the directory into place. Nothing is gathered: no rank ever holds more
than its own partitions plus the piece being written. With ``checkpoint_async`` the pieces are first
made safe from the next optimizer step (async_stage.py [Note: async staging]: host pieces copied into a
reused pinned arena, device pieces snapshotted on the device or read in place behind a fence before
the next step) and the copying to host and the writing run in a background thread; the next save, a
load, the end of fit and an exception wait for it, and checkpoint deletions requested meanwhile
(``save_top_k``) run after it, so the newest complete checkpoint always exists on disk.

Load (every rank): ``meta.pt`` is read first (it is what Lightning sees as the checkpoint, with
markers in place of ``state_dict``/``optimizer_states``); the weights and then the optimizer states
are read by torch.distributed.checkpoint straight into the masters, optimizer states and module
tensors this rank holds; engines then refresh their 16-bit parameters from the masters.
"""

from __future__ import annotations

import io
import logging
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Generator, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from lightning_zero.checkpoint import atomic, save_errors
from lightning_zero.checkpoint.async_stage import Staged, Stager, tensor_of
from lightning_zero.checkpoint import layout as L
from lightning_zero.checkpoint.pieces import FlatPiece, PieceLoadPlanner, PieceSavePlanner
from lightning_zero.checkpoint.storage import CheckedReader, CheckedWriter, CorruptCheckpointError
from lightning_zero.comm import collectives as C
from lightning_zero.comm.compressed import COMM_STATE_KEY, restore_comm_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class ShardedStateDict(dict):
    """Stands for ``checkpoint["state_dict"]`` of a sharded checkpoint: the weights are written (or
    read) by the strategy itself, piece by piece, never as one dict. Empty; ``path`` is set on load."""

    def __init__(self, path: Optional[str] = None) -> None:
        super().__init__()
        self.path = path


class ShardedOptimizerState(dict):
    """Stands for ``checkpoint["optimizer_states"][k]`` of a sharded checkpoint (see ShardedStateDict)."""

    def __init__(self, index: int, path: Optional[str] = None) -> None:
        super().__init__()
        self.index = index
        self.path = path


def _rethrow(e: CheckpointException) -> None:
    """DCP gathers every rank's failure into one CheckpointException (a BaseException, raised on all
    ranks): raise the first CorruptCheckpointError in it, which names the file, on every rank."""
    for exc, _ in e.failures.values():
        if isinstance(exc, CorruptCheckpointError):
            raise CorruptCheckpointError(str(exc)) from None
    raise RuntimeError(str(e)) from None


def read_meta(path: atomic.PathLike) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint, with a clear error when it is missing or damaged."""
    f = Path(path) / atomic.META_FILE
    if not f.is_file():
        raise CorruptCheckpointError(f"{path} is not a complete lightning_zero sharded checkpoint: no {atomic.META_FILE}")
    try:
        return torch.load(f, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CorruptCheckpointError(f"{f} is damaged: {e}") from e


def read_dcp_metadata(path: atomic.PathLike) -> Metadata:
    return CheckedReader(str(path)).read_metadata()


def dcp_load(state: dict[str, Any], path: atomic.PathLike, group: Any, threads: int, no_dist: bool = False) -> None:
    """Read ``state`` (FlatPieces and tensors filled in place, objects replaced) from ``path``."""
    if not state and no_dist:
        return
    try:
        with warnings.catch_warnings():  # offline reads (no_dist) are meant to be single-process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=CheckedReader(str(path), threads), planner=PieceLoadPlanner(),
                     process_group=group, no_dist=no_dist)
    except CheckpointException as e:
        _rethrow(e)


def _as_stored(piece: FlatPiece, md: Metadata, key: str, path: Any, what: str) -> FlatPiece:
    """``piece`` adapted to how ``key`` is stored (flat or n-D: pieces.py [Note: tensor-parallel
    pieces]); a ValueError naming the entry when its shape is not this run's (a different model)."""
    smd = md.state_dict_metadata[key]
    if not isinstance(smd, TensorStorageMetadata):
        raise ValueError(f"Checkpoint {path}: {what} is not stored as a tensor.")
    try:
        return piece.stored_as(smd.size)
    except ValueError as e:
        raise ValueError(f"Checkpoint {path} cannot be loaded into this model: {what} {e}.") from None


def _check_weights_match(view: L.RankView, saved: dict[str, Any], md: Metadata, path: Any, strict: bool,
                         pipelined: bool) -> None:
    """One clear error, raised alike on every rank before any collective read, when the checkpoint's
    weights are not this model's: names (unless ``strict`` is off) and global shapes (always: a
    different tensor-parallel or ZeRO layout never changes them; pieces.py [Note: tensor-parallel
    pieces]). Only the module's names and global shapes are compared, which every rank shares (what a
    rank holds differs with its partition and would let one rank fail while the others wait)."""
    local = {n: t for n, t in view.named_tensors().items() if torch.is_tensor(t)}
    missing = [n for n, t in local.items() if t.numel() and saved.get(n, {}).get("key", L.WEIGHT_PREFIX + n)
               not in md.state_dict_metadata]
    everyone = set(view.all_names())  # expert parallelism: the other EP ranks' experts are expected too
    unexpected = [] if pipelined else [n for n in saved if n not in everyone]
    if strict and (missing or unexpected):
        raise KeyError(
            f"Checkpoint {path} does not match the model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            " (LightningModule.strict_loading=False loads what matches)."
        )
    shapes = {n: (tuple(saved[n]["shape"]), tuple(t.shape)) for n, t in local.items()
              if "shape" in saved.get(n, {}) and tuple(saved[n]["shape"]) != tuple(t.shape)}
    if shapes:
        listed = ", ".join(f"'{n}' saved {list(a)}, model {list(b)}" for n, (a, b) in list(shapes.items())[:5])
        raise ValueError(
            f"Checkpoint {path} cannot be loaded into this model: {len(shapes)} weight(s) differ in shape ({listed}"
            f"{', ...' if len(shapes) > 5 else ''}). Shapes are the full tensors' whatever the tensor-parallel, "
            "pipeline or ZeRO layout, so the model itself differs from the one that wrote the checkpoint."
        )


def _nbytes(entries: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(entries))


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Future:
    """Run ``fn`` in a daemon thread (an executor's threads are joined at exit: a save stuck on a
    failed peer would keep the process alive)."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(e)

    threading.Thread(target=run, name="lz-ckpt-async", daemon=True).start()
    return future


def _tensors(entries: dict[str, Any]) -> list[Tensor]:
    return [t for v in entries.values() if (t := tensor_of(v)) is not None]


def step_only_storages(view: L.RankView) -> set[int]:
    """Storage pointers of what only an optimizer step changes: the engines' masters and their optimizers'
    state tensors (async_stage.py [Note: async staging] reads them in place when the device has no room)."""
    out: set[int] = set()
    for k, engine in enumerate(view.engines):
        if engine is None:
            continue
        state = view.optimizers[k].state if k < len(view.optimizers) else {}
        for fg in engine.groups:
            out.add(fg.master.untyped_storage().data_ptr())
            for value in state.get(fg.master, {}).values():
                if torch.is_tensor(value):
                    out.add(value.untyped_storage().data_ptr())
    return out


class ShardedCheckpointer:
    """Sharded checkpoints of one strategy (see the Note above). ``group``: the gloo group every rank
    of the job is in (None in a single process)."""

    def __init__(self, group: Any, threads: int = 4, fsync: bool = True, async_save: bool = False) -> None:
        self.group = group
        self.rank = C.rank(group)
        self.threads = threads
        self.fsync = fsync
        self.async_save = async_save
        self._pending: Optional[Future] = None
        self._deferred: list[str] = []
        self._lock = threading.Lock()
        self._stager = Stager()
        self.last_save: dict[str, float] = {}
        """Timings of the latest save (seconds): ``blocking`` (what the caller waited) and ``total``."""
        self.staged_on = ""
        """How the latest async save staged its CUDA pieces (async_stage.py [Note: async staging])."""
        self._last_saved: Optional[Path] = None
        """The latest checkpoint this saver completed (named by a failed save's error as kept)."""

    # ------------------------------------------------------------------------------ save
    def save(self, view: L.RankView, checkpoint: dict[str, Any], path: atomic.PathLike,
             host_state: Callable[[], Any], extra_info: dict[str, Any]) -> None:
        """Write ``checkpoint`` (Lightning's dict; its ``state_dict``/``optimizer_states`` are markers)
        as a sharded directory at ``path`` (collective over every rank)."""
        t0 = time.perf_counter()
        self.wait()
        final = Path(path)
        with host_state():
            entries = L.weight_entries(view)
            records: dict[int, list[dict[str, Any]]] = {}
            n_opt = len(checkpoint.get("optimizer_states", []) or [])
            for k in range(n_opt):
                opt_entries, records[k] = L.optimizer_entries(view, k)
                entries.update(opt_entries)
            weights = L.weight_info(view)
            entries, weights, stage_records = self._merge_stages(view, entries, weights, records)
            if not self.async_save:  # async: checked in the writer thread, on the staged copies
                self._refuse_nonfinite(save_errors.first_nonfinite(entries), final)
            meta_bytes = b""
            if self.rank == 0:
                rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
                meta = {
                    "lightning": rest,
                    "lightning_zero": {
                        **extra_info,
                        "format": FORMAT_VERSION,
                        "weights": weights,
                        "optimizers": [{"stages": stage_records.get(k, {})} for k in range(n_opt)],
                        "has_optimizer_states": "optimizer_states" in checkpoint,
                    },
                }
                buf = io.BytesIO()
                torch.save(meta, buf)
                meta_bytes = buf.getvalue()
            staged = self._stager.stage(entries, step_only_storages(view)) if self.async_save else None
        if staged is None:
            with host_state():  # NVMe: the swapped-in buffers the pieces point into stay valid
                self._write(entries, meta_bytes, final)
            self.last_save = {"blocking": time.perf_counter() - t0, "total": time.perf_counter() - t0}
            return
        blocking = time.perf_counter() - t0
        self._pending = _in_daemon_thread(self._timed, t0, self._write_staged, staged, meta_bytes, final)
        self.last_save = {"blocking": blocking}
        self.staged_on = staged.where

    def fence(self) -> None:
        """Before an optimizer step: wait (on the device) for an async save still reading the states in place
        (async_stage.py [Note: async staging]); nothing when none is."""
        self._stager.fence()

    def _write_staged(self, staged: Staged, meta_bytes: bytes, final: Path) -> None:
        """The writer thread's job for an async save: the copies finished, the non-finite refusal, the write."""
        self._refuse_nonfinite(staged.finish(), final)
        self._write(staged.entries, meta_bytes, final)

    def _refuse_nonfinite(self, finding: Optional[str], final: Path) -> None:
        """Collective: no rank writes when any rank's pieces hold NaN or inf (``finding``: this rank's first
        bad key or None; save_errors.py)."""
        findings = C.all_gather_object(finding, self.group)
        if any(f is not None for f in findings):
            save_errors.refuse_nonfinite(findings, final, save_errors.previous_checkpoint(final, self._last_saved))

    def _timed(self, t0: float, job: Callable[..., None], *args: Any) -> None:
        """``job(*args)``, then the save's total time since ``t0`` (when ``save`` was called)."""
        job(*args)
        self.last_save["total"] = time.perf_counter() - t0

    def _merge_stages(self, view: L.RankView, entries: dict[str, Any], weights: dict[str, Any],
                      records: dict[int, list[dict[str, Any]]]) -> tuple[dict[str, Any], dict[str, Any], dict[int, dict]]:
        """Pipeline stages hold different names; a tied module is on several. Every rank learns which
        stage holds each key first (that stage writes it) and rank 0 the union of names and records."""
        mine = {k: {view.pp_rank: recs} for k, recs in records.items()}
        if view.pp_size == 1 or C.world_size(self.group) == 1:
            return entries, weights, mine
        gathered = C.all_gather_object((view.pp_rank, view.dp_rank, sorted(entries), weights, records), self.group)
        stages = {pp for pp, _, _, _, _ in gathered}  # type: ignore[misc]
        if len(stages) == 1:
            return entries, weights, mine
        first: dict[str, int] = {}
        all_weights: dict[str, Any] = {}
        stage_records: dict[int, dict[int, list]] = {}
        for pp, dp, keys, w, recs in sorted(gathered, key=lambda g: g[0]):  # type: ignore[index]
            for key in keys:
                first.setdefault(key, pp)
            for name, info in w.items():
                all_weights.setdefault(name, info)
            if dp == 0:
                for k, r in recs.items():
                    stage_records.setdefault(k, {})[pp] = r
        kept = L.drop_later_stage_copies(entries, view.pp_rank, first)
        return kept, all_weights, stage_records

    def _write(self, entries: dict[str, Any], meta_bytes: bytes, final: Path) -> None:
        """Everything after the pieces are known: partial directory, DCP write, meta.pt, rename. A
        failure anywhere removes the partial and raises one line on every rank (save_errors.py [Note:
        a failed save leaves what was there])."""
        t0 = time.perf_counter()
        opened = self._open_partial(final) if self.rank == 0 else None
        gathered = C.all_gather_object((opened, _nbytes(entries) + len(meta_bytes)), self.group)
        (partial_name, free, failure), needed = gathered[0][0], sum(n for _, n in gathered)  # type: ignore[misc]

        def failed(cause: BaseException) -> save_errors.CheckpointSaveError:
            kept = save_errors.previous_checkpoint(final, self._last_saved)
            return save_errors.save_failed(final, cause, needed, free, kept)

        if failure is not None:
            raise failed(OSError(*failure)) from None
        partial = Path(partial_name)
        writer = CheckedWriter(str(partial), thread_count=self.threads, sync_files=self.fsync)
        try:
            dcp.save(PieceSavePlanner.wrap(entries), storage_writer=writer, planner=PieceSavePlanner(),
                     process_group=self.group)
        except CheckpointException as e:  # raised on every rank, once every rank's writing has ended
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            C.barrier(self.group)  # every rank raises once the partial is gone
            raise failed(e) from None
        outcome = None
        if self.rank == 0:
            try:
                atomic.write_file(partial / atomic.META_FILE, meta_bytes, self.fsync)
                atomic.commit(partial, final, self.fsync)
            except OSError as e:
                shutil.rmtree(partial, ignore_errors=True)
                outcome = (e.errno or 5, e.strerror or str(e))
            else:
                self._run_deferred()
        outcome = C.broadcast_object(outcome, 0, self.group)  # also the barrier: the checkpoint is in place
        if outcome is not None:
            raise failed(OSError(*outcome)) from None  # type: ignore[misc]
        self._last_saved = final
        if self.rank == 0:
            log.info("saved sharded checkpoint %s (%.2f GB from this rank) in %.2f s", final,
                     _nbytes(entries) / 1e9, time.perf_counter() - t0)

    @staticmethod
    def _open_partial(final: Path) -> tuple[Optional[str], Optional[int], Optional[tuple[int, str]]]:
        """Rank 0: a fresh partial directory next to ``final`` (stale ones removed); its name, the bytes
        free before the save, and the (errno, message) of a failure to create it."""
        partial = atomic.new_partial_name(final)
        free = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            atomic.remove_stale_partials(final.parent, keep=partial)
            free = save_errors.free_bytes(final.parent)
            partial.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            return None, free, (e.errno or 5, e.strerror or str(e))
        return str(partial), free, None

    def reserve(self, nbytes: int, pin: bool) -> None:
        """Async saves: allocate the host staging buffer in the background now (the first save would
        otherwise block on it); a later save waits for it if it is still running."""
        if not self.async_save or nbytes <= 0:
            return
        self.wait()
        self._pending = _in_daemon_thread(self._stager.arena.reserve, nbytes, pin)

    def wait(self) -> None:
        """Block until a pending async save has finished; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except BaseException:
                with self._lock:  # the new checkpoint is not there: keep the ones it was to replace
                    self._deferred = []
                raise
            self._run_deferred()

    def remove(self, path: atomic.PathLike) -> None:
        """Delete a checkpoint (rank 0); while an async save is outstanding, once it is on disk (a
        deletion never leaves the run without a complete checkpoint)."""
        if self.rank != 0:
            return
        with self._lock:
            if self._pending is not None:
                self._deferred.append(str(path))
                return
        atomic.remove(path)

    def _run_deferred(self) -> None:
        with self._lock:
            todo, self._deferred = self._deferred, []
        for old in todo:
            atomic.remove(old)

    def wait_or_abandon(self, timeout_s: float) -> None:
        """After a failure: give a pending async save ``timeout_s`` to finish (it needs every rank;
        if a peer is gone it never will: its partial directory is ignored and removed by the next
        save), then go on without it (its thread is a daemon: the process can still exit)."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - includes the timeout
            log.error("the asynchronous checkpoint save did not complete (%s); the previous checkpoint stands", e)
            with self._lock:
                self._deferred = []
            self._pending = None
            return
        self.wait()

    # ------------------------------------------------------------------------------ load
    def load_weights(self, view: L.RankView, path: str, strict: bool, pipelined: bool,
                     host_state: Callable[[], Any], refresh: Callable[[], None]) -> None:
        """Read the weights this rank holds from a sharded checkpoint (collective)."""
        self.wait()  # a pending async save reads the same tensors and uses the same group
        meta = read_meta(path)["lightning_zero"]
        md = read_dcp_metadata(path)
        saved_weights: dict[str, Any] = meta["weights"]
        _check_weights_match(view, saved_weights, md, path, strict, pipelined)
        with host_state():
            dests, after = L.weight_destinations(view)
            state: dict[str, Any] = {}
            for key, piece in dests.items():
                name = key[len(L.WEIGHT_PREFIX):]
                skey = saved_weights.get(name, {}).get("key", key)
                if skey in md.state_dict_metadata:
                    state[skey] = _as_stored(piece, md, skey, path, f"weight '{name}'")
            dcp_load(state, path, self.group, self.threads)
            for tmp, target in after:
                with torch.no_grad():
                    target.copy_(tmp.view(target.shape))
            refresh()  # inside host_state: NVMe-offloaded parameters are written from the loaded masters

    def load_optimizers(self, view: L.RankView, path: str, host_state: Callable[[], Any]) -> None:
        """Read the optimizer states this rank holds (collective)."""
        self.wait()  # a pending async save reads the same tensors and uses the same group
        meta = read_meta(path)["lightning_zero"]
        if not meta.get("has_optimizer_states", False):
            raise KeyError(f"Checkpoint {path} holds no optimizer states (saved with weights only).")
        saved = meta["optimizers"]
        if len(saved) != len(view.optimizers):
            raise ValueError(f"Checkpoint {path} has {len(saved)} optimizers, this run has {len(view.optimizers)}.")
        md = read_dcp_metadata(path)
        with host_state():
            state: dict[str, Any] = {}
            plans = [self._optimizer_plan(view, k, saved[k]["stages"], md, state, path) for k in range(len(view.optimizers))]
            dcp_load(state, path, self.group, self.threads)
            for plan in plans:
                plan(state)

    def _optimizer_plan(self, view: L.RankView, k: int, stages: dict[int, list[dict[str, Any]]], md: Metadata,
                        state: dict[str, Any], path: str) -> Callable[[dict[str, Any]], None]:
        """Add optimizer ``k``'s destinations to ``state``; return what installs them once read."""
        opt, engine = view.optimizers[k], view.engines[k]
        if engine is None:
            raise RuntimeError(f"optimizer {k} is not wrapped by a ZeRO engine; it cannot load a sharded checkpoint.")
        records = stages.get(view.pp_rank) or stages.get(0) or next(iter(stages.values()), [])
        if len(records) != len(opt.param_groups):
            raise ValueError(
                f"Checkpoint has {len(records)} param groups for optimizer {k}, the optimizer has {len(opt.param_groups)}."
            )
        prefix = L.opt_prefix(k)
        for pg, rec in zip(opt.param_groups, records):
            pg.update(rec["hyper"])
        opt.state.clear()
        new_states: dict[int, dict[str, Any]] = {}
        scalar_keys: dict[int, dict[str, str]] = {}
        step_keys: dict[int, list[tuple[int, str]]] = {}  # gi -> (parameter index, its 'step' key)
        for gi, fg, p, name, pieces in L.iter_group_slots(view, k):
            rec = records[engine.pg_of[gi]]  # a param group's flat groups share its record (layout.py)
            if not rec["flat"] and not rec["scalar"]:
                continue
            st = new_states.setdefault(gi, {})
            for key in rec["flat"]:
                skey = f"{prefix}state.{name}.{key}"
                smd = md.state_dict_metadata.get(skey)
                if not isinstance(smd, TensorStorageMetadata):
                    continue
                if key not in st:
                    st[key] = torch.zeros(fg.master.numel(), dtype=smd.properties.dtype, device=fg.master.device)
                for start, mstart, length in pieces:
                    piece = L.read_piece(st[key][mstart : mstart + length], start, L.tensor_block(p))
                    state[skey] = _as_stored(piece, md, skey, path, f"optimizer {k} state '{key}' of '{name}'")
            for key in rec["scalar"]:
                skey = f"{prefix}state.{name}.{key}"
                if skey in md.state_dict_metadata and key == "step":  # every parameter's own count: zero/
                    # state_dict.py [Note: per-parameter step counts in checkpoints]
                    index = next(i for i, q in enumerate(fg.params) if q is p)
                    step_keys.setdefault(gi, []).append((index, skey))
                    if skey not in state:
                        state[skey] = _scalar_destination(md.state_dict_metadata[skey])
                if key in scalar_keys.setdefault(gi, {}) or skey not in md.state_dict_metadata:
                    continue
                smd = md.state_dict_metadata[skey]
                scalar_keys[gi][key] = skey
                if isinstance(smd, TensorStorageMetadata):
                    state[skey] = torch.empty(smd.size, dtype=smd.properties.dtype)
                else:
                    assert isinstance(smd, BytesStorageMetadata)
                    state[skey] = None
        comm_key = None
        for candidate in (f"{prefix}comm.rank{view.global_rank}", f"{prefix}comm.rank0"):
            if candidate in md.state_dict_metadata:
                comm_key = candidate
                state[comm_key] = None
                break

        def install(loaded: dict[str, Any]) -> None:
            for gi, st in new_states.items():
                for key, skey in scalar_keys.get(gi, {}).items():
                    st[key] = loaded[skey]
                _restore_steps(engine, gi, st, [(i, loaded[skey]) for i, skey in step_keys.get(gi, [])])
                opt.state[engine.groups[gi].master] = st
            engine.after_state_load()  # 16-bit states <-> fp32 (zero/states16.py)
            with engine.masters_in_optimizer():  # 1-bit optimizers index their state by the groups' tensors
                restore_comm_state(opt, {COMM_STATE_KEY: loaded[comm_key]} if comm_key else {})

        return install


def _scalar_destination(smd: Any) -> Any:
    if isinstance(smd, TensorStorageMetadata):
        return torch.empty(smd.size, dtype=smd.properties.dtype)
    assert isinstance(smd, BytesStorageMetadata)
    return None


def _restore_steps(engine: Any, gi: int, st: dict[str, Any], steps: list[tuple[int, Any]]) -> None:
    """The flat group's ``step`` is its parameters' largest, each parameter lags it by the difference
    (zero/state_dict.py [Note: per-parameter step counts in checkpoints])."""
    counts = {i: float(v) for i, v in steps}
    count = max(counts.values(), default=0.0)
    if counts and "step" in st:
        st["step"] = torch.full_like(st["step"], count) if torch.is_tensor(st["step"]) else type(st["step"])(count)
    n = len(engine.groups[gi].params)
    engine.used.restore_lags(gi, [int(count - counts.get(i, 0.0)) if counts else 0 for i in range(n)])


@contextmanager
def all_host_state(engines: list[Any]) -> Generator[None, None, None]:
    """Every engine's masters and optimizer states resident (NVMe offload swaps them in)."""
    with ExitStack() as stack:
        for engine in engines:
            if engine is not None:
                stack.enter_context(engine.host_state())
        yield
