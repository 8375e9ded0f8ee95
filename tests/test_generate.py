"""litquant's decode loop (`litquant.generate.decode`) against litgpt's `generate` on a tiny random LitGPT model."""
import pytest
import torch
from litgpt.generate.base import generate as litgpt_generate
from litgpt.model import GPT

from conftest import tiny_config
from litquant.generate import compile_options, decode, set_next_token
from litquant.kernels.base import LayerSpec, QuantLinear
from litquant.kernels.torch_dequant import TorchQuantLinear
from litquant.quantize.quantizer import rtn_quantize


@pytest.fixture
def model():
    torch.manual_seed(0)
    model = GPT(tiny_config("llama")).eval()
    model.max_seq_length = 64
    model.set_kv_cache(batch_size=1)
    return model


def reference(model, prompt, new_tokens, eos_id=None, **sample_kwargs):
    torch.manual_seed(7)
    out = litgpt_generate(model, prompt, prompt.size(0) + new_tokens, eos_id=eos_id, include_prompt=False,
                          **sample_kwargs)
    return out.tolist()


def ours(model, prompt, new_tokens, **kwargs):
    torch.manual_seed(7)
    return list(decode(model, prompt, new_tokens, **kwargs))


@pytest.mark.parametrize("sample_kwargs", [dict(temperature=0.0), dict(temperature=0.9, top_k=20, top_p=0.9)])
def test_decode_gives_litgpts_tokens_in_runs(model, sample_kwargs):
    prompt = torch.randint(0, 96, (5,))
    expected = reference(model, prompt, 40, **sample_kwargs)
    runs = ours(model, prompt, 40, readback_every=16, **sample_kwargs)
    assert [len(run) for run in runs] == [1, 16, 16, 7]  # the first token alone, then 16 at a time
    assert [t for run in runs for t in run] == expected


def test_decode_stops_at_eos_inside_a_run(model):
    prompt = torch.randint(0, 96, (5,))
    free = reference(model, prompt, 40, temperature=0.0)
    # with 8 a run, runs hold tokens [0], [1, 8], [9, 16], ...: the EOS is one that first appears inside a run
    cut = next(i for i, t in enumerate(free) if i > 1 and i % 8 != 0 and free.index(t) == i)
    eos = free[cut]
    assert reference(model, prompt, 40, eos_id=eos, temperature=0.0) == free[:cut + 1]
    tokens = [t for run in ours(model, prompt, 40, eos_id=eos, readback_every=8, temperature=0.0) for t in run]
    assert tokens == free[:cut + 1]


def test_decode_refuses_a_short_cache_and_no_tokens(model):
    with pytest.raises(ValueError, match="KV cache holds 64 positions"):
        next(decode(model, torch.zeros(30, dtype=torch.long), 40))
    with pytest.raises(ValueError, match="at least 1"):
        next(decode(model, torch.zeros(3, dtype=torch.long), 0))


def test_compile_options_are_reduce_overhead_with_inductors_dependent_launches(monkeypatch):
    monkeypatch.delenv("LITQUANT_PDL", raising=False)
    options = compile_options()
    assert options["triton.cudagraphs"] is True
    assert options.get("triton.enable_pdl", False) is hasattr(torch._inductor.config.triton, "enable_pdl")
    torch.compile(lambda x: x, options=options)  # torch.compile checks the option names here
    monkeypatch.setenv("LITQUANT_PDL", "0")
    assert compile_options() == torch._inductor.list_mode_options("reduce-overhead")


def test_compiled_next_token_tells_the_quantized_layers_what_runs_before_them():
    """Under litquant's compiled decode the kernel ahead of each quantized matmul is one of Inductor's small kernels
    or attention: the model's quantized layers are told (marlin then launches every decode grid as a dependent)."""
    model = GPT(tiny_config("llama"))
    proj = model.transformer.h[0].attn.proj
    qw = rtn_quantize(proj.weight.detach(), 4, 32, True)
    layer = TorchQuantLinear(proj.in_features, proj.out_features, False,
                             LayerSpec(proj.in_features, proj.out_features, 4, 32, True, False), torch.float32)
    layer.load_quantized(qw)
    model.transformer.h[0].attn.proj = layer
    assert not layer.after_small_kernels
    set_next_token(model, compile=True)
    assert layer.after_small_kernels and not QuantLinear.after_small_kernels


def test_compiled_decode_runs_prompts_eagerly_and_compiles_one_static_step(model):
    """`--compile` compiles the one-token step alone: the prompts (of any length) run eagerly, so nothing is compiled
    for them and the step is not recompiled with dynamic shapes. The tokens are the eager loop's."""
    from torch._dynamo.utils import counters

    prompts = [torch.tensor([1, 5, 9, 2]), torch.tensor([3, 4, 8, 8, 6, 1, 7])]
    eager = [ours(model, prompt, 6, temperature=0.0) for prompt in prompts]
    torch._dynamo.reset()
    counters.clear()
    set_next_token(model, compile=True)
    assert [ours(model, prompt, 6, temperature=0.0) for prompt in prompts] == eager
    assert counters["stats"]["unique_graphs"] == 1


def test_eager_steps_run_attention_without_cudnn(model):
    """Eagerly every step gives attention a new key length, for which cuDNN's SDPA would build a new plan: litquant's
    eager step leaves cuDNN out (and puts it back after each step), with litgpt's tokens."""
    cudnn_during_steps = []
    model.register_forward_pre_hook(lambda *_: cudnn_during_steps.append(torch.backends.cuda.cudnn_sdp_enabled()))
    prompt = torch.randint(0, 96, (5,))
    expected = reference(model, prompt, 10, temperature=0.0)
    assert all(cudnn_during_steps)
    cudnn_during_steps.clear()
    set_next_token(model, compile=False)
    assert [t for run in ours(model, prompt, 10, temperature=0.0) for t in run] == expected
    assert len(cudnn_during_steps) == 10 and not any(cudnn_during_steps)
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.gpu
def test_gpu_eager_decode_launches_no_cudnn_attention():
    """On a GPU, in fp16, with 64-wide heads (SmolLM2's), litgpt's eager step runs cuDNN's attention, and litquant's
    eager decode (prompt and steps) none of it."""
    from litgpt.config import Config
    from torch.profiler import ProfilerActivity, profile

    from conftest import TINY_CONFIGS

    torch.manual_seed(0)
    model = GPT(Config(**{**TINY_CONFIGS["llama_gpu"], "n_embd": 256, "head_size": 64})).cuda().half().eval()
    model.max_seq_length = 64
    model.set_kv_cache(batch_size=1, device=torch.device("cuda"), dtype=torch.float16)
    prompt = torch.randint(0, 96, (9,), device="cuda")

    def attention_kernels_and_tokens():
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            tokens = [t for run in ours(model, prompt, 12, temperature=0.0) for t in run]
        kernels = {event.name for event in trace.events() if event.device_type == torch.autograd.DeviceType.CUDA}
        return {name for name in kernels if "cudnn" in name.lower()}, tokens

    litgpts_cudnn, _ = attention_kernels_and_tokens()
    set_next_token(model, compile=False)
    cudnn, tokens = attention_kernels_and_tokens()
    assert litgpts_cudnn and not cudnn
    assert len(tokens) == 12
