"""Base classes of the compiled-op builders: sources, flags, compatibility, a cached JIT build.

[Note: op build cache]
Each op's extension is named ``lz_<op>_<key>``, where ``key`` hashes everything
that changes the binary: every source and header of the op, the flags, the
torch and Python versions, and for CUDA ops the ``-gencode`` flags. It lives in
``<root>/<name>/<name>.so``; ``root`` is ``$LIGHTNING_ZERO_BUILD_DIR`` or torch's
extensions root plus ``/lightning_zero``. A library already there is imported
directly, without touching a compiler: that is what ``python -m
lightning_zero.ops build`` leaves behind for runs that set
``LIGHTNING_ZERO_DISABLE_JIT=1`` or have no compiler. A stale library is never
picked up because its name carries the old key. A file lock in the op's
directory makes concurrent ranks build once and the others wait.

[Note: torch-free CUDA kernels]
The ``.cu`` files include only CUDA runtime headers and are compiled here with
nvcc straight to objects, with our own ``-gencode`` flags (see ``cuda_arch``);
the C++ binding is compiled by ``torch.utils.cpp_extension.load`` *without*
CUDA, and linked with those objects and ``libcudart``. So the binding never
needs ``c10/cuda`` headers (absent from the CPU torch wheel), a CPU-only machine
with nvcc can build and import every CUDA op (CI does), and torch's own parsing
of ``TORCH_CUDA_ARCH_LIST`` is never involved.

The only mutable state is one ``BuildCache`` per builder instance.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar

from lightning_zero.ops import cuda_arch

ENV_DISABLE_JIT = "LIGHTNING_ZERO_DISABLE_JIT"
ENV_BUILD_DIR = "LIGHTNING_ZERO_BUILD_DIR"
_SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu", ".inc")


class OpUnavailableError(RuntimeError):
    """A compiled op cannot be built or loaded here; the message says why."""


class OpFallbackWarning(UserWarning):
    """Emitted once per op when a slower fallback replaces a compiled op."""


@dataclass
class BuildCache:
    """Per-op process state: the loaded module or why it failed, and whether we warned."""

    module: ModuleType | None = None
    origin: str = ""
    error: str | None = None
    warned: bool = False
    toolkit: tuple[cuda_arch.CudaToolkit | None, str] | None = None


@dataclass(frozen=True)
class OpStatus:
    """One row of ``python -m lightning_zero.ops report``.

    ``compatible`` says the op can be built (or is prebuilt) here, ``runs`` that it can also *run*
    here: a CUDA op compiles on a CPU-only machine with nvcc (CI's compile check), but runs only
    where torch sees a GPU its build covers. Where its device exists but the op cannot run,
    ``fallback`` runs instead; without the device (``device_present`` False) nothing needs it.
    """

    name: str
    compatible: bool
    built: bool
    origin: str
    reason: str
    device: str = "cpu"
    device_present: bool = True
    runs: bool = False
    runs_reason: str = ""
    fallback: str = ""


def csrc_root() -> Path | None:
    """The ``csrc/`` folder: inside the package if shipped there, else beside it (source checkout)."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "csrc", package.parent / "csrc"):
        if (candidate / "includes" / "lz_common.h").is_file():
            return candidate
    return None


def build_root() -> Path:
    env = os.environ.get(ENV_BUILD_DIR)
    if env:
        return Path(env).expanduser().resolve()
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root()) / "lightning_zero"


def jit_disabled() -> bool:
    return os.environ.get(ENV_DISABLE_JIT, "").strip().lower() in {"1", "true", "yes", "on"}


def find_cxx() -> tuple[str | None, str]:
    """The C++ compiler torch's JIT will use (``$CXX`` or ``c++``), if it exists."""
    cxx = os.environ.get("CXX", "c++")
    found = shutil.which(cxx)
    return (found, "") if found else (None, f"no C++ compiler: {cxx!r} not found (set CXX)")


@contextlib.contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """Exclusive lock on ``directory/lz.lock`` (not torch's ``lock`` file, which torch itself takes)."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: concurrent builds are then the user's business
        yield
        return
    with open(directory / "lz.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _import_library(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise OpUnavailableError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class OpBuilder:
    """One compiled op: its sources, flags, compatibility gate and cached build.

    Subclasses set the class attributes and may extend the flag hooks.
    """

    name: ClassVar[str]
    #: Where the op's kernels run: "cpu", or "cuda" (CUDAOpBuilder).
    device: ClassVar[str] = "cpu"
    #: C++ sources relative to ``csrc/``, compiled by torch's JIT (the binding and CPU kernels).
    sources: ClassVar[tuple[str, ...]]
    #: What replaces this op when it is unavailable (shown in the warning and the report).
    fallback: ClassVar[str]

    def __init__(self) -> None:
        self.cache = BuildCache()

    # ----------------------------------------------------------------- hooks
    def cxx_flags(self) -> list[str]:
        return ["-O3"]

    def ld_flags(self) -> list[str]:
        return []

    def toolchain_check(self) -> tuple[bool, str]:
        """Extra requirements beyond a C++ compiler and ninja (e.g. nvcc)."""
        return True, ""

    def key_parts(self) -> list[str]:
        """Strings that, besides sources and flags, change the binary."""
        return []

    def runtime_check(self) -> tuple[bool, str]:
        """What running the op needs beyond a library that loads (CUDA ops: a GPU the build covers)."""
        return True, ""

    def device_present(self) -> bool:
        """Whether this machine has the device the op computes on (without it, nothing needs the op)."""
        return True

    # ------------------------------------------------------------ locations
    def source_paths(self) -> list[Path] | None:
        root = csrc_root()
        if root is None:
            return None
        paths = [root / rel for rel in self._all_sources()]
        return paths if all(p.is_file() for p in paths) else None

    def _all_sources(self) -> tuple[str, ...]:
        return self.sources

    def _hashed_files(self, root: Path) -> list[Path]:
        dirs = {(root / rel).parent for rel in self._all_sources()} | {root / "includes"}
        return sorted(p for d in dirs for p in d.iterdir() if p.suffix in _SOURCE_SUFFIXES)

    def build_key(self) -> str:
        root = csrc_root()
        if root is None:
            raise OpUnavailableError("sources not found")
        import torch

        digest = hashlib.sha256()
        for path in self._hashed_files(root):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
        parts = [torch.__version__, sys.version, sys.platform, *self.cxx_flags(), *self.key_parts()]
        digest.update("\0".join(parts).encode())
        return digest.hexdigest()[:12]

    def ext_name(self) -> str:
        return f"lz_{self.name}_{self.build_key()}"

    def build_dir(self) -> Path:
        return build_root() / self.ext_name()

    def library_path(self) -> Path:
        name = self.ext_name()
        return build_root() / name / f"{name}.so"

    # --------------------------------------------------------- compatibility
    def is_compatible(self) -> tuple[bool, str]:
        """(True, note) if this op can be loaded or built here, else (False, why not)."""
        if self.source_paths() is None:
            return False, "sources not found (csrc/ is not part of this install; use a source checkout)"
        ok, why = self.toolchain_check()
        if not ok:
            return False, why
        if self.library_path().exists():
            return True, "prebuilt"
        if jit_disabled():
            return False, f"not prebuilt and JIT disabled by {ENV_DISABLE_JIT}=1"
        cxx, why = find_cxx()
        if cxx is None:
            return False, why
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            return False, "ninja not found (pip install ninja)"
        return True, ""

    # ---------------------------------------------------------------- build
    def load(self, verbose: bool = False) -> ModuleType:
        """Import the op, JIT-building it first if needed; raise ``OpUnavailableError`` if impossible."""
        if self.cache.module is not None:
            return self.cache.module
        if self.cache.error is not None:
            raise OpUnavailableError(self.cache.error)
        try:
            ok, why = self.is_compatible()
            if not ok:
                raise OpUnavailableError(why)
            name, path = self.ext_name(), self.library_path()
            with _dir_lock(path.parent):
                if path.exists():
                    origin = f"prebuilt {path}"
                else:
                    if jit_disabled() or find_cxx()[0] is None:  # raced with a removal
                        raise OpUnavailableError("library vanished and JIT is unavailable")
                    self._jit_build(name, path.parent, verbose)
                    origin = f"JIT-built {path}"
                module = _import_library(name, path)
        except Exception as exc:  # noqa: BLE001 - any failure means "fall back", with the reason kept
            self.cache.error = _short(exc)
            raise OpUnavailableError(self.cache.error) from exc
        self.cache.module, self.cache.origin = module, origin
        return module

    def try_load(self) -> ModuleType | None:
        """The module, or None after warning once that ``fallback`` is used instead."""
        try:
            return self.load()
        except OpUnavailableError as exc:
            if not self.cache.warned:
                self.cache.warned = True
                warnings.warn(
                    f"lightning_zero: compiled op '{self.name}' is unavailable ({exc}); using {self.fallback} "
                    "instead. `python -m lightning_zero.ops report` lists every op.",
                    OpFallbackWarning,
                    stacklevel=3,
                )
            return None

    def status(self) -> OpStatus:
        ok, why = self.is_compatible()
        built = self.cache.module is not None or (ok and self.library_path().exists())
        origin = self.cache.origin or (f"prebuilt {self.library_path()}" if built else "-")
        reason = self.cache.error or why
        compatible = ok and self.cache.error is None
        can_run, why_not = self.runtime_check()  # the machine first: without a GPU, a CUDA op's build is moot
        runs, runs_reason = compatible and can_run, (reason if can_run else why_not)
        return OpStatus(self.name, compatible, built, origin, reason, self.device, self.device_present(), runs,
                        runs_reason, self.fallback)

    def reset(self) -> None:
        """Forget this process's load attempt (tests, or after fixing the toolchain)."""
        self.cache = BuildCache()

    def _jit_build(self, name: str, directory: Path, verbose: bool) -> None:
        from torch.utils import cpp_extension

        root = csrc_root()
        assert root is not None
        objects = self._compile_objects(directory, verbose)
        try:
            cpp_extension.load(
                name=name,
                sources=[str(root / rel) for rel in self.sources],
                extra_cflags=self.cxx_flags(),
                extra_ldflags=[*objects, *self.ld_flags()],
                extra_include_paths=[str(root / "includes")],
                build_directory=str(directory),
                with_cuda=False,
                verbose=verbose,
            )
        except Exception as exc:
            (directory / "build.log").write_text(str(exc))
            raise OpUnavailableError(f"C++ build failed, log in {directory / 'build.log'}: {_short(exc)}") from exc

    def _compile_objects(self, directory: Path, verbose: bool) -> list[str]:
        """Objects compiled outside torch's JIT (the CUDA kernels); none for CPU ops."""
        return []


def cpu_openmp_flags() -> list[str]:
    """OpenMP on Linux/GCC-compatible compilers; macOS' clang has none by default."""
    return [] if sys.platform == "darwin" else ["-fopenmp"]


class CUDAOpBuilder(OpBuilder):
    """An op with torch-free ``.cu`` kernels compiled by nvcc (see [Note: torch-free CUDA kernels])."""

    device: ClassVar[str] = "cuda"
    cuda_sources: ClassVar[tuple[str, ...]]

    def runtime_check(self) -> tuple[bool, str]:
        """A CUDA build of torch, a visible GPU, and every visible GPU covered by the arch list the
        library is (or would be) built for. ``is_compatible`` only says it can be built: on a CPU-only
        machine with nvcc it can, and must not be reported as usable."""
        import torch

        if torch.version.cuda is None:
            return False, f"torch {torch.__version__} is a CPU-only build (no CUDA)"
        if not torch.cuda.is_available():
            return False, "no CUDA GPU visible"
        spec, _ = cuda_arch.resolve_arch_list()
        for index in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(index)
            try:
                covered = cuda_arch.covers(spec, cap)
            except ValueError as exc:  # a bad TORCH_CUDA_ARCH_LIST: nothing is built for it
                return False, str(exc)
            if not covered:
                return False, (f"built for {spec!r}, which does not run on GPU {index} (compute capability "
                               f"{cap[0]}.{cap[1]}); set {cuda_arch.ENV_ARCH_LIST}")
        return True, ""

    def device_present(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def _all_sources(self) -> tuple[str, ...]:
        return (*self.sources, *self.cuda_sources)

    def toolkit(self) -> tuple[cuda_arch.CudaToolkit | None, str]:
        if self.cache.toolkit is None:
            self.cache.toolkit = cuda_arch.find_cuda_toolkit()
        return self.cache.toolkit

    def arch_flags(self) -> list[str]:
        spec, _ = cuda_arch.resolve_arch_list()
        return cuda_arch.gencode_flags(spec)

    def nvcc_flags(self) -> list[str]:
        """Flags for each ``.cu`` (besides -c, -o and -gencode); the CI compile check uses these too."""
        root = csrc_root()
        includes = [f"-I{root / 'includes'}"] if root else []
        return ["-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", *includes]

    def key_parts(self) -> list[str]:
        try:
            return [*self.arch_flags(), *self.nvcc_flags()]
        except ValueError as exc:
            return [str(exc)]

    def toolchain_check(self) -> tuple[bool, str]:
        try:
            self.arch_flags()
        except ValueError as exc:
            return False, str(exc)
        toolkit, why = self.toolkit()
        if toolkit is None:
            if self.library_path().exists():
                return True, ""
            return False, why
        import torch

        torch_cuda = torch.version.cuda
        if torch_cuda and torch_cuda.split(".")[0] != toolkit.version.split(".")[0]:
            return False, f"nvcc {toolkit.version} does not match torch's CUDA {torch_cuda}"
        return True, ""

    def ld_flags(self) -> list[str]:
        toolkit, _ = self.toolkit()
        if toolkit is None:
            return ["-lcudart"]
        lib = toolkit.lib_dir
        return [f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"]

    def nvcc_command(self, source: Path, output: Path) -> list[str]:
        toolkit, why = self.toolkit()
        if toolkit is None:
            raise OpUnavailableError(why)
        cmd = [str(toolkit.nvcc), "-c", str(source), "-o", str(output), *self.arch_flags(), *self.nvcc_flags()]
        if "CXX" in os.environ:
            cmd += ["-ccbin", os.environ["CXX"]]
        return cmd

    def _compile_objects(self, directory: Path, verbose: bool) -> list[str]:
        root = csrc_root()
        assert root is not None
        objects = []
        for rel in self.cuda_sources:
            output = directory / (Path(rel).stem + ".cu.o")
            tmp = output.with_suffix(".tmp.o")
            cmd = self.nvcc_command(root / rel, tmp)
            if verbose:
                print(" ".join(cmd), flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                log = directory / "build.log"
                log.write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
                raise OpUnavailableError(f"nvcc failed on {rel}, log in {log}: {_short(proc.stderr)}")
            os.replace(tmp, output)
            objects.append(str(output))
        return objects


def _short(exc: object, limit: int = 300) -> str:
    """First meaningful line of an error, so warnings and reports stay one line."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if "error" in line.lower()] or text.splitlines() or [""]
    line = lines[0].strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."
