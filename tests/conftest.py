"""Shared fixtures: tiny random LitGPT checkpoints (fast unit tests) and the GPU skip."""
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter, chosen when triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (litgpt imports it), so before anything else

from litgpt.config import Config  # noqa: E402
from litgpt.model import GPT  # noqa: E402
from litgpt.utils import save_config  # noqa: E402

VOCAB = 96

TINY_CONFIGS = {
    # LLaMA-style: RMSNorm, SwiGLU MLP, rope, grouped-query attention (4 heads, 2 KV groups)
    "llama": dict(name="tiny-llama", block_size=128, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_embd=64,
                  n_head=4, n_query_groups=2, head_size=16, rotary_percentage=1.0, parallel_residual=False, bias=False,
                  norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=160),
    # LLaMA-style with widths that every GPU kernel takes (multiples of 64 and 128)
    "llama_gpu": dict(name="tiny-llama-gpu", block_size=128, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2,
                      n_embd=128, n_head=4, n_query_groups=2, head_size=32, rotary_percentage=1.0,
                      parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                      intermediate_size=256),
    # GptNeoX-style (Pythia): LayerNorm with bias, GELU MLP, parallel residual, partial rope
    "neox": dict(name="tiny-neox", block_size=128, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=2, n_embd=64,
                 n_head=4, n_query_groups=4, head_size=16, rotary_percentage=0.25, parallel_residual=True, bias=True,
                 norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", intermediate_size=256),
}


def tiny_config(arch: str = "llama") -> Config:
    return Config(**TINY_CONFIGS[arch])


def write_tiny_tokenizer(directory: Path) -> None:
    """A character-level tokenizer over printable ASCII (ids < VOCAB), in tokenizer.json form."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    chars = [chr(c) for c in range(32, 32 + VOCAB - 2)]
    vocab = {"<s>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="</s>", max_input_chars_per_word=1000))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def make_tiny_checkpoint(directory: Path, arch: str = "llama", seed: int = 0) -> Path:
    torch.manual_seed(seed)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch)
    model = GPT(config)
    model.apply(model._init_weights)
    # non-trivial norms and biases so that their loading is actually tested
    for name, p in model.named_parameters():
        if "norm" in name or "ln_f" in name or name.endswith(".bias"):
            p.data.add_(0.1 * torch.randn_like(p))
    torch.save(model.state_dict(), directory / "lit_model.pth")
    save_config(config, directory)
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(autouse=True)
def litgpts_own_next_token(monkeypatch):
    """generate, chat, serve and the benchmark swap litgpt's `next_token` for litquant's step
    (`litquant.generate.set_next_token`), for the process: every test starts from litgpt's own and leaves it so."""
    import litgpt.generate.base as gen

    from litquant.generate import LITGPT_NEXT_TOKEN

    monkeypatch.setattr(gen, "next_token", LITGPT_NEXT_TOKEN)


@pytest.fixture(params=["llama", "neox"])
def tiny_checkpoint(request, tmp_path) -> Path:
    return make_tiny_checkpoint(tmp_path / f"tiny-{request.param}", request.param)


@pytest.fixture
def tiny_llama_checkpoint(tmp_path) -> Path:
    return make_tiny_checkpoint(tmp_path / "tiny-llama", "llama")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
