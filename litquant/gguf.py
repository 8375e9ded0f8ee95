"""Import a GGUF file (llama.cpp's format) as a LitGPT checkpoint.

A GGUF file holds the model's hyperparameters and tokenizer as key/value metadata and its weights as
(possibly block-quantized) tensors. This module reads both with the `gguf` package, dequantizes the
weights, maps llama.cpp's tensor names to LitGPT's, and writes an ordinary LitGPT checkpoint directory
that every litgpt and litquant command can use (including `litquant quantize`).

Layout facts this converter relies on (from llama.cpp's `convert_hf_to_gguf.py` and the GGUF spec):
- A tensor's `ne` lists dimensions fastest-first, so a PyTorch `[out_features, in_features]` weight has
  `ne = [in_features, out_features]`; the numpy array is simply the reversed shape.
- llama.cpp rotates adjacent pairs of a head's dimensions (x0, x1), (x2, x3), ... while Hugging Face
  and LitGPT rotate the two halves of the head (x_i, x_{i + d/2}). Its converter therefore permutes the
  rows of `attn_q` (per query head) and `attn_k` (per key/value head):
  `w.reshape(heads, 2, d/2, in).swapaxes(1, 2)`. We apply the inverse permutation.
- With tied embeddings the file has no `output.weight`; the output head reuses `token_embd.weight`.
"""
import json
import os
import re
import shutil
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Optional

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from litgpt.config import Config, configs
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer
from litgpt.utils import save_config
from tqdm.auto import tqdm

from litquant.checkpoint import check_writable, pin_add_bos_token, sync_to_disk

SUPPORTED_TENSOR_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)

# GGUF name -> LitGPT name. `attn_q`, `attn_k` and `attn_v` are handled apart: LitGPT fuses them.
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSOR_NAMES = {
    "attn_norm.weight": "norm_1.weight",
    "attn_output.weight": "attn.proj.weight",
    "ffn_norm.weight": "norm_2.weight",
    "ffn_gate.weight": "mlp.fc_1.weight",
    "ffn_up.weight": "mlp.fc_2.weight",
    "ffn_down.weight": "mlp.proj.weight",
}
QKV_TENSOR_NAMES = ("attn_q.weight", "attn_k.weight", "attn_v.weight")

# Config fields that describe the computation. Two configs that agree on these run the same model;
# the rest (name, hf_config, block_size, padding_multiple) are labels or limits.
ARCHITECTURE_FIELDS = tuple(
    f.name for f in fields(Config) if f.name not in ("name", "hf_config", "block_size", "padding_multiple")
)

# GGUF's `tokenizer.ggml.pre` names the regex llama.cpp splits text with before BPE. We rebuild the
# ones we know with the `tokenizers` library; "smollm" is GPT-2's regex after splitting digits one
# by one (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM).
KNOWN_PRE_TOKENIZERS = ("default", "gpt-2", "smollm")
# Hugging Face's name of each special token -> the GGUF key holding its id.
SPECIAL_TOKEN_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                      "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def convert_gguf_to_litgpt(gguf_file: Path, out_dir: Path, model_name: Optional[str] = None) -> None:
    """Convert a llama-architecture GGUF file (llama.cpp's format) into a LitGPT checkpoint directory.

    Reads F32, F16, Q8_0, Q4_0 and Q4_1 tensors and dequantizes them. Writes `lit_model.pth` (float32,
    so the dequantized values are kept exactly: bfloat16 would round the Q4_1 values again),
    `model_config.yaml`, and a Hugging Face `tokenizer.json` with `tokenizer_config.json` and
    `generation_config.json` rebuilt from the GGUF tokenizer metadata (`add_bos_token` as litgpt decides it
    for the model's own checkpoints, whatever `out_dir` is called). The directory appears complete or not at all.

    Args:
        gguf_file: The GGUF file to read.
        out_dir: The checkpoint directory to create. It must not exist, or must be empty.
        model_name: The LitGPT config to use, e.g. "SmolLM2-135M-Instruct"; it must fit the GGUF metadata.
            By default, a LitGPT config is chosen whose architecture fits the metadata and whose name fits
            the file's name and metadata; when none does, a config is built from the metadata.
    """
    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    check_writable(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{str(out_dir)!r} already exists and is not an empty directory; refusing to overwrite it")
    reader = read_gguf(gguf_file)
    config = config_from_gguf(reader, model_name, file_name=gguf_file.name)
    state_dict = state_dict_from_gguf(reader, config)
    tokenizer_files = tokenizer_files_from_gguf(reader, config)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex}"
    tmp_dir = staging / config.name  # named as litgpt's download of the model, for its tokenizer's BOS decision
    tmp_dir.mkdir(parents=True)
    try:
        torch.save(state_dict, tmp_dir / "lit_model.pth")
        save_config(config, tmp_dir)
        for name, content in tokenizer_files.items():
            (tmp_dir / name).write_text(content, encoding="utf-8")
        pin_add_bos_token(tmp_dir, Tokenizer(tmp_dir).use_bos)
        sync_to_disk(tmp_dir)
        # rename(2) replaces an empty directory, and fails if another process filled it meanwhile.
        os.replace(tmp_dir, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {out_dir}: litgpt config {config.name!r}, {len(state_dict)} tensors")


def read_gguf(gguf_file: Path) -> GGUFReader:
    """Open a GGUF file, turning the reader's low-level failures into a clear error."""
    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(gguf_file)!r}")
    try:
        return GGUFReader(gguf_file)
    except Exception as error:  # the reader fails with ValueError, IndexError, ... on bad bytes
        raise ValueError(
            f"could not read GGUF file {str(gguf_file)!r}; is it truncated or corrupt?"
            f" ({type(error).__name__}: {error})"
        ) from error


def _metadata(reader: GGUFReader, key: str, default: Any = ...) -> Any:
    """The value of a metadata key; `default` when absent, or an error naming the key when no default is given."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise ValueError(f"the GGUF file has no {key!r} metadata")
        return default
    return field.contents()


def config_from_gguf(reader: GGUFReader, model_name: Optional[str] = None, file_name: str = "") -> Config:
    """The LitGPT config of the model in a GGUF file.

    Args:
        reader: The opened GGUF file.
        model_name: A LitGPT config name to use; an error lists the fields where it disagrees with the file.
        file_name: The GGUF file's name: a hint for choosing a LitGPT config when `model_name` is None.
    """
    built = _config_from_metadata(reader, name=Path(file_name).stem or _metadata(reader, "general.name", "gguf-model"))
    if model_name is not None:
        config = Config.from_name(model_name)
        mismatches = _architecture_mismatches(config, built)
        if mismatches:
            raise ValueError(f"the LitGPT config {model_name!r} does not fit the GGUF file: " + "; ".join(mismatches))
        return config
    return _matching_litgpt_config(reader, built, file_name) or built


def _config_from_metadata(reader: GGUFReader, name: str) -> Config:
    arch = _metadata(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only the 'llama' GGUF architecture is supported, this file has {arch!r}")
    scaling = _metadata(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"RoPE scaling {scaling!r} is not supported by this converter")
    n_embd = _metadata(reader, "llama.embedding_length")
    n_head = _metadata(reader, "llama.attention.head_count")
    head_size = _metadata(reader, "llama.attention.key_length", n_embd // n_head)
    rotary_dims = _metadata(reader, "llama.rope.dimension_count", head_size)
    if rotary_dims != head_size:
        raise ValueError(f"partial rotary embeddings ({rotary_dims} of {head_size} dims) are not supported")
    vocab_size = _metadata(reader, "llama.vocab_size", None)
    if vocab_size is None:
        vocab_size = len(_metadata(reader, "tokenizer.ggml.tokens"))
    rope_base = _shortest_float(_metadata(reader, "llama.rope.freq_base", 10000.0))
    return Config(
        name=name,
        block_size=_metadata(reader, "llama.context_length"),
        n_layer=_metadata(reader, "llama.block_count"),
        n_embd=n_embd,
        n_head=n_head,
        head_size=head_size,
        n_query_groups=_metadata(reader, "llama.attention.head_count_kv", n_head),
        vocab_size=vocab_size,
        padded_vocab_size=vocab_size,
        rotary_percentage=1.0,
        rope_base=int(rope_base) if rope_base.is_integer() else rope_base,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        norm_eps=_shortest_float(_metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        mlp_class_name="LLaMAMLP",
        intermediate_size=_metadata(reader, "llama.feed_forward_length"),
    )


def _shortest_float(value: float) -> float:
    """The float32 `value` as the shortest decimal that reads back as it (1e-5, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _architecture_mismatches(config: Config, expected: Config) -> List[str]:
    """'field: config has A, the file has B' for every architecture field where the two disagree."""
    mismatches = []
    for field in ARCHITECTURE_FIELDS:
        have, want = getattr(config, field), getattr(expected, field)
        if have != want:
            mismatches.append(f"{field}: config has {have!r}, the file has {want!r}")
    return mismatches


def _name_words(text: str) -> List[str]:
    # "SmolLM2-1.7B-Instruct.Q4_1" -> smollm2, 1.7b, instruct, q4, 1
    return re.findall(r"[a-z0-9]+(?:\.[0-9][a-z0-9]*)?", text.lower())


def _matching_litgpt_config(reader: GGUFReader, built: Config, file_name: str) -> Optional[Config]:
    """A LitGPT config with the file's architecture and every word of whose name the file mentions.

    The words come from the file name and the `general.*` metadata; a file with a chat template also
    counts as saying "instruct" and "chat". Among fitting configs the one with the most words wins
    (so "SmolLM2-135M-Instruct" beats "SmolLM2-135M" for an instruct model).
    """
    hints = [file_name]
    hints += [str(_metadata(reader, f"general.{key}", "")) for key in ("name", "basename", "size_label", "finetune")]
    if reader.get_field("tokenizer.chat_template") is not None:
        hints += ["instruct", "chat"]
    hint_words = set(_name_words(" ".join(hints)))
    candidates = [Config(**c) for c in configs]
    fitting = [
        c for c in candidates
        if not _architecture_mismatches(c, built) and set(_name_words(c.name)) <= hint_words
    ]
    return max(fitting, key=lambda c: len(_name_words(c.name)), default=None)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """A GGUF tensor as a float32 torch tensor in PyTorch's dimension order."""
    if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise ValueError(
            f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which is not supported"
            f" (supported: {supported})"
        )
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(reversed([int(n) for n in tensor.shape]))  # ne is fastest-first
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy: F32 data is a read-only memmap


def _undo_rope_permutation(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's Q/K row permutation: per head, interleaved pairs back to two halves."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def state_dict_from_gguf(reader: GGUFReader, config: Config) -> Dict[str, torch.Tensor]:
    """The LitGPT state dict (float32) of the llama-architecture model in a GGUF file."""
    tensors = {t.name: t for t in reader.tensors}
    gguf_names = set(tensors)
    expected = set(GLOBAL_TENSOR_NAMES) - {"output.weight"}
    expected |= {f"blk.{i}.{n}" for i in range(config.n_layer) for n in (*BLOCK_TENSOR_NAMES, *QKV_TENSOR_NAMES)}
    if missing := sorted(expected - gguf_names):
        raise ValueError(f"the GGUF file lacks tensors of a llama model: {', '.join(missing[:8])}")
    if unexpected := sorted(gguf_names - expected - {"output.weight"}):
        raise ValueError(f"the GGUF file has tensors this llama converter does not handle: {', '.join(unexpected[:8])}")

    state_dict = {lit: _dequantize(tensors[name]) for name, lit in GLOBAL_TENSOR_NAMES.items() if name in tensors}
    # Tied embeddings: the same tensor twice; torch.save stores its data once.
    state_dict.setdefault("lm_head.weight", state_dict["transformer.wte.weight"])
    for i in tqdm(range(config.n_layer), desc="dequantizing", unit="block", dynamic_ncols=True):
        prefix = f"transformer.h.{i}."
        for name, lit in BLOCK_TENSOR_NAMES.items():
            state_dict[prefix + lit] = _dequantize(tensors[f"blk.{i}.{name}"])
        q, k, v = (_dequantize(tensors[f"blk.{i}.{name}"]) for name in QKV_TENSOR_NAMES)
        q = _undo_rope_permutation(q, config.n_head)
        k = _undo_rope_permutation(k, config.n_query_groups)
        state_dict[prefix + "attn.qkv.weight"] = torch.cat([q, k, v])

    with torch.device("meta"):
        model_shapes = {k: v.shape for k, v in GPT(config).state_dict().items()}
    for key, shape in model_shapes.items():
        if state_dict[key].shape != shape:
            raise ValueError(
                f"{key} has shape {list(state_dict[key].shape)} in the GGUF file, the config needs {list(shape)}"
            )
    return state_dict


def tokenizer_files_from_gguf(reader: GGUFReader, config: Config) -> Dict[str, str]:
    """`tokenizer.json`, `tokenizer_config.json` and `generation_config.json` rebuilt from GGUF metadata.

    Only GPT-2 style byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported: vocabulary and merges
    go into a `tokenizers` BPE model with byte-level pre-tokenization and decoding; CONTROL and
    USER_DEFINED tokens become added tokens, so text never splits them (CONTROL ones are special).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"only GPT-2 style BPE tokenizers ('gpt2') are supported, the GGUF file has {kind!r}")
    pre = _metadata(reader, "tokenizer.ggml.pre", "default")
    if pre not in KNOWN_PRE_TOKENIZERS:
        raise ValueError(f"unknown GGUF pre-tokenizer {pre!r} (known: {', '.join(KNOWN_PRE_TOKENIZERS)})")
    tokens = _metadata(reader, "tokenizer.ggml.tokens")
    token_types = _metadata(reader, "tokenizer.ggml.token_type", [gguf.TokenType.NORMAL] * len(tokens))
    merges = [tuple(merge.split(" ")) for merge in _metadata(reader, "tokenizer.ggml.merges")]

    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([
        AddedToken(token, special=token_type == gguf.TokenType.CONTROL, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    ])

    special_ids = {role: _metadata(reader, key, None) for role, key in SPECIAL_TOKEN_KEYS.items()}
    special_ids = {role: int(i) for role, i in special_ids.items() if i is not None}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the generic class that reads tokenizer.json alone
        **{f"{role}_token": tokens[i] for role, i in special_ids.items()},
        "add_bos_token": bool(_metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_metadata(reader, "tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config.block_size,
    }
    if (chat_template := _metadata(reader, "tokenizer.chat_template", None)) is not None:
        tokenizer_config["chat_template"] = chat_template
    generation_config = {f"{role}_token_id": i for role, i in special_ids.items() if role != "unk"}
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps(generation_config, indent=2),
    }
