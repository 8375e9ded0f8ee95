"""Compile-only (CPU machine, nvcc): the SASS instructions of the wgmma kernel's main loop (one 128-k stage a turn),
per instantiation, for one or more copies of litquant/csrc/marlin side by side, with ptxas's spills.

    python3 scripts/marlin_wgmma_sass.py [folder[,folder...]] [--all]

Folders default to litquant/csrc/marlin. A kernel that is not a k-split one holds the loop twice (whole rounds, then
shared runs: `for_each_run` inlines the run once for each); both are listed, in that order. Without --all only g128's
instantiations (one group row a stage) are listed.

Why: code outside the loop can change how ptxas schedules it, and that costs time. Any branch added to the producer
warpgroup's code, even one that only waits at a barrier, gave the 32..192-row loops 6-8 more instructions (uniform
register moves around each wgmma's descriptor). In bf16 such a build (a producer warp releasing stream-K's hand-over)
took 2-6% more time at M = 640 (160-row tiles) on every Llama layer, whole-tile launches included, which hand nothing
over (fp16 level; docs/kernel-notes.md, session 87; benchmarks/results/2026-12-07-wgmma-handover-release-ab.log).
Check a change here before timing it."""
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

KERNEL = re.compile(r"marlin_wgmma_kernelI(6__half|13__nv_bfloat16)Li(\d+)ELi(\d+)ELb([01])ELb([01])E")
OFFSET = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
BRANCH = re.compile(r"BRA (?:\S+ )?0x([0-9a-f]+)")


def cuobjdump() -> str:
    """cuobjdump from the CUDA toolkit, or the copy triton ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def kernel_key(name: re.Match) -> tuple:
    """(dtype, rows, group rows, zero points, k splits) of a kernel's mangled name."""
    dtype, rows, group_rows, zeros, splits = name.groups()
    return "bf16" if "bfloat" in dtype else "fp16", int(rows), int(group_rows), zeros == "1", splits == "1"


def compile_folder(folder: Path, obj: Path) -> tuple:
    """(SASS text, ptxas report) of the folder's wgmma.cu for sm_90a, compiled to `obj`."""
    done = subprocess.run(["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-DLITQUANT_TARGET_ARCH=90",
                           "-Xptxas", "-v", "-c", str(folder / "wgmma.cu"), "-o", str(obj)],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"nvcc could not compile {folder / 'wgmma.cu'}:\n{done.stderr}")
    sass = subprocess.run([cuobjdump(), "-sass", str(obj)], capture_output=True, text=True, check=True).stdout
    return sass, done.stderr


def main_loops(sass: str) -> dict:
    """{(dtype, rows, group rows, zero points, k splits): [instructions of each main loop]}."""
    loops = {}
    for function in sass.split("Function : ")[1:]:
        name = KERNEL.search(function.split("\n", 1)[0])
        if not name:
            continue
        code = [m.group(2) for m in map(OFFSET.match, function.split("\n")) if m]
        lengths = []
        for end, instruction in enumerate(code):
            target = BRANCH.search(instruction)
            if target:  # a backward branch closes a loop; the main loop is an inner one with the stage's wgmmas
                start = int(target.group(1), 16) // 16
                if start < end and end - start < 400 and sum("HGMMA" in i for i in code[start:end + 1]) >= 4:
                    lengths.append(end - start + 1)
        loops[kernel_key(name)] = lengths
    return loops


def spills(report: str) -> dict:
    """{kernel key: 'S/L' bytes of spill stores / loads} for the kernels that spill."""
    found, key = {}, None
    for line in report.split("\n"):
        name = KERNEL.search(line)
        if "Compiling entry" in line and name:
            key = kernel_key(name)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if key and spill and spill.groups() != ("0", "0"):
            found[key] = "/".join(spill.groups())
    return found


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--all"]
    folders = [Path(f) for f in (args[0].split(",") if args else ["litquant/csrc/marlin"])]
    results = defaultdict(dict)
    with tempfile.TemporaryDirectory() as work:
        for i, folder in enumerate(folders):
            sass, report = compile_folder(folder, Path(work) / f"{i}.o")
            spilled = spills(report)
            for key, lengths in main_loops(sass).items():
                spill = f" (spills {spilled[key]})" if key in spilled else ""
                results[key][folder] = " ".join(map(str, lengths)) + spill
    print("| dtype | rows | group rows | zero points | k splits | " + " | ".join(map(str, folders)) + " |")
    print("|---|---:|---:|---|---|" + "---|" * len(folders))
    for key in sorted(results):
        if "--all" in sys.argv or key[2] == 1:
            dtype, rows, group_rows, zeros, splits = key
            print(f"| {dtype} | {rows} | {group_rows} | {'yes' if zeros else 'no'} | {'yes' if splits else 'no'} | "
                  + " | ".join(results[key].get(f, "-") for f in folders) + " |")


if __name__ == "__main__":
    main()
