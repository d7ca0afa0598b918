"""Count the bytes of distinct tensor storages (memory claims are measured, not computed)."""

from __future__ import annotations

from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of the sizes of the distinct storages behind ``tensors`` (views are counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class NewStorageTracker:
    """Peak bytes of tensor storage *created* while a block runs (a storage that existed before the
    block, or that an op received as an input, is not counted; views count once; a storage stops
    counting when it is freed).

    ``with NewStorageTracker() as t: ...`` then ``t.peak_bytes`` (the maximum, over the block, of the
    live new storage), ``t.total_bytes`` (every new storage's size, summed), ``t.live_bytes`` (still
    alive at exit) and ``t.largest_bytes`` (the largest single new storage).

    Counted through a ``TorchDispatchMode`` that sees every aten op's outputs (factory functions such
    as ``torch.empty`` included, collectives' output buffers included) and keeps only weak references
    to their storages. Dispatch modes are per thread: with ``threads=True`` (default) every thread
    started inside the block (``threading.Thread.run``) and every ``concurrent.futures`` thread-pool
    task run inside it (``_WorkItem.run``) is tracked too, e.g. the writer threads of
    ``torch.distributed.checkpoint``'s FileSystemWriter. Not seen: storage made without an aten op
    (``torch.UntypedStorage(n)``, ``torch.frombuffer``), and threads started before the block other
    than pool workers.
    """

    def __init__(self, threads: bool = True) -> None:
        import threading

        self.threads = threads
        self._lock = threading.Lock()
        self._live: dict = {}  # StorageWeakRef -> nbytes
        self._active = False
        self._patched: list = []
        self._mode = None
        self.peak_bytes = 0
        self.total_bytes = 0
        self.largest_bytes = 0
        self.ops = 0

    # ---------------------------------------------------------------- recording
    @staticmethod
    def _plain_tensors(obj) -> list[torch.Tensor]:
        from torch.utils._pytree import tree_flatten

        out: list[torch.Tensor] = []
        stack = list(tree_flatten(obj)[0])
        while stack:
            t = stack.pop()
            if not isinstance(t, torch.Tensor):
                continue
            if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # DTensor & co: inner tensors
                names, _ = t.__tensor_flatten__()
                stack += [getattr(t, n) for n in names]
                continue
            out.append(t)
        return out

    @staticmethod
    def _ref(t: torch.Tensor):
        from torch.multiprocessing.reductions import StorageWeakRef

        try:
            st = t.untyped_storage()
        except Exception:  # noqa: BLE001 - tensors without storage (meta, some subclasses)
            return None, 0
        if t.device.type == "meta":
            return None, 0
        return StorageWeakRef(st), st.nbytes()

    def _record(self, args, kwargs, outputs) -> None:
        inputs = set()
        for t in self._plain_tensors((args, kwargs)):
            ref, _ = self._ref(t)
            if ref is not None:
                inputs.add(ref)
        with self._lock:
            self.ops += 1
            for t in self._plain_tensors(outputs):
                ref, nbytes = self._ref(t)
                if ref is None or ref in inputs:
                    continue
                old = self._live.get(ref)
                if old is None:
                    self.total_bytes += nbytes
                self._live[ref] = max(nbytes, old or 0)  # a resize_ grows a tracked storage
                self.largest_bytes = max(self.largest_bytes, nbytes)
            for ref in [r for r in self._live if r.expired()]:
                del self._live[ref]
            self.peak_bytes = max(self.peak_bytes, sum(self._live.values()))

    @property
    def live_bytes(self) -> int:
        with self._lock:
            return sum(n for r, n in self._live.items() if not r.expired())

    def _make_mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if tracker._active:
                    tracker._record(args, kwargs, out)
                return out

        return _Mode()

    # ---------------------------------------------------------------- context
    def __enter__(self) -> "NewStorageTracker":
        self._active = True
        if self.threads:
            import concurrent.futures.thread as cft
            import threading

            tracker = self

            def wrap(cls, attr):
                orig = getattr(cls, attr)

                def run(obj, *a, **k):
                    if not tracker._active:
                        return orig(obj, *a, **k)
                    with tracker._make_mode():
                        return orig(obj, *a, **k)

                setattr(cls, attr, run)
                self._patched.append((cls, attr, orig))

            wrap(threading.Thread, "run")
            wrap(cft._WorkItem, "run")
        self._mode = self._make_mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._active = False
        for cls, attr, orig in reversed(self._patched):
            setattr(cls, attr, orig)
        self._patched = []
