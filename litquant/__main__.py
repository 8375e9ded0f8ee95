"""`litquant`: every `litgpt` command, unchanged, plus litquant's own.

litgpt builds its CLI from a fixed dict with no plugin hook, and a second package installing a `litgpt`
script would overwrite litgpt's own, so litquant is a superset under its own name. `generate`, `chat` and
`serve` are litquant's versions: they also load quantized checkpoints, and plain ones as before.
"""
import functools
import inspect
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, List, Literal, NoReturn, Optional, get_args, get_origin

import torch
from jsonargparse import CLI, ArgumentParser, set_parsing_settings
from litgpt.__main__ import PARSER_DATA as LITGPT_COMMANDS

from litquant.benchmark import benchmark
from litquant.checkpoint import WEIGHTS_NAME
from litquant.config import is_quantized_checkpoint
from litquant.demo import demo
from litquant.generate import chat, generate
from litquant.gguf import convert_gguf_to_litgpt
from litquant.kernels import kernels
from litquant.kernels.build import BuildError
from litquant.perplexity import perplexity
from litquant.quantize.main import quantize
from litquant.serve import serve


def full_precision_only(name: str, command: Callable) -> Callable:
    """litgpt's command `name`, refusing a litquant checkpoint in any of its `*checkpoint_dir` arguments up front.

    litgpt's commands read `lit_model.pth`, which a quantized checkpoint does not have, and say so in their own words
    at best ("... is not a checkpoint directory", after looking under checkpoints/), or fail later. The command's
    signature and docstring stay litgpt's (`functools.wraps`), so its options and `--help` do not change."""
    signature = inspect.signature(command)
    checkpoint_arguments = [parameter for parameter in signature.parameters if parameter.endswith("checkpoint_dir")]

    @functools.wraps(command)
    def run(*args, **kwargs):
        given = signature.bind_partial(*args, **kwargs).arguments
        for argument in checkpoint_arguments:
            directory = given.get(argument)
            if directory and is_quantized_checkpoint(directory) and (Path(directory) / WEIGHTS_NAME).is_file():
                raise ValueError(f"{directory} is a litquant quantized checkpoint, and litgpt's `{name}` reads only "
                                 "full-precision ones (lit_model.pth); litquant runs quantized checkpoints in "
                                 "generate, chat, serve, perplexity and benchmark")
        return command(*args, **kwargs)

    return run


COMMANDS = {
    **{name: full_precision_only(name, command) for name, command in LITGPT_COMMANDS.items()},
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


def literal_choices(typehint: Any) -> List[Any]:
    """The values of the `Literal`s in a type hint, e.g. `List[Literal["rtn", "gptq"]]` -> `["rtn", "gptq"]`."""
    if get_origin(typehint) is Literal:
        return list(get_args(typehint))
    return [choice for arg in get_args(typehint) for choice in literal_choices(arg)]


class Parser(ArgumentParser):
    """jsonargparse's parser, naming the choices when a value is not one of a `Literal`'s.

    jsonargparse up to 4.41 (the newest that litgpt allows) answers a string outside an all-string `Literal`, e.g.
    `--method foo`, with "Cannot take a Union of no types.": it looks for a non-string type to try the string as next,
    and builds an empty Union. Each subcommand's parser is of the root parser's class, so this reaches all of them.
    """

    def error(self, message: str, ex: Optional[Exception] = None) -> NoReturn:
        key = re.match(r'Parser key "([^"]+)":\s*Cannot take a Union of no types', message)
        action = key and next((action for action in self._actions if action.dest == key.group(1)), None)
        choices = literal_choices(getattr(action, "_typehint", None))
        if choices:
            message = f'Parser key "{key.group(1)}": expected one of {", ".join(map(str, choices))}'
        super().error(message, ex)


def main() -> None:
    set_parsing_settings(docstring_parse_attribute_docstrings=True, config_read_mode_urls_enabled=False)
    warnings.filterwarnings("ignore", message=r".*The epoch parameter in `scheduler.step\(\)`.*")
    torch.set_float32_matmul_precision("high")
    try:
        CLI(COMMANDS, parser_class=Parser,
            description="litgpt's commands, plus GPTQ, AWQ and RTN quantization (quantize), quantized checkpoints in "
                        "generate, chat, serve and perplexity, and fast kernels for them.")
    except USER_ERRORS as e:
        # Bad input (a missing or corrupt checkpoint, a kernel that cannot run it, an out_dir in the way, ...): its
        # message is written for the user, so one line says it, not a traceback.
        if os.environ.get("LITQUANT_TRACEBACK"):
            raise
        sys.exit(f"litquant: error: {e}\n({type(e).__name__}; LITQUANT_TRACEBACK=1 shows where it was raised)")
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (outputs appear whole or not at all)
        if os.environ.get("LITQUANT_TRACEBACK"):
            raise
        print("\nlitquant: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
