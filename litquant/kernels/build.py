"""Build litquant's CUDA kernels on first use, and cache the result.

Each kernel with CUDA code has a folder `litquant/csrc/<name>/`: device code in `*.cu` (plain launch functions,
no torch headers) and a thin torch binding in `*.cpp` that registers the ops `torch.ops.litquant_<name>`.
The folders are package data, so an installed wheel builds its kernels as a source checkout does.
`load(name)` compiles the folder with `torch.utils.cpp_extension.load` (ninja + nvcc) for the GPU at
hand and loads it. Builds are cached in `$LITQUANT_CACHE/build` (default `~/.cache/litquant/build`),
one directory per `<name>-<hash of the sources>-sm<compute capability>`: editing a source or changing
GPU generation builds anew, anything else reuses the cache. `build_all()` builds every kernel ahead of
time (`litquant kernels --build`).

`LITQUANT_CUDA_ARCH=8.0` (any compute capability from 8.0 up to the GPU's) builds the kernels of that older GPU
instead, as PTX that the driver compiles for the GPU at hand when it loads them, and the kernels then take that
GPU's paths (litquant/csrc/marlin/marlin.cu `current_device`): on a Hopper this runs the Ampere code, which is how
scripts/gpu.sh tests it where no A100 is lent. It is slower to load (the driver's compile) and is a test of the
code, not of the older GPU: the SASS comes from this GPU's compiler, the SM count and L2 are this GPU's.
"""
import hashlib
import os
import re
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCE_SUFFIXES = (".cu", ".cpp", ".cuh", ".h")
NO_COMPILER_KERNELS = {"torch": "any device", "triton": "a GPU"}  # name -> what it runs on


class BuildError(RuntimeError):
    """A CUDA kernel cannot be built here; the message says why and which kernels need no compiler."""


def cuda_kernels() -> List[str]:
    """Names of the kernels that have CUDA sources (the folders of `litquant/csrc/`)."""
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


def build_directory(name: str, capability: Tuple[int, int], target: Optional[Tuple[int, int]] = None) -> Path:
    """Where `name` is built for a GPU of compute `capability` (with the code of an older `target`, if given)."""
    older = f"-ptx{target[0]}{target[1]}" if target is not None and target != capability else ""
    return cache_root() / f"{name}-{source_hash(source_files(name))}-sm{capability[0]}{capability[1]}{older}"


def target_capability(gpu: Tuple[int, int], setting: Optional[str] = None) -> Tuple[int, int]:
    """The compute capability to build for on a GPU of capability `gpu`: `setting` (`$LITQUANT_CUDA_ARCH` when not
    given, e.g. "8.0"), or the GPU's own."""
    setting = os.environ.get("LITQUANT_CUDA_ARCH", "") if setting is None else setting
    if not setting.strip():
        return gpu
    match = re.fullmatch(r"\s*(\d+)\.(\d)\s*", setting)
    if match is None:
        raise BuildError(f"LITQUANT_CUDA_ARCH={setting!r}: expected a compute capability such as 8.0")
    target = (int(match[1]), int(match[2]))
    if not (8, 0) <= target <= gpu:
        raise BuildError(f"LITQUANT_CUDA_ARCH={setting}: litquant's CUDA kernels can be built for sm_80 up to this "
                         f"GPU's own sm_{gpu[0]}{gpu[1]}, not sm_{target[0]}{target[1]}")
    return target


def nvcc_flags(capability: Tuple[int, int], target: Tuple[int, int]) -> List[str]:
    """nvcc's options for kernels of compute `target` run on a GPU of `capability`: that GPU's machine code, or, for an
    older target, the target's PTX. `LITQUANT_TARGET_ARCH` tells the host code which GPU's paths it holds."""
    number = f"{target[0]}{target[1]}"
    if target != capability:
        code = f"-gencode=arch=compute_{number},code=compute_{number}"
    else:  # Hopper builds for sm_90a, whose wgmma instructions the plain sm_90 target lacks.
        arch = number + ("a" if target == (9, 0) else "")
        code = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    return ["-O3", "-lineinfo", code, f"-DLITQUANT_TARGET_ARCH={number}"]


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
            "Kernels that need no compiler: " + ", ".join(f"{k} ({where})" for k, where in NO_COMPILER_KERNELS.items()))


@lru_cache(maxsize=None)
def _load(name: str, capability: Tuple[int, int], target: Tuple[int, int]) -> Path:
    from torch.utils.cpp_extension import load as load_extension

    directory = build_directory(name, capability, target)
    if not any(directory.glob(f"litquant_{name}*.so")):
        gpu = f"sm_{capability[0]}{capability[1]}"
        what = gpu if target == capability else f"sm_{target[0]}{target[1]} (LITQUANT_CUDA_ARCH) as PTX for this {gpu}"
        print(f"building {name} for {what} (first use, ~1 min)...", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    sources = [str(f) for f in source_files(name) if f.suffix in (".cu", ".cpp")]
    load_extension(name=f"litquant_{name}", sources=sources, build_directory=str(directory),
                   extra_cflags=["-O3"], extra_cuda_cflags=nvcc_flags(capability, target),
                   is_python_module=False, verbose=False)
    return directory


def load(name: str, device: Optional[torch.device] = None) -> Path:
    """Build (once per source version and GPU generation) and load kernel `name`; its ops appear
    under `torch.ops.litquant_<name>`. Returns the build directory. Raises `BuildError` when this
    machine cannot build CUDA code."""
    reason = unavailable_reason(name)
    if reason:
        raise BuildError(reason)
    return _load(name, torch.cuda.get_device_capability(device), built_capability(device))


def built_capability(device: Optional[torch.device] = None) -> Tuple[int, int]:
    """The compute capability whose kernels `load` builds for `device`'s GPU (its own, or `$LITQUANT_CUDA_ARCH`)."""
    return target_capability(torch.cuda.get_device_capability(device))


def build_all() -> Dict[str, Path]:
    """Build every CUDA kernel for the current GPU: kernel name -> build directory."""
    return {name: load(name) for name in cuda_kernels()}
