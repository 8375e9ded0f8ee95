"""The kernel benchmark (benchmarks/kernels.py) end to end on one small cell: every kernel asked for is timed, none
skipped (a harness error shows as a skipped cell, which is how a lost variable once went unnoticed)."""
import json
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
