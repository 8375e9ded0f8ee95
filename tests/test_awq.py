"""AWQ: exact folding of the scales, the Gram-form search, clipping, quality against RTN, and bad input."""
import copy
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from litgpt.config import Config
from litgpt.model import GPT

from litquant.config import QuantizeConfig
from litquant.quantize.awq import (_candidate_errors, _fake_quantize, _group_ranges, block_quantizer, plan_block,
                                   quantize_model, scale_block, search_clip)
from litquant.quantize.blockwise import embed_calibration
from litquant.quantize.quantizer import rtn_quantize

AWQ_CONFIG = QuantizeConfig(method="awq", bits=4, group_size=32, sym=False, checkpoint_format="awq_gemm")
BASE = dict(block_size=128, vocab_size=96, padded_vocab_size=96, n_layer=2, n_embd=64, n_head=4, head_size=16,
            rotary_percentage=1.0)
EXTRA_CONFIGS = {
    # Falcon-style: parallel residual with one norm shared by attention and MLP, multi-query attention
    "falcon": dict(name="tiny-falcon", n_query_groups=1, parallel_residual=True, shared_attention_norm=True,
                   bias=False, norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", intermediate_size=256),
    # Gemma-2-style: RMSNorm with unit offset, GeGLU MLP, post-attention and post-MLP norms, scaled embeddings
    "gemma": dict(name="tiny-Gemma", n_query_groups=2, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                  mlp_class_name="GemmaMLP", intermediate_size=160, post_attention_norm=True, post_mlp_norm=True,
                  scale_embeddings=True),
}


def make_config(arch: str) -> Config:
    if arch in EXTRA_CONFIGS:
        return Config(**BASE, **EXTRA_CONFIGS[arch])
    return tiny_config(arch)


def random_model(config: Config, seed: int = 0, outlier_channels=()) -> GPT:
    """A random GPT with non-trivial norms and biases; `outlier_channels` of every norm get weight 20, the
    large, consistent activation channels that real LLMs have and AWQ protects."""
    torch.manual_seed(seed)
    model = GPT(config)
    model.apply(model._init_weights)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
        for block in model.transformer.h:
            for norm in (block.norm_1, block.norm_2):
                if norm is not None:
                    norm.weight[list(outlier_channels)] = 20.0
    return model.eval()


def random_tokens(config: Config, n: int, seq_len: int, seed: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (n, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "neox", "falcon", "gemma"])
def test_scaling_is_an_exact_reparametrization(arch):
    """Folding the searched scales (no quantization) leaves the logits unchanged, GQA and MQA included."""
    config = make_config(arch)
    model = random_model(config, outlier_channels=(3, 17))
    tokens = random_tokens(config, 4, 32, seed=1)
    with torch.no_grad():
        expected = model(tokens)
    original = {n: p.clone() for n, p in model.named_parameters()}
    inputs = embed_calibration(model, tokens, torch.device("cpu"), torch.float32, batch_size=2, offload=False)
    for block in model.transformer.h:
        scale_block(block, inputs, AWQ_CONFIG)
        inputs = inputs.run(block)
    with torch.no_grad():
        actual = model(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    # the scales are not trivial: the norms and the folded-into Linears did change
    changed = {n for n, p in model.named_parameters() if not torch.allclose(p, original[n])}
    assert "transformer.h.0.norm_1.weight" in changed and "transformer.h.0.attn.proj.weight" in changed
    if arch in ("llama", "gemma"):
        assert {"transformer.h.0.mlp.fc_2.weight", "transformer.h.0.mlp.proj.weight"} <= changed
    if arch == "neox":  # GELU between fc and proj: nothing is folded into proj
        assert "transformer.h.0.mlp.proj.weight" not in changed


def test_gram_error_equals_output_error():
    """The search's trace(D H D^T) is the squared output error of the pseudo-quantized, scaled Linear."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=g) * torch.linspace(0.1, 5, 64)
    w = torch.randn(24, 64, generator=g)
    scales = torch.rand(3, 64, generator=g) + 0.5
    errors = _candidate_errors(w, x.t() @ x, scales, bits=4, group_size=32, sym=False)
    for s, error in zip(scales, errors):
        dequantized = _fake_quantize((w * s).reshape(-1, 32), 4, False).view(w.shape) / s
        expected = ((x @ w.t() - x @ dequantized.t()) ** 2).sum()
        torch.testing.assert_close(error, expected, rtol=1e-4, atol=0)


def test_clip_search_only_touches_given_rows_and_lowers_the_error():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 64, generator=g)
    w[:, 5] *= 8  # a long-tailed weight per row: clipping it pays off
    x = torch.randn(500, 64, generator=g)
    gram = x.t() @ x
    rows = slice(8, 16)
    xmin, xmax = search_clip(w, gram, bits=4, group_size=32, sym=False, rows=rows)
    full_min, full_max = _group_ranges(w, 32)
    assert torch.equal(xmin[:8], full_min[:8]) and torch.equal(xmax[:8], full_max[:8])
    assert (xmax[rows] <= full_max[rows]).all() and (xmin[rows] >= full_min[rows]).all()
    assert (xmax[rows] < full_max[rows]).any()

    def row_errors(lo, hi):
        dequantized = _fake_quantize(w.reshape(-1, 32), 4, False, lo.flatten(), hi.flatten()).view(w.shape)
        return ((x @ (w - dequantized).t()) ** 2).sum(0)

    # the search minimizes each group's share of the error; on the whole rows it helps too
    assert row_errors(xmin, xmax)[rows].sum() < row_errors(full_min, full_max)[rows].sum()


def block_output_error(block, reference_block, inputs) -> float:
    quantized, reference = inputs.run(block), inputs.run(reference_block)
    return sum(((q - r) ** 2).sum().item() for q, r in zip(quantized.hidden, reference.hidden))


def test_awq_beats_rtn_on_outlier_channels():
    """On a block whose inputs have outlier channels, AWQ's block output error is well below RTN's, on
    held-out inputs."""
    config = make_config("llama")
    model = random_model(config, outlier_channels=(3, 17, 40))
    calibration = embed_calibration(model, random_tokens(config, 8, 64, seed=1), torch.device("cpu"), torch.float32,
                                    batch_size=4, offload=False)
    held_out = embed_calibration(model, random_tokens(config, 8, 64, seed=2), torch.device("cpu"), torch.float32,
                                 batch_size=4, offload=False)
    reference = model.transformer.h[0]

    rtn = copy.deepcopy(reference)
    for m in rtn.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = rtn_quantize(m.weight.data, 4, 32, sym=False).dequantize()
    errors = {"rtn": block_output_error(rtn, reference, held_out)}
    for clip in (False, True):
        block = copy.deepcopy(reference)
        quantized = block_quantizer(AWQ_CONFIG, apply_clip=clip)(block, calibration, "transformer.h.0.")
        assert set(quantized) == {"attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj"}
        errors[f"awq clip={clip}"] = block_output_error(block, reference, held_out)
    # (clipping lowers each Linear's output error, see above, but the block's output goes through the
    # softmax and the residual: on this random block its effect there is within noise)
    assert errors["awq clip=False"] < 0.5 * errors["rtn"], errors
    assert errors["awq clip=True"] < 0.5 * errors["rtn"], errors


@pytest.mark.parametrize("arch, config", [
    ("llama", AWQ_CONFIG),
    ("neox", AWQ_CONFIG),
    # AWQ scales stored in a GPTQ checkpoint: any bit width, symmetric grid, one group per row
    ("llama", QuantizeConfig(method="awq", bits=3, group_size=-1, sym=True, checkpoint_format="gptq")),
])
def test_quantize_model_weights_match_the_model_and_pack(arch, config):
    """Each returned weight dequantizes to the Linear's new weight, carries the (scaled) bias, and packs."""
    model_config = make_config(arch)
    model = random_model(model_config, outlier_channels=(3,))
    quantized = quantize_model(model, random_tokens(model_config, 4, 32, seed=1), config, "cpu", batch_size=2)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert set(quantized) == set(linears)
    for name, qw in quantized.items():
        assert (qw.bits, qw.group_size, qw.sym) == (config.bits, config.group_size, config.sym)
        torch.testing.assert_close(qw.dequantize(torch.float32), linears[name].weight, rtol=0, atol=0)
        if linears[name].bias is not None:
            assert torch.equal(qw.bias, linears[name].bias)
        unpacked = config.unpack(config.pack(qw), qw.in_features, qw.out_features)
        assert torch.equal(unpacked.codes, qw.codes) and torch.equal(unpacked.zeros, qw.zeros)


def test_ignored_modules_keep_their_scaled_full_precision_weight():
    config = make_config("llama")
    model = random_model(config)
    ignore = QuantizeConfig(method="awq", bits=4, group_size=32, sym=False, checkpoint_format="awq_gemv",
                            ignore_modules=["lm_head", "transformer.h.1.mlp"])
    quantized = quantize_model(model, random_tokens(config, 2, 32, seed=1), ignore, "cpu")
    assert "transformer.h.0.mlp.proj" in quantized and "transformer.h.1.attn.qkv" in quantized
    assert not any(name.startswith("transformer.h.1.mlp") for name in quantized)


def test_deterministic():
    config = make_config("llama")
    tokens = random_tokens(config, 4, 32, seed=1)
    runs = []
    for _ in range(2):
        model = random_model(config, outlier_channels=(3,))
        runs.append((quantize_model(model, tokens, AWQ_CONFIG, "cpu"), model.state_dict()))
    (first, first_state), (second, second_state) = runs
    for name in first:
        for field in ("codes", "scales", "zeros"):
            assert torch.equal(getattr(first[name], field), getattr(second[name], field)), name
    for name in first_state:
        assert torch.equal(first_state[name], second_state[name]), name


@pytest.mark.parametrize("overrides, message", [
    (dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=32),
     "MLP LLaMAMoE .*mixture-of-experts"),
    (dict(n_query_groups=4, latent_attention=dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=16)),
     "attention MultiheadLatentAttention"),
    (dict(name="tiny-OLMo", norm_class_name="LayerNorm"), "norm_1 LayerNorm without a weight"),
    (dict(norm_1=False), "norm_1 Identity without a weight"),
])
def test_unsupported_blocks_fail_before_any_work(overrides, message):
    config = Config(**{**BASE, "name": "tiny", "n_query_groups": 2, "parallel_residual": False, "bias": False,
                       "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 64,
                       **overrides})
    model = GPT(config)
    with pytest.raises(ValueError, match="AWQ does not support this block: " + message):
        plan_block(model.transformer.h[0])
    with pytest.raises(ValueError, match=message):
        quantize_model(model, random_tokens(config, 1, 8, seed=0), AWQ_CONFIG, "cpu")


def test_bad_settings_are_rejected():
    config = make_config("llama")  # intermediate_size 160
    model = random_model(config)
    tokens = random_tokens(config, 1, 8, seed=0)
    gptq = QuantizeConfig(method="gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match="needs config.method='awq', not 'gptq'"):
        quantize_model(model, tokens, gptq, "cpu")
    group_64 = QuantizeConfig(method="awq", bits=4, group_size=64, sym=False, checkpoint_format="awq_gemm")
    with pytest.raises(ValueError, match="transformer.h.0.mlp.proj has 160 inputs, group_size is 64"):
        quantize_model(model, tokens, group_64, "cpu")
    with pytest.raises(ValueError, match="n_grid must be at least 1"):
        block_quantizer(AWQ_CONFIG, n_grid=0)


def test_speed_benchmark_runs_tiny(tmp_path):
    path = Path(__file__).parents[1] / "benchmarks" / "awq_speed.py"
    spec = importlib.util.spec_from_file_location("awq_speed", path)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    out = tmp_path / "awq.json"
    result = benchmark.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["quantized_linears"] == 2 * 5 and result["seconds"] > 0 and result["peak_gpu_memory_gib"] is None


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M in fp32, calibration tokens [8, 512], evaluation tokens, and the perplexities of the
    full-precision model and of RTN 4-bit g64 zero-point."""
    from litgpt.tokenizer import Tokenizer

    from litquant.assets import calibration_text, evaluation_text, smollm2_checkpoint
    from litquant.checkpoint import load_litgpt_state

    checkpoint_dir = smollm2_checkpoint()
    base = GPT(Config.from_file(checkpoint_dir / "model_config.yaml"))
    base.load_state_dict({k: v.float() for k, v in load_litgpt_state(checkpoint_dir).items()})
    base.eval()
    tokenizer = Tokenizer(checkpoint_dir)
    calibration = tokenizer.encode(calibration_text())[: 8 * 512].view(8, 512)
    evaluation = tokenizer.encode(evaluation_text())
    rtn = copy.deepcopy(base)
    for m in rtn.transformer.h.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight.data = rtn_quantize(m.weight.data, 4, SMOLLM2_GROUP_SIZE, sym=False).dequantize()
    baselines = {"fp32": smollm2_perplexity(base, evaluation), "rtn": smollm2_perplexity(rtn, evaluation)}
    print(f"\nSmolLM2-135M perplexity: full precision (fp32) {baselines['fp32']:.3f}, "
          f"RTN 4-bit g{SMOLLM2_GROUP_SIZE} zero-point {baselines['rtn']:.3f}")
    return base, calibration, evaluation, baselines


SMOLLM2_GROUP_SIZE = 64  # 576 inputs: not a multiple of 128


def smollm2_perplexity(model: GPT, evaluation: torch.Tensor) -> float:
    from litquant.perplexity import compute_perplexity

    return compute_perplexity(model, evaluation, window=512, max_windows=8)[0]


@pytest.mark.real_model
@pytest.mark.parametrize("apply_clip", [True, False])
def test_smollm2_awq_beats_rtn(smollm2, apply_clip):
    """SmolLM2-135M, 4-bit g64 zero-point: AWQ's perplexity on held-out text is below RTN's."""
    base, calibration, evaluation, baselines = smollm2
    model = copy.deepcopy(base)
    config = QuantizeConfig(method="awq", bits=4, group_size=SMOLLM2_GROUP_SIZE, sym=False,
                            checkpoint_format="awq_gemm")
    start = time.perf_counter()
    quantized = quantize_model(model, calibration, config, "cpu", apply_clip=apply_clip)
    seconds = time.perf_counter() - start
    # the weights the checkpoint stores, with the model's scaled norms
    for name, qw in quantized.items():
        model.get_submodule(name).weight.data = qw.dequantize(torch.float32)
    ppl = smollm2_perplexity(model, evaluation)
    print(f"SmolLM2-135M perplexity: AWQ 4-bit g{SMOLLM2_GROUP_SIZE} apply_clip={apply_clip} {ppl:.3f} "
          f"(quantized in {seconds:.0f} s)")
    assert ppl < baselines["rtn"]
