"""Find nvcc and turn ``TORCH_CUDA_ARCH_LIST`` into ``-gencode`` flags.

Why our own parser: DeepSpeed 0.19.8's JIT builder crashes on ``9.0a`` (seen on
this project's GPU machine), and torch's parser only runs when torch compiles
the ``.cu`` files itself. We compile them with nvcc directly (see
``builder.CUDAOpBuilder``), so this module is the single place arch strings are
understood: ``9.0``, ``9.0a``, ``8.6+PTX``, ``sm_90``, ``90a``, ``12.0f`` and the
family names torch accepts (``Ampere``, ``Hopper``...), separated by ``;``,
``,`` or spaces.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

ENV_ARCH_LIST = "TORCH_CUDA_ARCH_LIST"

#: Used when neither the env var nor a visible GPU says which arch to build for.
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"

_NAMED_ARCHES = {
    "turing": "7.5+PTX",
    "ampere": "8.0;8.6+PTX",
    "ada": "8.9+PTX",
    "hopper": "9.0+PTX",
    "blackwell": "10.0;12.0+PTX",
}

_TOKEN = re.compile(r"^(?:sm_|compute_)?(\d+)(?:\.(\d))?([af]?)(\+ptx)?$", re.IGNORECASE)


@dataclass(frozen=True)
class CudaArch:
    """One compute capability to compile for, e.g. ``CudaArch("90a", ptx=False)``."""

    code: str  # digits plus an optional arch-specific ("a") or family ("f") suffix
    ptx: bool  # also embed PTX so newer GPUs can JIT it

    def gencode_flags(self) -> list[str]:
        flags = [f"-gencode=arch=compute_{self.code},code=sm_{self.code}"]
        if self.ptx:
            flags.append(f"-gencode=arch=compute_{self.code},code=compute_{self.code}")
        return flags

    @property
    def capability(self) -> tuple[int, int]:
        digits = self.code.rstrip("af")
        return int(digits[:-1]), int(digits[-1])

    def runs_on(self, capability: tuple[int, int]) -> bool:
        """Whether code compiled for this arch runs on a GPU of ``capability`` (major, minor).

        CUDA's rules: machine code for ``sm_XY`` runs on X.Z with Z >= Y (the family suffix ``f`` too),
        arch-specific code (``a``) only on X.Y itself; embedded PTX is JIT-compiled by the driver for
        any newer GPU (arch-specific PTX again only for X.Y).
        """
        own = self.capability
        if self.code.endswith("a"):
            return capability == own
        if self.ptx and capability >= own:
            return True
        return capability[0] == own[0] and capability[1] >= own[1]


def parse_arch_list(spec: str) -> list[CudaArch]:
    """Parse an arch list; raise ``ValueError`` naming the first bad token."""
    tokens = [t for t in re.split(r"[;,\s]+", spec.strip()) if t]
    if not tokens:
        raise ValueError(f"{ENV_ARCH_LIST}={spec!r} names no architecture")
    arches: list[CudaArch] = []
    for token in tokens:
        named = _NAMED_ARCHES.get(token.lower())
        if named is not None:
            arches.extend(parse_arch_list(named))
            continue
        match = _TOKEN.match(token)
        if match is None:
            raise ValueError(f"{ENV_ARCH_LIST}={spec!r}: cannot parse {token!r} (expected e.g. 9.0, 9.0a, 8.6+PTX)")
        major, minor, suffix, ptx = match.groups()
        if minor is None:  # "90", "sm_90a": the last digit is the minor version
            if len(major) < 2:
                raise ValueError(f"{ENV_ARCH_LIST}={spec!r}: {token!r} has no minor version")
            major, minor = major[:-1], major[-1]
        arch = CudaArch(code=f"{int(major)}{minor}{suffix.lower()}", ptx=ptx is not None)
        if arch not in arches:
            arches.append(arch)
    return arches


def visible_gpu_arch_list() -> str | None:
    """Arch list of the visible GPUs, or None without CUDA (never initialises more than torch would)."""
    import torch

    if not torch.cuda.is_available():
        return None
    caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
    return ";".join(f"{major}.{minor}" for major, minor in caps)


def resolve_arch_list() -> tuple[str, str]:
    """(arch list, where it came from): the env var, else the visible GPUs, else the default."""
    env = os.environ.get(ENV_ARCH_LIST, "").strip()
    if env:
        return env, ENV_ARCH_LIST
    visible = visible_gpu_arch_list()
    if visible:
        return visible, "visible GPUs"
    return DEFAULT_ARCH_LIST, "default (no GPU visible)"


def gencode_flags(spec: str) -> list[str]:
    return [flag for arch in parse_arch_list(spec) for flag in arch.gencode_flags()]


def covers(spec: str, capability: tuple[int, int]) -> bool:
    """Whether a build for arch list ``spec`` runs on a GPU of ``capability`` (see CudaArch.runs_on)."""
    return any(arch.runs_on(capability) for arch in parse_arch_list(spec))


@dataclass(frozen=True)
class CudaToolkit:
    """Where nvcc and the CUDA runtime library live."""

    nvcc: Path
    home: Path
    version: str  # "13.0"

    @property
    def lib_dir(self) -> Path:
        for candidate in (self.home / "lib64", self.home / "targets" / "x86_64-linux" / "lib", self.home / "lib"):
            if (candidate / "libcudart.so").exists():
                return candidate
        return self.home / "lib64"


def find_cuda_toolkit() -> tuple[CudaToolkit | None, str]:
    """Locate nvcc: ``CUDA_HOME``/``CUDA_PATH`` if set (only there), else PATH, else /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            nvcc = Path(home) / "bin" / "nvcc"
            if not nvcc.exists():
                return None, f"{var}={home} has no bin/nvcc"
            return _toolkit(nvcc.resolve())
    found = shutil.which("nvcc")
    if found:
        return _toolkit(Path(found).resolve())
    fallback = Path("/usr/local/cuda/bin/nvcc")
    if fallback.exists():
        return _toolkit(fallback.resolve())
    return None, "nvcc not found (set CUDA_HOME or put nvcc on PATH)"


def _nvcc_version(nvcc: Path) -> str | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else None


def _cuda_home(nvcc: Path) -> Path:
    """The toolkit root as nvcc itself sees it (nvcc on PATH may be a wrapper script)."""
    try:
        proc = subprocess.run(
            [str(nvcc), "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        match = re.search(r"^#\$ TOP=(.+)$", proc.stdout + proc.stderr, re.MULTILINE)
        if match:
            return Path(match.group(1).strip().strip('"')).resolve()
    except (OSError, subprocess.SubprocessError):
        pass
    return nvcc.parent.parent


def _toolkit(nvcc: Path) -> tuple[CudaToolkit | None, str]:
    version = _nvcc_version(nvcc)
    if version is None:
        return None, f"{nvcc} does not run"
    return CudaToolkit(nvcc=nvcc, home=_cuda_home(nvcc), version=version), ""
