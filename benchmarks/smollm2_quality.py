"""Quality of each quantization recipe on the real model: the tables of `tutorials/quantize.md`.

    python benchmarks/smollm2_quality.py --out_dir benchmarks/results/smollm2_quality

SmolLM2-135M-Instruct (`litquant.assets`), group size 64 (its width, 576, is not a multiple of 128). Each variant is
quantized by `litquant quantize` (the CLI's function) and scored by `litquant perplexity` (the CLI's function) on
the first 16 windows of 512 tokens of the Jargon File's evaluation slice, as `litquant benchmark` scores its rows
(`litquant perplexity <checkpoint> --max_windows 16`). GPTQ and AWQ calibrate on the calibration slice (GPTQ 16, AWQ
8 samples of 512 tokens), or on text the model writes itself where the variant says so. Rows are written to
`smollm2_quality.json` as they finish.
"""
import json
import time
from pathlib import Path
from typing import Dict, List, Optional

# name -> `quantize` options (None: the unquantized checkpoint; a string: `perplexity`'s --quantize)
VARIANTS: Dict[str, Optional[object]] = {
    "full precision": None,
    "bnb.nf4": "bnb.nf4",
    "RTN 4-bit sym": dict(method="rtn", bits=4, sym=True),
    "GPTQ 4-bit, no act_order": dict(method="gptq", bits=4, desc_act=False),
    "GPTQ 4-bit, act_order": dict(method="gptq", bits=4, desc_act=True),
    "GPTQ 4-bit, act_order, static_groups": dict(method="gptq", bits=4, desc_act=True, static_groups=True),
    "GPTQ 4-bit, act_order, self-generated calibration": dict(method="gptq", bits=4, desc_act=True,
                                                               calibration_file=None),
    "RTN 3-bit sym": dict(method="rtn", bits=3, sym=True),
    "GPTQ 3-bit, no act_order": dict(method="gptq", bits=3, desc_act=False),
    "GPTQ 3-bit, act_order": dict(method="gptq", bits=3, desc_act=True),
    "RTN 4-bit zero-point": dict(method="rtn", bits=4, sym=False),
    "AWQ 4-bit, no clip": dict(method="awq", apply_clip=False),
    "AWQ 4-bit, with clip": dict(method="awq", apply_clip=True),
    "AWQ 4-bit, with clip, self-generated calibration": dict(method="awq", apply_clip=True, calibration_file=None),
}
NUM_SAMPLES = {"gptq": 16, "awq": 8}


def main(out_dir: Path, variants: Optional[List[str]] = None, max_windows: Optional[int] = 16,
         device: str = "cpu") -> List[Dict]:
    """Quantize SmolLM2 with each variant and score its perplexity.

    Args:
        out_dir: where the JSON and the quantized checkpoints (under `checkpoints/`) go.
        variants: the names of `VARIANTS` to run (default: all).
        max_windows: perplexity windows of 512 tokens scored (null: the whole evaluation slice).
        device: where to quantize and score.
    """
    from litquant import assets
    from litquant.perplexity import perplexity
    from litquant.quantize.main import quantize

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = assets.smollm2_checkpoint()
    calibration_file = out_dir / "calibration.txt"
    calibration_file.write_text(assets.calibration_text())
    evaluation_file = out_dir / "evaluation.txt"
    evaluation_file.write_text(assets.evaluation_text())
    rows = []
    for name in variants or list(VARIANTS):
        options = VARIANTS[name]
        start = time.perf_counter()
        if options is None or isinstance(options, str):
            checkpoint, quantize_seconds = source, 0.0
            ppl = perplexity(source, evaluation_file, quantize=options, max_windows=max_windows, device=device)
        else:
            options = {"group_size": 64, "calibration_file": calibration_file, **options}
            if options["method"] != "rtn":
                options.update(num_samples=NUM_SAMPLES[options["method"]], seq_len=512)
            checkpoint = out_dir / "checkpoints" / name.replace(" ", "").replace(",", "-")
            quantize(source, checkpoint, kernel="torch", device=device, overwrite=True, **options)
            quantize_seconds = time.perf_counter() - start
            ppl = perplexity(checkpoint, evaluation_file, max_windows=max_windows, device=device)
        rows.append({"variant": name, "perplexity": round(ppl, 3), "quantize_seconds": round(quantize_seconds, 1),
                     "options": {k: str(v) for k, v in (options if isinstance(options, dict) else {}).items()}})
        print(f"{name}: perplexity {ppl:.3f} (quantized in {quantize_seconds:.0f} s)", flush=True)
        (out_dir / "smollm2_quality.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
