"""`litquant`: every `litgpt` command, unchanged, plus litquant's own.

litgpt builds its CLI from a fixed dict with no plugin hook, and a second package installing a `litgpt`
script would overwrite litgpt's own, so litquant is a superset under its own name. `generate`, `chat` and
`serve` are litquant's versions: they also load quantized checkpoints, and plain ones as before.
"""
import os
import sys
import warnings

import torch
from jsonargparse import CLI, set_parsing_settings
from litgpt.__main__ import PARSER_DATA as LITGPT_COMMANDS

from litquant.benchmark import benchmark
from litquant.demo import demo
from litquant.generate import chat, generate
from litquant.gguf import convert_gguf_to_litgpt
from litquant.kernels import kernels
from litquant.kernels.build import BuildError
from litquant.perplexity import perplexity
from litquant.quantize.main import quantize
from litquant.serve import serve

COMMANDS = {
    **LITGPT_COMMANDS,
    "quantize": quantize,
    "generate": generate,
    "chat": chat,
    "serve": serve,
    "perplexity": perplexity,
    "convert_gguf_to_litgpt": convert_gguf_to_litgpt,
    "kernels": kernels,
    "demo": demo,
    "benchmark": benchmark,
}

# What litquant raises for bad input or a machine that cannot do what was asked, each with a message for the user:
# ValueError (CheckpointError, KernelNotSupported), OSError (missing files, no network), FloatingPointError (NaN or
# inf in weights or calibration activations), LinAlgError (a Hessian that no dampening makes positive definite),
# BuildError (no CUDA compiler, a failed build), ImportError (an optional package missing, e.g. serve's LitServe).
USER_ERRORS = (ValueError, OSError, FloatingPointError, torch.linalg.LinAlgError, BuildError, ImportError)


def main() -> None:
    set_parsing_settings(docstring_parse_attribute_docstrings=True, config_read_mode_urls_enabled=False)
    warnings.filterwarnings("ignore", message=r".*The epoch parameter in `scheduler.step\(\)`.*")
    torch.set_float32_matmul_precision("high")
    try:
        CLI(COMMANDS, description="litgpt's commands, plus GPTQ, AWQ and RTN quantization (quantize), quantized "
                                  "checkpoints in generate, chat, serve and perplexity, and fast kernels for them.")
    except USER_ERRORS as e:
        # Bad input (a missing or corrupt checkpoint, a kernel that cannot run it, an out_dir in the way, ...): its
        # message is written for the user, so one line says it, not a traceback.
        if os.environ.get("LITQUANT_TRACEBACK"):
            raise
        sys.exit(f"litquant: error: {e}\n({type(e).__name__}; LITQUANT_TRACEBACK=1 shows where it was raised)")


if __name__ == "__main__":
    main()
