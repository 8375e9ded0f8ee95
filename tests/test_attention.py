"""FlexAttention over the filled part of the KV cache (`litquant.attention`) against SDPA."""
import math
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from litgpt.config import Config
from litgpt.model import GPT

from conftest import TINY_CONFIGS, tiny_config
from litquant.attention import filled_prefix_attention, filled_prefix_block_mask, use_flex_decoding
from litquant.generate import compile_options, flex_decoding_pays_in_generate, set_next_token


@pytest.mark.parametrize("cache,filled", [(300, 1), (300, 127), (300, 128), (300, 129), (300, 300), (256, 256),
                                          (64, 40)])
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
def test_filled_prefix_attention_reads_only_the_prefix(cache, filled, kv_heads):
    """Eager (FlexAttention's reference path): the positions past the prefix hold values that would swamp the
    output if any of them were attended."""
    torch.manual_seed(0)
    heads, head_size = 6, 32
    q = torch.randn(1, heads, 1, head_size)
    k, v = torch.randn(1, kv_heads, cache, head_size), torch.randn(1, kv_heads, cache, head_size)
    k[:, :, filled:], v[:, :, filled:] = 30.0, 1e4
    block_mask = filled_prefix_block_mask(torch.tensor([filled - 1]), cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        out = filled_prefix_attention(q, k, v, block_mask, 1 / math.sqrt(head_size))
    ref = F.scaled_dot_product_attention(q, k[:, :, :filled], v[:, :, :filled], scale=1 / math.sqrt(head_size),
                                         enable_gqa=True)
    assert out.shape == ref.shape
    assert (out - ref).norm() / ref.norm() < 1e-5


def test_use_flex_decoding_routes_only_what_it_can_and_leaves_eager_alone():
    torch.manual_seed(0)
    model = GPT(tiny_config("llama")).eval()
    model.max_seq_length = 32
    model.set_kv_cache(batch_size=1)
    x = torch.randint(0, 96, (1, 8))
    with torch.inference_mode():
        before = model(x, torch.arange(8))
        assert use_flex_decoding(model) == 2
        model.set_kv_cache(batch_size=1)
        after = model(x, torch.arange(8))  # eager: litgpt's attention
    assert torch.equal(before, after)
    assert use_flex_decoding(model, enable=False) == 0
    assert all("scaled_dot_product_attention" not in vars(block.attn) for block in model.transformer.h)
    assert "forward" not in vars(model)

    softcapped = GPT(Config(**{**TINY_CONFIGS["llama"], "attention_logit_softcapping": 50.0}))
    assert use_flex_decoding(softcapped) == 0
    odd_heads = GPT(Config(**{**TINY_CONFIGS["llama"], "head_size": 24, "n_embd": 96}))
    assert use_flex_decoding(odd_heads) == 0


def test_compiled_next_token_routes_attention_as_asked():
    """chat compiles with FlexAttention over the filled cache; generate only for grouped-query attention on a GPU."""
    model = GPT(tiny_config("llama"))
    set_next_token(model, compile=True, flex_decoding=True)
    assert all("scaled_dot_product_attention" in vars(block.attn) for block in model.transformer.h)
    set_next_token(model, compile=True)
    assert all("scaled_dot_product_attention" not in vars(block.attn) for block in model.transformer.h)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not flex_decoding_pays_in_generate(Config.from_name("Llama-2-7b-hf"), cuda)
    assert flex_decoding_pays_in_generate(Config.from_name("Llama-3.1-8B"), cuda)
    assert not flex_decoding_pays_in_generate(Config.from_name("Llama-3.1-8B"), cpu)


@pytest.mark.parametrize("wrapped", [False, True], ids=["GPT", "fabric"])
@torch.inference_mode()
def test_compiled_step_builds_one_block_mask_for_all_layers(wrapped):
    """Dynamo's graph of a one-token step: every layer's attention is FlexAttention, on one block mask; also for the
    model as `litquant.load.load_model` gives it, wrapped by Fabric."""
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model = GPT(Config(**{**TINY_CONFIGS["llama_gpu"], "n_layer": 3, "block_size": 512})).eval()
    model.max_seq_length = 300
    model.set_kv_cache(batch_size=1)
    if wrapped:
        model = L.Fabric(accelerator="cpu", devices=1).setup_module(model)
    assert use_flex_decoding(model) == 3
    torch._dynamo.reset()
    step = torch.compile(lambda model, input_pos, x: model(x, input_pos), backend=keep_graph, fullgraph=True)
    step(model, torch.tensor([10]), torch.zeros(1, 1, dtype=torch.long))
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert sum("flex_attention" in target for target in targets) == 3
    assert sum("arange" in target for target in targets) == 1  # the block mask's block index, built once
    if wrapped:  # the block mask is built in the GPT's forward; Fabric's own forward stays in front of it
        assert "forward" not in vars(model) and "forward" in vars(model.module)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.inference_mode()
def test_compiled_decode_with_flex_matches_eager(device):
    """The compiled decode (compile_options: CUDA graphs on the GPU), attention through FlexAttention, against eager
    SDPA, teacher-forced over fills that cross cache blocks (100..160 of a 300-position cache). The cache's unfilled
    positions hold huge values, so attending any of them would miss by orders of magnitude."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = GPT(Config(**{**TINY_CONFIGS["llama_gpu"], "block_size": 512})).to(dtype).eval()
    model.max_seq_length = 300
    prompt_len, steps = 100, 60
    tokens = torch.randint(0, 96, (1, prompt_len + steps), device=device)

    def step(model, input_pos, x):
        return model(x, input_pos)[0, -1].float()

    def run(fn, compiled):
        model.set_kv_cache(batch_size=1, device=torch.device(device), dtype=dtype)
        for block in model.transformer.h:
            block.attn.kv_cache.k.fill_(30.0)
            block.attn.kv_cache.v.fill_(1e4)
        logits = [fn(model, torch.arange(prompt_len, device=device), tokens[:, :prompt_len]).clone()]
        for t in range(prompt_len, prompt_len + steps):
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            logits.append(fn(model, torch.tensor([t], device=device), tokens[:, t:t + 1]).clone())
        return torch.stack(logits)

    reference = run(step, compiled=False)
    assert use_flex_decoding(model) == 2
    torch._dynamo.reset()
    out = run(torch.compile(step, options=compile_options()), compiled=True)
    rel = (out - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert rel.max() < (2e-2 if dtype == torch.bfloat16 else 1e-4), rel
