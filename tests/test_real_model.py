"""The foundation on the real model: SmolLM2-135M-Instruct (GGUF import), RTN checkpoints through the CLI
functions, and perplexity on the evaluation slice of Debian's jargon-text against both baselines."""
import pytest
import torch

from litquant import assets
from litquant.load import load_model
from litquant.perplexity import compute_perplexity
from litquant.quantize.main import quantize

pytestmark = pytest.mark.real_model
WINDOWS = 3  # 3 x 512 tokens: enough to order the variants, cheap enough for CI's two cores


def evaluation_perplexity(checkpoint_dir, **kwargs) -> float:
    loaded = load_model(checkpoint_dir, device="cpu", **kwargs)
    tokens = loaded.tokenizer.encode(assets.evaluation_text(), bos=False)
    return compute_perplexity(loaded.model, tokens, window=512, max_windows=WINDOWS)[0]


def test_rtn_checkpoints_against_bf16_and_nf4(tmp_path):
    checkpoint = assets.smollm2_checkpoint()
    results = {"unquantized bf16": evaluation_perplexity(checkpoint, precision="bf16-true"),
               "bnb.nf4": evaluation_perplexity(checkpoint, quantize="bnb.nf4")}
    for bits, sym in ((4, True), (3, False)):
        out = quantize(checkpoint, tmp_path / f"rtn{bits}", method="rtn", bits=bits, group_size=64, sym=sym,
                       kernel="torch", device="cpu")
        results[f"RTN {bits}-bit g64"] = evaluation_perplexity(out)
    print("SmolLM2-135M perplexity (jargon-text evaluation slice, 3 x 512 tokens):",
          {name: round(ppl, 2) for name, ppl in results.items()})
    assert results["unquantized bf16"] < results["RTN 4-bit g64"] < results["RTN 3-bit g64"]
    assert results["unquantized bf16"] < results["bnb.nf4"]


def test_quantized_checkpoint_answers_in_english(tmp_path):
    from litgpt.generate.base import generate
    from litgpt.prompts import PromptStyle

    out = quantize(assets.smollm2_checkpoint(), tmp_path / "rtn4", method="rtn", bits=4, group_size=64, device="cpu")
    loaded = load_model(out, device="cpu")
    prompt = PromptStyle.from_config(loaded.config).apply("What is a hacker?")
    encoded = loaded.tokenizer.encode(prompt)
    loaded.model.max_seq_length = encoded.size(0) + 24
    loaded.model.set_kv_cache(batch_size=1)
    with torch.inference_mode():
        answer = loaded.tokenizer.decode(generate(loaded.model, encoded, encoded.size(0) + 24, temperature=0.0,
                                                  include_prompt=False))
    print("RTN 4-bit g64 answer:", answer)
    words = answer.split()
    assert len(words) >= 10 and "hacker" in answer.lower()
    assert sum(w.strip(".,!?\"'()").isalpha() for w in words) / len(words) > 0.8
