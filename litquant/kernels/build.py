"""Build litquant's CUDA kernels on first use, and cache the result.

Each kernel with CUDA code has a folder `csrc/<name>/`: device code in `*.cu` (plain launch functions,
no torch headers) and a thin torch binding in `*.cpp` that registers the ops `torch.ops.litquant_<name>`.
`load(name)` compiles the folder with `torch.utils.cpp_extension.load` (ninja + nvcc) for the GPU at
hand and loads it. Builds are cached in `$LITQUANT_CACHE/build` (default `~/.cache/litquant/build`),
one directory per `<name>-<hash of the sources>-sm<compute capability>`: editing a source or changing
GPU generation builds anew, anything else reuses the cache. `build_all()` builds every kernel ahead of
time (`litquant kernels --build`).
"""
import hashlib
import os
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCE_SUFFIXES = (".cu", ".cpp", ".cuh", ".h")
NO_COMPILER_KERNELS = ("torch", "triton")


class BuildError(RuntimeError):
    """A CUDA kernel cannot be built here; the message says why and which kernels need no compiler."""


def cuda_kernels() -> List[str]:
    """Names of the kernels that have CUDA sources (the folders of `csrc/`)."""
    return sorted(d.name for d in CSRC.iterdir() if d.is_dir()) if CSRC.is_dir() else []


def source_files(name: str) -> List[Path]:
    folder = CSRC / name
    files = sorted(f for f in folder.glob("*") if f.suffix in SOURCE_SUFFIXES) if folder.is_dir() else []
    if not files:
        raise BuildError(f"no CUDA sources for kernel {name!r} in {folder}")
    return files


def source_hash(files: List[Path]) -> str:
    """A digest of the names and contents of `files`: the part of the cache key that sources decide."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> Path:
    base = os.environ.get("LITQUANT_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "litquant") / "build"


def build_directory(name: str, capability: Tuple[int, int]) -> Path:
    """Where `name` is built for a GPU of compute `capability`."""
    return cache_root() / f"{name}-{source_hash(source_files(name))}-sm{capability[0]}{capability[1]}"


def find_nvcc() -> Optional[str]:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


def compiler_problem() -> Optional[str]:
    """Why CUDA kernels cannot be built and run here, or None."""
    if torch.version.cuda is None:
        return "this torch build has no CUDA support"
    if not torch.cuda.is_available():
        return "torch sees no CUDA GPU"
    if find_nvcc() is None:
        return "no CUDA compiler (nvcc) was found; set CUDA_HOME or put nvcc on PATH"
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    return None


def unavailable_reason(name: str) -> Optional[str]:
    """The full message for a kernel that cannot be built here, or None when it can."""
    problem = compiler_problem()
    if problem is None:
        return None
    return (f"kernel {name!r} is compiled from CUDA source on first use, but {problem}. "
            f"Kernels that need no compiler: {', '.join(NO_COMPILER_KERNELS)}")


@lru_cache(maxsize=None)
def _load(name: str, capability: Tuple[int, int]) -> Path:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_directory(name, capability)
    # Hopper builds for sm_90a, whose wgmma instructions the plain sm_90 target lacks.
    arch = f"{capability[0]}{capability[1]}" + ("a" if capability == (9, 0) else "")
    if not any(directory.glob(f"litquant_{name}*.so")):
        print(f"building {name} for sm_{arch} (first use, ~1 min)...", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    sources = [str(f) for f in source_files(name) if f.suffix in (".cu", ".cpp")]
    load_extension(name=f"litquant_{name}", sources=sources, build_directory=str(directory),
                   extra_cflags=["-O3"],
                   extra_cuda_cflags=["-O3", "-lineinfo", f"-gencode=arch=compute_{arch},code=sm_{arch}"],
                   is_python_module=False, verbose=False)
    return directory


def load(name: str, device: Optional[torch.device] = None) -> Path:
    """Build (once per source version and GPU generation) and load kernel `name`; its ops appear
    under `torch.ops.litquant_<name>`. Returns the build directory. Raises `BuildError` when this
    machine cannot build CUDA code."""
    reason = unavailable_reason(name)
    if reason:
        raise BuildError(reason)
    return _load(name, torch.cuda.get_device_capability(device))


def build_all() -> Dict[str, Path]:
    """Build every CUDA kernel for the current GPU: kernel name -> build directory."""
    return {name: load(name) for name in cuda_kernels()}
