"""`litquant benchmark`: the comparison table, on a tiny random litgpt checkpoint (the real model's run is
`test_real_model.py::test_demo_prints_its_table`)."""
import json
import math

import pytest

from litquant.benchmark import Row, benchmark, format_table


def test_benchmark_quantizes_each_method_and_runs_each_kernel(tiny_llama_checkpoint, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 30)
    rows = benchmark(tiny_llama_checkpoint, methods=["rtn", "gptq", "awq"], kernels=["all"], baselines=["unquantized"],
                     group_size=32, calibration_file=text, num_samples=4, seq_len=32, text_file=text, window=32,
                     max_windows=2, max_new_tokens=4, device="cpu", out_dir=tmp_path / "out")

    assert [(r.model.split()[0], r.kernel) for r in rows] == [("unquantized", "-")] + [
        (method, kernel) for method in ("rtn", "gptq", "awq") for kernel in ("marlin", "triton", "torch")]
    unquantized, quantized = rows[0], rows[1:]
    assert unquantized.model == "unquantized (float32)" and unquantized.quantize_seconds is None
    for row in quantized:
        assert row.quantize_seconds > 0 and 0 < row.disk_mib < unquantized.disk_mib
        if row.kernel == "marlin":  # CUDA only: the row says why, and the others still run
            assert row.note.startswith("cannot run: kernel 'marlin' cannot run this checkpoint on cpu")
            assert row.tokens_per_s is None and row.perplexity is None and row.load_seconds is None
        else:  # torch, and triton under TRITON_INTERPRET
            assert row.tokens_per_s > 0 and row.load_seconds > 0 and math.isfinite(row.perplexity) and row.note
            assert row.memory_mib < unquantized.memory_mib
    # the same settings, the same checkpoint: each kernel computes the same perplexity
    for method in ("rtn", "gptq", "awq"):
        triton, torch_ = (r.perplexity for r in quantized if r.model.startswith(method) and r.kernel != "marlin")
        assert triton == pytest.approx(torch_, rel=1e-3)
    assert [r.model.split()[1] for r in quantized[3:6]] == ["4-bit"] * 3 and "act_order" in quantized[3].model
    assert "zero-point" in quantized[6].model

    out = tmp_path / "out"
    assert json.loads((out / "benchmark.json").read_text())[0]["model"] == "unquantized (float32)"
    table = capsys.readouterr().out
    assert (out / "benchmark.md").read_text().strip() in table
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        f"{tiny_llama_checkpoint.name}-{m}4-g32" for m in ("awq", "gptq", "rtn")]


def test_benchmark_table_states_each_row_against_the_unquantized_model():
    rows = [Row("unquantized (bfloat16)", "-", disk_mib=500.0, memory_mib=300.0, tokens_per_s=40.0, perplexity=20.0,
                note="A hacker is"),
            Row("gptq 4-bit g64 sym act_order (gptq)", "marlin", 12.3, 0.8, 160.0, 150.0, 60.0, 21.0, "A hacker"),
            Row("bnb.nf4", "bitsandbytes", note="bitsandbytes not installed (pip install litquant[bnb])")]
    lines = format_table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == ["model", "kernel", "quantize s", "load s", "disk MiB", "memory MiB", "tokens/s", "perplexity",
                        "answer"]
    assert cells[2][6:8] == ["40.0", "20.000"]
    assert cells[3][2:8] == ["12.3", "0.8", "160.0", "150.0", "60.0 (1.50x)", "21.000 (+5.0%)"]
    assert cells[4][2:8] == ["-"] * 6 and cells[4][8].startswith("bitsandbytes not installed")


def test_benchmark_refuses_an_unknown_kernel_before_quantizing(tiny_llama_checkpoint, tmp_path):
    from litquant.kernels import KernelNotSupported

    with pytest.raises(KernelNotSupported, match="unknown kernel 'marlinn'; known kernels: marlin, triton, torch"):
        benchmark(tiny_llama_checkpoint, kernels=["torch", "marlinn"], device="cpu", out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_interrupted_benchmark_keeps_the_rows_it_finished(tiny_llama_checkpoint, tmp_path, monkeypatch):
    import litquant.quantize.main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(litquant.quantize.main, "quantize", interrupted)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        benchmark(tiny_llama_checkpoint, methods=["rtn"], kernels=["torch"], baselines=["unquantized"], max_windows=0,
                  max_new_tokens=4, device="cpu", out_dir=out)
    assert [r["model"] for r in json.loads((out / "benchmark.json").read_text())] == ["unquantized (float32)"]
    assert "unquantized (float32)" in (out / "benchmark.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["benchmark.json", "benchmark.md"]  # no partial file left


@pytest.mark.parametrize("options, error, message", [
    (dict(methods=["rtn", "awq"], bits=3), ValueError, "AWQ checkpoints are 4-bit only"),
    (dict(baselines=["unquantized", "bnb.foo"]), ValueError, "--quantize 'bnb.foo': expected one of"),
    (dict(group_size=0), ValueError, "group_size must be -1 or positive, not 0"),
])
def test_benchmark_checks_every_setting_before_its_first_row(tiny_llama_checkpoint, tmp_path, monkeypatch, options,
                                                              error, message):
    """A setting that fails one method or baseline fails the run before any row, not after the rows before it."""
    import litquant.benchmark

    monkeypatch.setattr(litquant.benchmark, "measure", lambda *_, **__: pytest.fail("a row ran"))
    with pytest.raises(error, match=message):
        benchmark(tiny_llama_checkpoint, **{"methods": ["rtn"], "kernels": ["torch"], "max_windows": 0, "device": "cpu",
                                            **options})


def test_benchmark_never_overwrites_files_of_its_out_dir_that_are_not_its_own(tiny_llama_checkpoint, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "calibration.txt").write_text("my notes")
    with pytest.raises(FileExistsError, match="holds files and is not an earlier benchmark's --out_dir"):
        benchmark(tiny_llama_checkpoint, methods=["rtn"], kernels=["torch"], device="cpu", out_dir=mine)
    assert [(p.name, p.read_text()) for p in mine.iterdir()] == [("calibration.txt", "my notes")]
    for _ in range(2):  # an earlier run's out_dir is replaced
        benchmark(tiny_llama_checkpoint, methods=["rtn"], kernels=["torch"], baselines=[], max_windows=0,
                  max_new_tokens=2, device="cpu", out_dir=tmp_path / "out")
    assert len(json.loads((tmp_path / "out" / "benchmark.json").read_text())) == 1
