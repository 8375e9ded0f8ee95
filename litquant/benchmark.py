"""`litquant benchmark`: one table of what each quantization method and kernel costs and gains, against the two
baselines a LitGPT user already has: the unquantized model and bitsandbytes nf4.

The checkpoint (SmolLM2-135M-Instruct by default, fetched and converted on first use) is quantized once per method
and loaded once per kernel. Each row is one way of running the model: how long quantizing took, how long loading takes
(reading the checkpoint and repacking it for the kernel; bnb.nf4 quantizes as it loads), the size on disk, the
weights' memory once loaded, the decode speed of `litquant generate` on one prompt, the perplexity on held-out
text, and the greedy answer. Calibration and evaluation text are disjoint slices of Debian's Jargon File unless files
are given.
"""
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Literal, Optional

import torch

from litquant.assets import JARGON_FILE, calibration_text, evaluation_text, smollm2_checkpoint
from litquant.checkpoint import check_writable
from litquant.config import QuantizeConfig
from litquant.generate import decode, prepare_decoding
from litquant.kernels import REGISTRY, KernelNotSupported, kernel_class, resolve_device
from litquant.load import BNB_MODES, checkpoint_config, load_model, parse_rtn
from litquant.perplexity import check_window_fits, check_windows, compute_perplexity, encode_start, read_text


@dataclass
class Row:
    """One way of running the model. `note` holds the answer, or why this row could not run."""
    model: str
    kernel: str
    quantize_seconds: Optional[float] = None
    load_seconds: Optional[float] = None
    disk_mib: Optional[float] = None
    memory_mib: Optional[float] = None
    tokens_per_s: Optional[float] = None
    perplexity: Optional[float] = None
    note: str = ""


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights the model holds (parameters and buffers, KV cache excluded)."""
    tensors = {id(t): t for n, t in list(model.named_parameters()) + list(model.named_buffers())
               if ".kv_cache." not in n and n != "mask_cache"}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def disk_mib(checkpoint_dir: Path) -> float:
    return sum(f.stat().st_size for f in Path(checkpoint_dir).glob("lit_model.*")) / 2**20


def measure(checkpoint_dir: Path, *, kernel: Optional[str] = None, quantize: Optional[str] = None, prompt: str,
            max_new_tokens: int, evaluation: Optional[str], window: int, max_windows: Optional[int], compile: bool,
            precision: Optional[str], device: Optional[str]) -> Row:
    """Load `checkpoint_dir` as asked, answer `prompt` greedily (timed after 4 untimed tokens, which pay a process's
    one-time costs and, with `compile`, the compilation), and score `evaluation`."""
    loaded = load_model(checkpoint_dir, kernel=kernel, quantize=quantize, precision=precision, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    encoded = prepare_decoding(loaded, checkpoint_dir, prompt, max_new_tokens, compile,
                               cache_positions=window if evaluation else 0)
    with torch.inference_mode():
        for _ in decode(model, encoded, min(max_new_tokens, 4), temperature=0.0):  # the step compiles at token 2
            pass
        start = time.perf_counter()
        answer = [t for run in decode(model, encoded, max_new_tokens, eos_id=tokenizer.eos_id, temperature=0.0)
                  for t in run]
        seconds = time.perf_counter() - start
        model.clear_kv_cache()
        perplexity = None
        if evaluation:
            tokens = encode_start(tokenizer, evaluation, None if max_windows is None else max_windows * window)
            perplexity = compute_perplexity(model, tokens, window=window, max_windows=max_windows)[0]
    text = tokenizer.decode(torch.tensor(answer)).strip().replace("\n", " ").replace("|", "/")  # one table cell
    row = Row(loaded.quantization, loaded.kernel or ("bitsandbytes" if quantize else "-"),
              load_seconds=loaded.load_seconds, memory_mib=model_bytes(model) / 2**20, tokens_per_s=len(answer) / seconds, perplexity=perplexity,
              note=text)
    print(f"{row.model} ({row.kernel}): {row.tokens_per_s:.1f} tokens/s, perplexity "
          f"{'-' if perplexity is None else f'{perplexity:.3f}'}", file=sys.stderr)
    return row


def format_table(rows: List[Row]) -> str:
    """The rows as a Markdown table; speed and perplexity also relative to the first row (by default the unquantized
    model)."""
    base = rows[0]

    def number(value: Optional[float], digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def speed(r: Row) -> str:
        relative = r is not base and r.tokens_per_s and base.tokens_per_s
        return number(r.tokens_per_s, 1) + (f" ({r.tokens_per_s / base.tokens_per_s:.2f}x)" if relative else "")

    def perplexity(r: Row) -> str:
        relative = r is not base and r.perplexity and base.perplexity
        return number(r.perplexity, 3) + (f" ({(r.perplexity / base.perplexity - 1) * 100:+.1f}%)" if relative else "")

    header = ["model", "kernel", "quantize s", "load s", "disk MiB", "memory MiB", "tokens/s", "perplexity", "answer"]
    cells = [[r.model, r.kernel, number(r.quantize_seconds, 1), number(r.load_seconds, 1), number(r.disk_mib, 1),
              number(r.memory_mib, 1), speed(r), perplexity(r), r.note[:60]] for r in rows]
    widths = [max(len(line[i]) for line in cells + [header]) for i in range(len(header))]
    lines = [header, ["-" * w for w in widths]] + cells
    return "\n".join("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines)


def save_rows(rows: List[Row], out_dir: Path) -> None:
    """Write benchmark.json and benchmark.md, each through a temporary file and a rename: after every row, so that an
    interrupted run keeps the rows it finished and never leaves a half-written file."""
    for name, text in (("benchmark.json", json.dumps([asdict(r) for r in rows], indent=1)),
                       ("benchmark.md", format_table(rows) + "\n")):
        partial = out_dir / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, out_dir / name)


def quantize_config(method: str, bits: int, group_size: int) -> QuantizeConfig:
    """litquant's recommended settings for `method`, as the table runs it: GPTQ with act_order, AWQ with zero points."""
    return QuantizeConfig.for_method(method, bits=bits, group_size=group_size, desc_act=method == "gptq")


def check_benchmark_out_dir(out_dir: Path) -> None:
    """An `--out_dir` must be new, empty, or an earlier benchmark's (it has benchmark.json), whose files it replaces."""
    check_writable(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "benchmark.json").is_file():
        raise FileExistsError(f"{out_dir} holds files and is not an earlier benchmark's --out_dir (it has no "
                              "benchmark.json), whose files the benchmark would replace; choose another --out_dir")


def benchmark(
    checkpoint_dir: Optional[Path] = None,
    *,
    methods: List[Literal["rtn", "gptq", "awq"]] = ["rtn", "gptq", "awq"],
    kernels: List[str] = ["auto"],
    baselines: List[str] = ["unquantized", "bnb.nf4"],
    bits: int = 4,
    group_size: int = 64,
    calibration_file: Optional[Path] = None,
    num_samples: int = 32,
    seq_len: int = 512,
    text_file: Optional[Path] = None,
    window: int = 512,
    max_windows: Optional[int] = 16,
    prompt: str = "What is a hacker?",
    max_new_tokens: int = 64,
    compile: bool = False,
    precision: Optional[str] = None,
    device: Optional[str] = None,
    out_dir: Optional[Path] = None,
) -> List[Row]:
    """Print one table of each quantization method and kernel against the unquantized model and bnb.nf4.

    The checkpoint is quantized with each method and run with each kernel. Each row: quantize time, load time (with
    the repacking for the kernel; a CUDA kernel's first use in a fresh cache also builds it), size on disk, weight
    memory, decode tokens/s, perplexity on held-out text and the greedy answer to one prompt.

    Args:
        checkpoint_dir: a litgpt checkpoint. Default: SmolLM2-135M-Instruct (fetched and converted on first use).
        methods: quantization methods, each with litquant's recommended settings (gptq: act_order; awq: zero points).
        kernels: kernels each quantized checkpoint runs with; "all" for every registered kernel (a row says why one
            cannot run here).
        baselines: "unquantized" and/or bitsandbytes modes (bnb.nf4, bnb.fp4, ...).
        bits: bits per weight (AWQ: 4).
        group_size: input channels per scale (SmolLM2's width, 576, is not a multiple of 128).
        calibration_file: text to calibrate gptq and awq on. Default: the Jargon File's calibration slice if
            jargon-text is installed, else text the model writes itself.
        num_samples: calibration sequences.
        seq_len: tokens per calibration sequence.
        text_file: held-out text for perplexity. Default: the Jargon File's evaluation slice if installed, else none.
        window: tokens per perplexity window.
        max_windows: perplexity windows scored (the first of the text); null: all of them; 0: no perplexity.
        prompt: the question each row answers greedily.
        max_new_tokens: tokens per answer (the tokens/s are over these, prompt included in the time).
        compile: decode with the compiled one-token step (`litquant generate --compile`), timed after compiling.
        precision: bf16-true, 16-true or 32-true. Default: bf16-true on a GPU that has bf16 (else 16-true), 32-true
            on the CPU.
        device: cuda, cuda:<index> or cpu. Default: cuda (the current GPU) if available.
        out_dir: keep the quantized checkpoints there and write benchmark.json and benchmark.md, updated after each
            row. It must be new, empty, or an earlier run's (whose files it replaces). Default: a temporary
            directory, removed at the end.
    """
    from litquant.quantize.main import check_quantizable, quantize

    if max_windows is not None and max_windows < 0:
        raise ValueError(f"max_windows must be 0 (no perplexity), positive, or null (every window), not {max_windows}")
    if max_windows != 0:
        check_windows(window, max_windows)
    kernels = list(dict.fromkeys(k for name in kernels for k in (REGISTRY if name == "all" else [name])))
    for kernel in set(kernels) - {"auto"}:
        kernel_class(kernel)  # an unknown name fails here, before any quantizing

    for baseline in baselines:
        if baseline != "unquantized" and baseline not in BNB_MODES:
            parse_rtn(baseline)  # raises the error that lists the valid choices
    if out_dir:
        check_benchmark_out_dir(Path(out_dir))
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else smollm2_checkpoint()
    if max_windows != 0:
        check_window_fits(window, checkpoint_config(checkpoint_dir).block_size)
    for method in methods:  # each method's settings, before the first row (a kernel that cannot run one has a row)
        check_quantizable(checkpoint_dir, quantize_config(method, bits, group_size))
    jargon = JARGON_FILE.is_file()
    evaluation = None
    if max_windows != 0 and (text_file or jargon):
        evaluation = read_text(text_file) if text_file else evaluation_text()
    with tempfile.TemporaryDirectory(prefix="litquant-benchmark-") as tmp:
        work_dir = Path(out_dir or tmp)
        work_dir.mkdir(parents=True, exist_ok=True)
        if calibration_file is None and jargon and set(methods) - {"rtn"}:
            calibration_file = work_dir / "calibration.txt"
            calibration_file.write_text(calibration_text())
        run = dict(prompt=prompt, max_new_tokens=max_new_tokens, evaluation=evaluation, window=window,
                   max_windows=max_windows, compile=compile, precision=precision, device=device)
        rows: List[Row] = []

        def add(row: Row) -> None:
            rows.append(row)
            if out_dir:
                save_rows(rows, work_dir)

        for baseline in baselines:
            quantize_mode = None if baseline == "unquantized" else baseline
            if quantize_mode and quantize_mode.startswith("bnb") and importlib.util.find_spec("bitsandbytes") is None:
                add(Row(baseline, "bitsandbytes", note="bitsandbytes not installed (pip install litquant[bnb])"))
                continue
            row = measure(checkpoint_dir, quantize=quantize_mode, **run)
            if quantize_mode is None:
                row.model, row.disk_mib = f"unquantized ({row.model})", disk_mib(checkpoint_dir)
            add(row)
        for method in methods:
            quantized_dir = work_dir / f"{checkpoint_dir.name}-{method}{bits}-g{group_size}"
            start = time.perf_counter()
            config = quantize_config(method, bits, group_size)
            quantize(checkpoint_dir, quantized_dir, method=method, bits=bits, group_size=group_size,
                     desc_act=config.desc_act, calibration_file=calibration_file, num_samples=num_samples,
                     seq_len=seq_len, device=device, overwrite=True)
            seconds = time.perf_counter() - start
            for kernel in kernels:
                try:
                    row = measure(quantized_dir, kernel=kernel, **run)
                except KernelNotSupported as e:
                    row = Row(QuantizeConfig.load(quantized_dir).describe(), kernel, note=f"cannot run: {e}")
                row.quantize_seconds, row.disk_mib = seconds, disk_mib(quantized_dir)
                add(row)
        table = format_table(rows)
        device_name = resolve_device(device)
        print(f"\n{checkpoint_dir.name} on {device_name}; prompt: {prompt!r}; perplexity: "
              f"{('Jargon File evaluation slice' if not text_file else text_file) if evaluation else 'not measured'}\n")
        print(table)
    return rows
