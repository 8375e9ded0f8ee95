"""Quantized checkpoints on disk: save them atomically, load them with every check a user needs.

A quantized checkpoint is a directory with
  lit_model.safetensors   every tensor under its LitGPT name; a quantized Linear `x` has `x.qweight`,
                          `x.qzeros`, `x.scales` (+ `x.g_idx` for GPTQ, + `x.bias`) in its format's layout,
                          everything else (embeddings, norms, `lm_head`) in the model dtype
  quantize_config.json    `QuantizeConfig`, in AutoGPTQ / AutoAWQ field names
  model_config.yaml       litgpt's Config
  tokenizer files         copied from the source checkpoint, with its BOS decision written down (`pin_add_bos_token`)
It is written into a temporary directory beside the target and renamed into place at the end, so an
interrupted run never leaves something that looks complete; replacing an earlier one (`--overwrite`) holds off
Ctrl-C until the new one is in its place.
"""
import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import torch
from litgpt.config import Config
from litgpt.model import GPT
from litgpt.scripts.convert_hf_checkpoint import qkv_reassemble
from litgpt.tokenizer import Tokenizer
from litgpt.utils import save_config
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from litquant.config import CONFIG_NAME, QuantizeConfig, is_quantized_checkpoint
from litquant.formats import QuantizedWeight
from litquant.kernels.base import QuantLinear
from litquant.quantize.quantizer import rtn_quantize

WEIGHTS_NAME = "lit_model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json",
                   "prompt_style.yaml", "special_tokens_map.json")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, corrupt, or does not match its config."""


def pin_add_bos_token(checkpoint_dir: Path, use_bos: bool) -> None:
    """Write `use_bos` into the checkpoint's tokenizer_config.json as `add_bos_token`.

    litgpt's Tokenizer takes that flag from the file, except for some model families, where the directory's name
    decides (`SmolLM2-*-Instruct` and Llama 3 directories add BOS: `Tokenizer.check_if_bos_token_used`). Where it
    adds none, it also drops a BOS that the text starts with, such as the `<|im_start|>` that SmolLM2's prompt
    template begins with. With the flag pinned, a checkpoint tokenizes the same under any directory name: a quantized
    one as its source, a converted one as litgpt's download of that model.
    """
    path = Path(checkpoint_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("add_bos_token") != use_bos:
        config["add_bos_token"] = use_bos
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def check_writable(out_dir: Path) -> None:
    """Refuse an output directory that could not be created or filled, before any work: a file where it or one of
    its parents should be, or a first existing parent that is not writable (results are written beside it first)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} exists and is not a directory; choose another --out_dir")
    parent = out_dir.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise FileExistsError(f"cannot create {out_dir}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {out_dir}: {parent} is not writable")


def sync_to_disk(directory: Path) -> None:
    """Flush a finished directory's files, and the directory, to the disk before it is renamed into place: after a
    power loss the rename may survive where unflushed contents would not, and a complete-looking checkpoint would hold
    empty files."""
    for path in [*Path(directory).iterdir(), Path(directory)]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def signals_deferred():
    """Ctrl-C (SIGINT) and SIGTERM wait until the block is done, so that a few renames that must happen together do;
    then the first of them gets its usual handling. (Python handlers, not a signal mask: a process-directed signal
    goes to any thread that does not block it, and Python runs its handler in the main thread all the same.)"""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    received = []
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        if received:
            handler = previous[received[0]]
            if callable(handler):
                handler(received[0], None)  # SIGINT's default: KeyboardInterrupt
            elif handler in (signal.SIG_DFL, None):
                signal.raise_signal(received[0])  # e.g. SIGTERM's default: the process ends


def check_out_dir(out_dir: Path, overwrite: bool) -> None:
    """Refuse an `out_dir` that cannot be written, or that holds files, unless `overwrite` and it is a quantized
    checkpoint: `--overwrite` replaces an earlier result, never a directory of other files, nor an unquantized
    checkpoint."""
    out_dir = Path(out_dir)
    check_writable(out_dir)
    if not out_dir.exists() or not any(out_dir.iterdir()):
        return
    if not (out_dir / CONFIG_NAME).is_file():
        raise FileExistsError(f"{out_dir} already exists and is not a quantized checkpoint (it has no {CONFIG_NAME}), "
                              "which --overwrite never replaces; choose another --out_dir")
    if not overwrite:
        raise FileExistsError(f"{out_dir} already exists and is not empty; pass --overwrite true or choose another "
                              "--out_dir")


def save_quantized_checkpoint(out_dir: Path, quantized: Dict[str, QuantizedWeight], other_tensors: Dict[str, torch.Tensor],
                              config: QuantizeConfig, model_config: Config, tokenizer_dir: Optional[Path],
                              overwrite: bool = False) -> Path:
    """Pack `quantized` in `config`'s format and write the checkpoint directory atomically."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir, overwrite)
    tensors: Dict[str, torch.Tensor] = {}
    for name, qw in quantized.items():
        for key, t in config.pack(qw.to("cpu")).items():
            tensors[f"{name}.{key}"] = t.contiguous()
    for name, t in other_tensors.items():
        tensors[name] = t.detach().to("cpu").contiguous()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.incomplete-{os.getpid()}-{int(time.time())}"
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "litquant": "1"})
        save_config(model_config, tmp)
        # safetensors (0.8) creates its file readable by its owner only: give it the other files' permissions
        os.chmod(tmp / WEIGHTS_NAME, (tmp / "model_config.yaml").stat().st_mode & 0o777)
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / fname).is_file():
                    shutil.copy2(Path(tokenizer_dir) / fname, tmp / fname)
            if (tmp / "tokenizer_config.json").is_file():
                pin_add_bos_token(tmp, Tokenizer(tokenizer_dir).use_bos)
        config.save(tmp)  # last: its presence marks a finished checkpoint
        sync_to_disk(tmp)
        with signals_deferred():  # never the earlier result moved away and the new one not yet in its place
            if out_dir.exists():
                old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
                out_dir.rename(old)
                tmp.rename(out_dir)
                shutil.rmtree(old)
            else:
                tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def open_weights(checkpoint_dir: Path, device: torch.device):
    """safetensors handle of the checkpoint's weights, with clear errors for missing or corrupt files."""
    path = Path(checkpoint_dir) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path} not found: the checkpoint is missing its weights")
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is corrupt or truncated ({e})") from None


def _read(handle, name: str, path: Path) -> torch.Tensor:
    try:
        return handle.get_tensor(name)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e}); the file is corrupt or truncated") from None


@torch.no_grad()
def load_quantized_checkpoint(model: torch.nn.Module, checkpoint_dir: Path, config: QuantizeConfig,
                              device: torch.device, dtype: torch.dtype) -> None:
    """Fill `model` (built on meta, Linears already swapped by `QuantizedPrecision`) from a quantized checkpoint.

    Every tensor name, shape and dtype is checked against the model and `config` first; the error lists
    exactly what is missing, unexpected or mis-shaped.
    """
    path = Path(checkpoint_dir) / WEIGHTS_NAME
    device = torch.device(device)
    with open_weights(checkpoint_dir, "cpu") as f:
        names = set(f.keys())
        quant_modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
        plain = {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers(remove_duplicate=False))
                 if not any(n.startswith(q + ".") for q in quant_modules) and n not in ("cos", "sin")
                 and ".kv_cache." not in n and n != "mask_cache"}
        problems, expected = [], set(plain)
        for qname, m in quant_modules.items():
            shapes = {}
            for key in config.tensor_names():
                full = f"{qname}.{key}"
                expected.add(full)
                if full in names:
                    sl = f.get_slice(full)
                    shapes[key] = _MetaTensor(tuple(sl.get_shape()), _st_dtype(sl.get_dtype()))
            try:
                config.check_shapes(shapes, m.in_features, m.out_features, where=f"{qname}.")
            except ValueError as e:
                problems.append(str(e))
            if m.bias is not None:
                expected.add(f"{qname}.bias")
        missing, unexpected = sorted(expected - names), sorted(names - expected)
        if missing:
            problems.insert(0, f"missing tensors: {_short(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_short(unexpected)}")
        for n, t in plain.items():
            if n in names:
                shape = tuple(f.get_slice(n).get_shape())
                if shape != tuple(t.shape):
                    problems.append(f"{n} has shape {list(shape)}, the model expects {list(t.shape)}")
        if problems:
            raise CheckpointError(f"{path} does not match model_config.yaml / quantize_config.json: "
                                  + _short(problems, 4, "; "))

        for qname, m in quant_modules.items():
            tensors = {key: _read(f, f"{qname}.{key}", path).to(device)
                       for key in config.tensor_names() + (("bias",) if m.bias is not None else ())}
            m.load_quantized(config.unpack(tensors, m.in_features, m.out_features))
        state = {n: _read(f, n, path).to(device, dtype if _read_is_float(f, n) else None) for n in plain}
    model.load_state_dict(state, strict=False, assign=True)
    materialize_rope(model, device)
    check_materialized(model)


def load_with_rtn(model: torch.nn.Module, state: Iterator[Tuple[str, torch.Tensor]], config: QuantizeConfig,
                  device: torch.device, dtype: torch.dtype) -> None:
    """Fill `model` (Linears swapped) from full-precision weights, quantizing each Linear with RTN as it
    loads: only one full-precision Linear is materialized at a time."""
    quant_modules = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    rest = {}
    for name, tensor in state:
        module_name, _, key = name.rpartition(".")
        m = quant_modules.get(module_name)
        if m is not None and key == "weight":
            m.load_quantized(rtn_quantize(tensor.to(device, torch.float32), config.bits, config.group_size, config.sym))
        elif m is not None and key == "bias":
            m.set_bias(tensor.to(device))
        else:
            rest[name] = tensor.to(device, dtype if tensor.is_floating_point() else None)
    _, unexpected = model.load_state_dict(rest, strict=False, assign=True)
    if unexpected:
        raise CheckpointError(f"checkpoint has tensors the model does not: {_short(unexpected)}")
    materialize_rope(model, device)
    check_materialized(model)


def check_materialized(model: torch.nn.Module) -> None:
    """Raise if any parameter or buffer is still on the meta device (it was never loaded)."""
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise CheckpointError(f"checkpoint is missing tensors: {_short(left)}")


def materialize_rope(model: torch.nn.Module, device: torch.device) -> None:
    """The rope tables were built on meta with the model; rebuild them on the real device."""
    if hasattr(model, "rope_cache"):
        model.cos, model.sin = model.rope_cache(device=device)


class _MetaTensor:
    def __init__(self, shape: tuple, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


_ST_DTYPES = {"I32": torch.int32, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
              "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8}


def _st_dtype(name: str) -> Optional[torch.dtype]:
    return _ST_DTYPES.get(name)


def _read_is_float(handle, name: str) -> bool:
    return _st_dtype(handle.get_slice(name).get_dtype()) in (torch.float16, torch.bfloat16, torch.float32)


def _short(names, limit: int = 6, separator: str = ", ") -> str:
    names = list(names)
    return separator.join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "") if names else "none"


def load_litgpt_state(checkpoint_dir: Path, config: Optional[Config] = None) -> Dict[str, torch.Tensor]:
    """The memory-mapped state dict of an ordinary litgpt checkpoint (`lit_model.pth`); with `config`, checked to
    hold every tensor of that model in its shape, and nothing else, before anything is computed from it."""
    path = Path(checkpoint_dir) / "lit_model.pth"
    if not path.is_file():
        hint = ""
        if (Path(checkpoint_dir) / WEIGHTS_NAME).is_file():
            hint = (" (it is a quantized checkpoint)" if is_quantized_checkpoint(checkpoint_dir) else
                    f" (it has {WEIGHTS_NAME} but no quantize_config.json: a quantized checkpoint that lost its config)")
        raise CheckpointError(f"{path} not found: {checkpoint_dir} is not a litgpt checkpoint{hint}")
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises several types for truncated/corrupt zips
        raise CheckpointError(f"{path} is corrupt or truncated ({type(e).__name__}: {e})") from None
    state = state.get("model", state)
    if config is not None:
        for legacy in [name for name in state if name.endswith((".attn.attn.weight", ".attn.attn.bias"))]:
            # litgpt < 0.5.5 kept the heads' q, k and v interleaved under `attn.attn`; litgpt's own loader converts
            # them as here, and converted here every litquant path reads them (in memory, no longer memory-mapped)
            current = legacy.replace(".attn.attn.", ".attn.qkv.")
            state[current] = qkv_reassemble(state.pop(legacy), config)
        with torch.device("meta"):
            expected = GPT(config).state_dict()
        problems = []
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing:
            problems.append(f"missing tensors: {_short(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_short(unexpected)}")
        problems += [f"{name} has shape {list(state[name].shape)}, the model expects {list(tensor.shape)}"
                     for name, tensor in expected.items() if name in state and state[name].shape != tensor.shape]
        if problems:
            raise CheckpointError(f"{path} does not match model_config.yaml: " + _short(problems, 4, "; "))
    return state
