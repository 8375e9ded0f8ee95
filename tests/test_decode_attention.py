"""The decode-attention prototype (benchmarks/decode_attention.py) under the Triton interpreter on the CPU."""
import subprocess
import sys
from pathlib import Path


def test_decode_attention_prototype_matches_sdpa_without_reading_hidden_positions():
    script = Path(__file__).parent.parent / "benchmarks" / "decode_attention.py"
    done = subprocess.run([sys.executable, str(script), "--self-test"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("relative error") == 4 and "the same 60 greedy tokens" in done.stdout
