"""The kernel benchmark (benchmarks/kernels.py) end to end on one small cell: every kernel asked for is timed, none
skipped (a harness error shows as a skipped cell, which is how a lost variable once went unnoticed)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.gpu
def test_gpu_kernel_benchmark_times_every_cell(tmp_path):
    script = Path(__file__).parent.parent / "benchmarks" / "kernels.py"
    command = [sys.executable, str(script), "--out-dir", str(tmp_path), "--shapes", "7B-qkv", "--m", "1,256",
               "--kernels", "marlin,torch,cublas", "--dtypes", "bf16", "--settle", "0.05"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "kernels.json").read_text())
    assert result["skipped"] == {}
    timed = {(row["kernel"], row["M"]) for row in result["rows"]}
    assert timed == {(kernel, m) for kernel in ("marlin", "torch", "cublas") for m in (1, 256)}
    assert all(row["us"] > 0 for row in result["rows"])
    assert "| 256 |" in (tmp_path / "kernels.md").read_text()


def test_own_times_split_the_busy_time_between_overlapping_kernels(monkeypatch):
    """e2e_decode's profile: a programmatic dependent (started during the kernel ahead, waiting in it) owns only what
    it adds after that kernel ends; the own times add up to the union of the intervals, and gaps are nobody's."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from e2e_decode import own_times

    primary, dependent, next_one, alone, inside = (0, 10), (2, 15), (15, 16), (20, 22), (21, 21.5)
    intervals = [dependent, alone, primary, inside, next_one]  # in no particular order
    assert own_times(intervals) == [5, 2, 10, 0, 1]
    assert sum(own_times(intervals)) == 10 + 5 + 1 + 2  # the union: 0-16 and 20-22
    assert own_times([(0, 3), (0, 5)]) == [0, 5]  # started together: the longer one owns the overlap
    assert own_times([]) == []


def test_profile_counts_every_litquant_kernel_as_a_quantized_matmul(monkeypatch):
    """e2e_decode's profile finds the quantized matmuls by kernel name: every CUDA kernel in litquant/csrc/ and every Triton
    program that the triton kernel launches must land there (a renamed kernel once fell out to "other")."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from e2e_decode import category

    from litquant.kernels import triton_programs, triton_wgmma

    from litquant.kernels.build import CSRC

    cuda_kernels = {name for source in CSRC.glob("*/*.cu")
                    for name in re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)",
                                           source.read_text())}
    triton_kernels = {program.fn.__name__ for program in (triton_programs.gemv_kernel, triton_programs.mma_kernel,
                                                          triton_programs.dequant_kernel, triton_wgmma._wgmma_kernel)}
    assert len(cuda_kernels) >= 5 and len(triton_kernels) == 4
    assert {name: category(name) for name in cuda_kernels | triton_kernels} == {
        name: "quantized matmul" for name in cuda_kernels | triton_kernels}
    assert category("triton_poi_fused_add_mul_0") == "Inductor fused"  # Inductor's own kernels stay apart


def test_real_model_benchmark_reads_generate_and_compares_its_texts(monkeypatch):
    """real_model_generate: the text and the last sample's rates from `litquant generate --num_samples 2`'s output, and
    the summary's comparisons (against the first kernel in the same mode, and against the run's own eager text)."""
    import subprocess as sp

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from real_model_generate import generated, summary

    stderr = "\n".join(["loaded q (gptq 4-bit g64, kernel marlin) in 1.00 s",
                        "sample 1: 4 tokens in 9.00 s, 0.44 tokens/s (first token after 8.000 s; the other 3 at 3.00 "
                        "tokens/s)",
                        "sample 2: 4 tokens in 0.10 s, 40.00 tokens/s (first token after 0.010 s; the other 3 at 33.33 "
                        "tokens/s)"])
    run = generated(sp.CompletedProcess([], 0, stdout="A hacker\nis.\n" * 2, stderr=stderr), 2)
    assert run["text"] == "A hacker\nis." and run["samples_agree"]
    assert run["tokens"] == 4 and run["tokens_per_s"] == 40 and run["first_token_s"] == 0.01
    assert run["after_first_tokens_per_s"] == 33.33  # the second sample's, after its first token
    with pytest.raises(RuntimeError, match="expected 2 'sample' lines"):
        generated(sp.CompletedProcess([], 0, stdout="x\n", stderr=stderr.splitlines()[1]), 2)

    def row(kernel, compile, text):
        return {"precision": "16-true", "kernel": kernel, "compile": compile, "text": text, "tokens": 4,
                "after_first_tokens_per_s": 1.0, "first_token_s": 0.1}
    table = summary({"generate": [row("torch", False, "abcd"), row("torch", True, "abxy"), row("marlin", False, "abcz"),
                                  row("marlin", True, "abxy")], "perplexity": []})
    lines = table.splitlines()
    assert lines[3].endswith("| - | first 2 characters the same |")  # torch compiled against torch eager
    assert lines[4].endswith("| first 3 characters the same | - |")  # marlin eager against torch eager
    assert lines[5].endswith("| same | first 2 characters the same |")  # marlin compiled: torch compiled's text


@pytest.mark.real_model
def test_smollm2_quality_table_scores_each_variant_as_litquant_perplexity_does(tmp_path, monkeypatch):
    """benchmarks/smollm2_quality.py (the tutorial's tables) on two cheap variants, one window: its rows are the
    numbers `litquant perplexity` prints for the same checkpoints."""
    from litquant import assets
    from litquant.perplexity import perplexity

    monkeypatch.syspath_prepend(str(Path(__file__).parent.parent / "benchmarks"))
    from smollm2_quality import main

    rows = main(tmp_path, variants=["full precision", "RTN 4-bit zero-point"], max_windows=1)
    assert [row["variant"] for row in rows] == ["full precision", "RTN 4-bit zero-point"]
    assert json.loads((tmp_path / "smollm2_quality.json").read_text()) == rows
    evaluation = tmp_path / "evaluation.txt"
    checkpoint = tmp_path / "checkpoints" / "RTN4-bitzero-point"
    assert rows[0]["perplexity"] == round(perplexity(assets.smollm2_checkpoint(), evaluation, max_windows=1), 3)
    assert rows[1]["perplexity"] == round(perplexity(checkpoint, evaluation, max_windows=1), 3)
    assert rows[0]["perplexity"] < rows[1]["perplexity"]
