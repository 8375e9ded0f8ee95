"""The CUDA build helper: its cache key, its errors where nothing can be compiled, and the sources that a wheel
carries (CPU only)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from litquant.kernels import build


@pytest.fixture
def fake_csrc(tmp_path, monkeypatch) -> Path:
    csrc = tmp_path / "csrc"
    (csrc / "demo").mkdir(parents=True)
    (csrc / "demo" / "demo.cu").write_text("// device code\n")
    (csrc / "demo" / "binding.cpp").write_text("// binding\n")
    (csrc / "demo" / "notes.txt").write_text("not a source\n")
    monkeypatch.setattr(build, "CSRC", csrc)
    monkeypatch.setenv("LITQUANT_CACHE", str(tmp_path / "cache"))
    return csrc


def test_cache_key_follows_sources_and_gpu_generation(fake_csrc, tmp_path):
    sm90 = build.build_directory("demo", (9, 0))
    assert sm90.parent == tmp_path / "cache" / "build"
    assert sm90.name.startswith("demo-") and sm90.name.endswith("-sm90")
    assert build.build_directory("demo", (8, 0)).name == sm90.name.replace("-sm90", "-sm80")
    assert build.build_directory("demo", (9, 0)) == sm90  # stable
    (fake_csrc / "demo" / "notes.txt").write_text("changed, but not a source\n")
    assert build.build_directory("demo", (9, 0)) == sm90
    (fake_csrc / "demo" / "demo.cu").write_text("// device code, edited\n")
    assert build.build_directory("demo", (9, 0)) != sm90


def test_an_older_target_builds_apart(fake_csrc):
    sm90 = build.build_directory("demo", (9, 0))
    assert build.build_directory("demo", (9, 0), (9, 0)) == sm90
    assert build.build_directory("demo", (9, 0), (8, 0)).name == sm90.name + "-ptx80"


def test_target_capability_from_the_environment(monkeypatch):
    monkeypatch.delenv("LITQUANT_CUDA_ARCH", raising=False)
    assert build.target_capability((9, 0)) == (9, 0)
    monkeypatch.setenv("LITQUANT_CUDA_ARCH", "8.0")
    assert build.target_capability((9, 0)) == (8, 0)
    assert build.target_capability((9, 0), " 8.6 ") == (8, 6)
    assert build.target_capability((8, 6), "") == (8, 6)
    with pytest.raises(build.BuildError, match="expected a compute capability such as 8.0"):
        build.target_capability((9, 0), "sm_80")
    with pytest.raises(build.BuildError, match="sm_80 up to this GPU's own sm_86, not sm_90"):
        build.target_capability((8, 6), "9.0")
    with pytest.raises(build.BuildError, match="not sm_75"):
        build.target_capability((9, 0), "7.5")


def test_nvcc_flags_name_the_target():
    """The GPU's own machine code (sm_90a on Hopper, for wgmma), or an older target's PTX for the driver to compile;
    the host code learns the target from LITQUANT_TARGET_ARCH."""
    assert build.nvcc_flags((9, 0), (9, 0))[2:] == ["-gencode=arch=compute_90a,code=sm_90a", "-DLITQUANT_TARGET_ARCH=90"]
    assert build.nvcc_flags((8, 0), (8, 0))[2:] == ["-gencode=arch=compute_80,code=sm_80", "-DLITQUANT_TARGET_ARCH=80"]
    assert build.nvcc_flags((9, 0), (8, 0))[2:] == ["-gencode=arch=compute_80,code=compute_80",
                                                    "-DLITQUANT_TARGET_ARCH=80"]


def test_cache_defaults_to_home(monkeypatch):
    monkeypatch.delenv("LITQUANT_CACHE", raising=False)
    assert build.cache_root() == Path.home() / ".cache" / "litquant" / "build"


def test_sources_are_found():
    assert "marlin" in build.cuda_kernels()
    names = [f.name for f in build.source_files("marlin")]
    assert "marlin.cu" in names and "binding.cpp" in names
    with pytest.raises(build.BuildError, match="no CUDA sources"):
        build.source_files("no_such_kernel")


def test_no_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(build.BuildError) as e:
        build.load("marlin")
    message = str(e.value)
    assert "'marlin'" in message and "Kernels that need no compiler: torch (any device), triton (a GPU)" in message
    assert "no CUDA" in message


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.BuildError, match=r"no CUDA compiler \(nvcc\).*torch \(any device\), triton \(a GPU\)"):
        build.load("marlin")


def test_marlin_reports_itself_unavailable_without_a_compiler(monkeypatch):
    from litquant.kernels.marlin import MarlinQuantLinear

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "torch (any device), triton (a GPU)" in MarlinQuantLinear.unavailable()


def test_an_installed_wheel_carries_every_cuda_source(tmp_path):
    """The kernels compile on the user's machine, so a wheel (`pip install .`, or one from an index) must hold their
    sources, and `build` must find them inside the installed package. Builds a wheel from this tree and installs it
    into a folder of its own."""
    pytest.importorskip("setuptools")
    repo = Path(__file__).resolve().parents[1]
    source = tmp_path / "source"
    shutil.copytree(repo / "litquant", source / "litquant", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, source / name)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
                   check=True, cwd=tmp_path)
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--no-compile", "--target", str(site),
                          *map(str, (tmp_path / "dist").glob("litquant-*.whl"))], check=True, cwd=tmp_path)

    installed = site / "litquant" / "csrc"
    for kernel in build.cuda_kernels():
        expected = [f.name for f in build.source_files(kernel)]
        assert sorted(f.name for f in (installed / kernel).iterdir()) == expected
    report = subprocess.run(
        [sys.executable, "-c", "import json; from litquant.kernels import build; "
                               "print(build.CSRC); print(json.dumps([str(f) for f in build.source_files('marlin')]))"],
        check=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    found_in, files = report.stdout.splitlines()
    assert Path(found_in) == installed
    files = [Path(f) for f in json.loads(files)]
    assert {f.parent for f in files} == {installed / "marlin"} and installed / "marlin" / "marlin.cu" in files


def test_sass_script_finds_the_wgmma_main_loops():
    """scripts/marlin_wgmma_sass.py on a made-up listing: a loop closes with a backward branch, and only an inner loop
    holding the stage's wgmmas counts; the ptxas report's spills go with the kernel compiled just before them."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("marlin_wgmma_sass",
                                                  Path(__file__).parents[1] / "scripts" / "marlin_wgmma_sass.py")
    sass_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_script)
    name = "_ZN15litquant_marlin19marlin_wgmma_kernelI13__nv_bfloat16Li160ELi1ELb1ELb0EEEvNS_8GemmArgsE"
    body = ["NOP"] * 2 + ["HGMMA.64x160x16.F32.BF16 R24, R120, gdesc[UR12], R24"] * 4 + ["@!P0 BRA 0x10"]
    body += ["IADD3 R1, R1, 0x1, RZ", "BRA 0x70"]  # a loop without wgmmas: not the main loop
    listing = "\t\tFunction : " + name + "\n" + "".join(
        f"        /*{16 * i:04x}*/                   {ins} ;  /* 0x000 */\n" for i, ins in enumerate(body))
    key = ("bf16", 160, 1, True, False)
    assert sass_script.main_loops(listing) == {key: [6]}  # instructions 1..6, closed by the branch back to 0x10
    report = f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n" \
             "ptxas info    : Used 168 registers, 8 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads\n"
    assert sass_script.spills(report) == {key: "16/16"}
