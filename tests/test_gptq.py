"""GPTQ: the weight-level algorithm, the block recipe on tiny litgpt models, and quality on SmolLM2-135M."""
import copy
import importlib.util
import inspect
import logging
import math
from pathlib import Path

import pytest
import torch
import yaml
from litgpt.config import Config
from litgpt.model import GPT

from conftest import TINY_CONFIGS, tiny_config
from litquant.config import QuantizeConfig
from litquant.quantize.blockwise import embed_calibration
from litquant.quantize.gptq import (Hessian, collect_hessians, gptq_quantize_weight, inverse_cholesky,
                                    quantize_linear, quantize_model, sequential_stages)
from litquant.quantize.quantizer import find_params, rtn_quantize

REPO = Path(__file__).parent.parent


def correlated_problem(n: int = 48, k: int = 160, tokens: int = 1024, seed: int = 0):
    """A weight [n, k] and inputs [k, tokens] whose channels are correlated and of unequal scale (as in LLMs)."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(k, k // 4, generator=g)
    x = mixing @ torch.randn(k // 4, tokens, generator=g) + 0.3 * torch.randn(k, tokens, generator=g)
    x = x * torch.exp(torch.randn(k, 1, generator=g))  # a few channels much larger than the rest
    w = torch.randn(n, k, generator=g)
    return w, x, 2 * x @ x.t() / tokens


def output_error(w: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> float:
    return ((w - q) @ x).square().sum().item()


def damped(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    h = h.clone()
    h.diagonal().add_(damp_percent * h.diagonal().mean())
    return h


# ---------------------------------------------------------------- the algorithm on one weight


@pytest.mark.parametrize("bits, group_size", [(4, 32), (4, -1), (3, 32), (3, -1)])
def test_gptq_output_error_is_clearly_below_rtn(bits, group_size):
    w, x, h = correlated_problem()
    qw, _ = gptq_quantize_weight(w, h, bits, group_size, sym=True)
    gptq = output_error(w, qw.dequantize(), x)
    rtn = output_error(w, rtn_quantize(w, bits, group_size, sym=True).dequantize(), x)
    assert gptq < 0.6 * rtn, (gptq, rtn)


@pytest.mark.parametrize("desc_act, static_groups", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("group_size", [-1, 32, 48, 200])  # 160 % 48 != 0: a partial last group; 200 > K
@pytest.mark.parametrize("sym", [True, False])
def test_loss_is_the_output_error_of_the_returned_weight(desc_act, static_groups, group_size, sym):
    """trace((W - Q) H (W - Q)^T) / 2 with the damped H equals the loss GPTQ tracked: the QuantizedWeight,
    in the original column order and with its g_idx, is exactly what the loop optimized."""
    w, x, h = correlated_problem()
    qw, loss = gptq_quantize_weight(w, h, 4, group_size, sym, desc_act, static_groups, damp_percent=0.01)
    delta = w - qw.dequantize()
    assert torch.trace(delta @ damped(h, 0.01) @ delta.t()).item() / 2 == pytest.approx(loss, rel=1e-4)
    assert qw.codes.shape == (160, 48) and qw.scales.dtype == torch.float16 and qw.bias is None
    assert qw.scales.shape[0] == (1 if group_size == -1 else math.ceil(160 / group_size))
    assert int(qw.codes.max()) < 16 and (qw.zeros == 8).all() == sym


def test_act_order_g_idx_follows_the_permutation():
    w, x, h = correlated_problem()
    group_size = 32
    qw, _ = gptq_quantize_weight(w, h, 4, group_size, sym=True, desc_act=True)
    perm = torch.argsort(h.diagonal(), descending=True, stable=True)
    # groups are consecutive in the order of decreasing H_kk, stored against the original columns
    assert torch.equal(qw.g_idx[perm].long(), torch.arange(160) // group_size)
    assert qw.act_order and not bool((qw.g_idx[1:] >= qw.g_idx[:-1]).all())
    assert torch.bincount(qw.g_idx.long()).tolist() == [group_size] * 5
    # act_order helps on inputs of unequal scale
    plain, _ = gptq_quantize_weight(w, h, 4, group_size, sym=True)
    assert output_error(w, qw.dequantize(), x) < output_error(w, plain.dequantize(), x)


def test_static_groups_keep_g_idx_and_fit_grids_on_the_original_weight():
    w, x, h = correlated_problem()
    qw, _ = gptq_quantize_weight(w, h, 4, 32, sym=False, desc_act=True, static_groups=True)
    assert torch.equal(qw.g_idx.long(), torch.arange(160) // 32) and not qw.act_order
    for g in range(5):
        scale, zero = find_params(w[:, 32 * g:32 * (g + 1)], 4, sym=False)
        assert torch.equal(qw.scales[g].float(), scale) and torch.equal(qw.zeros[g].float(), zero)


def test_dead_inputs_are_zeroed_not_nan():
    w, x, h = correlated_problem()
    dead = torch.tensor([0, 17, 99])
    x[dead] = 0
    h = 2 * x @ x.t() / x.shape[1]
    for sym in (True, False):
        qw, loss = gptq_quantize_weight(w, h, 4, 32, sym, desc_act=True)
        q = qw.dequantize()
        assert torch.isfinite(q).all() and math.isfinite(loss)
        assert (q[:, dead] == 0).all()


def test_damping_grows_until_the_cholesky_succeeds(caplog):
    w, x, h = correlated_problem()
    indefinite = h - 0.05 * h.diagonal().mean() * torch.eye(160)  # damp 0.01 is not enough, 0.1 is
    with caplog.at_level(logging.WARNING, logger="litquant.quantize"):
        qw, loss = gptq_quantize_weight(w, indefinite, 4, 32, sym=True, damp_percent=0.01, name="layer.qkv")
    assert "layer.qkv: Cholesky failed with damp_percent=0.01; retrying with damp_percent=0.1" in caplog.text
    assert torch.isfinite(qw.dequantize()).all() and math.isfinite(loss)
    _, damp = inverse_cholesky(indefinite, 0.0)
    assert damp == 0.1


def test_hopeless_hessian_raises():
    h = -torch.eye(8)
    with pytest.raises(torch.linalg.LinAlgError, match="not positive definite even with damp_percent=1"):
        gptq_quantize_weight(torch.randn(4, 8), h, 4, -1, sym=True)


def test_nan_hessian_raises():
    w, x, h = correlated_problem()
    h[3, 5] = float("nan")
    with pytest.raises(FloatingPointError, match="layer.proj: the Hessian has NaN or inf entries"):
        gptq_quantize_weight(w, h, 4, 32, sym=True, name="layer.proj")


@pytest.mark.parametrize("kwargs, message", [
    (dict(hessian=torch.eye(7)), r"the Hessian has shape \[7, 7\], expected \[160, 160\]"),
    (dict(bits=1), "bits must be between 2 and 8"),
    (dict(group_size=0), "group_size must be -1 or positive"),
    (dict(damp_percent=1.5), r"damp_percent must be in \[0, 1\)"),
])
def test_bad_arguments(kwargs, message):
    w, x, h = correlated_problem()
    args = dict(weight=w, hessian=h, bits=4, group_size=32, sym=True) | kwargs
    with pytest.raises(ValueError, match=message):
        gptq_quantize_weight(**args)


def test_hessian_is_a_running_average():
    x = torch.randn(3, 50, 16)
    hessian = Hessian(16, torch.device("cpu"))
    for batch in (x[0], x[1:], x[:0]):  # unequal batches, and an empty one
        hessian.add(batch)
    flat = x.reshape(-1, 16)
    assert hessian.tokens == 150
    torch.testing.assert_close(hessian.matrix, 2 * flat.t() @ flat / 150)


# ---------------------------------------------------------------- blocks and models


def test_sequential_stages_follow_the_block():
    names = ["attn.qkv", "attn.proj", "mlp.experts.0.fc_1", "mlp.experts.0.fc_2", "mlp.experts.0.proj",
             "mlp.experts.1.fc_1", "mlp.experts.1.fc_2", "mlp.experts.1.proj"]
    assert sequential_stages(names) == [["attn.qkv"], ["attn.proj"],
                                        ["mlp.experts.0.fc_1", "mlp.experts.0.fc_2", "mlp.experts.1.fc_1",
                                         "mlp.experts.1.fc_2"], ["mlp.experts.0.proj", "mlp.experts.1.proj"]]
    assert sequential_stages(["mlp.proj", "mlp.fc", "attn.proj", "attn.qkv"]) == [["attn.qkv"], ["attn.proj"],
                                                                                ["mlp.fc"], ["mlp.proj"]]
    with pytest.raises(ValueError, match="'attn.q_a_proj' is not a Linear of a known litgpt block.*"
                                         "true_sequential=False"):
        sequential_stages(["attn.q_a_proj"])


def test_linears_reading_the_same_input_share_one_hessian():
    model = GPT(tiny_config("llama"))
    inputs = embed_calibration(model, torch.randint(0, 96, (4, 16)), torch.device("cpu"), torch.float32, 2, False)
    hessians = collect_hessians(model.transformer.h[0], inputs, ["attn.qkv", "mlp.fc_1", "mlp.fc_2", "mlp.proj"])
    assert hessians["mlp.fc_1"] is hessians["mlp.fc_2"] and hessians["mlp.fc_1"].tokens == 64
    assert len({id(h) for h in hessians.values()}) == 3


def test_a_stage_pass_stops_once_its_linears_have_their_inputs():
    """`attn.qkv`'s stage runs the block only up to it (no attention, no MLP), with the same Hessian as a full pass."""
    model = GPT(tiny_config("llama"))
    block = model.transformer.h[0]
    inputs = embed_calibration(model, torch.randint(0, 96, (4, 16)), torch.device("cpu"), torch.float32, 2, False)
    calls = []
    block.attn.proj.register_forward_pre_hook(lambda *_: calls.append("attn.proj"))
    block.mlp.register_forward_pre_hook(lambda *_: calls.append("mlp"))
    qkv_only = collect_hessians(block, inputs, ["attn.qkv"])["attn.qkv"]
    assert calls == []
    with_the_whole_block = collect_hessians(block, inputs, ["attn.qkv", "mlp.proj"])["attn.qkv"]
    assert calls == ["attn.proj", "mlp"] * 2  # both batches, up to mlp.proj
    assert torch.equal(qkv_only.matrix, with_the_whole_block.matrix) and qkv_only.tokens == 64


def test_a_linear_without_calibration_tokens_falls_back_to_rtn(caplog):
    linear = torch.nn.Linear(64, 32)
    config = QuantizeConfig(method="gptq", bits=4, group_size=32)
    expected = rtn_quantize(linear.weight.detach(), 4, 32, sym=True).dequantize()
    with caplog.at_level(logging.WARNING, logger="litquant.quantize"):
        qw = quantize_linear(linear, Hessian(64, torch.device("cpu")), config, 128, "mlp.experts.3.fc_1")
    assert "mlp.experts.3.fc_1: no calibration token reached this Linear" in caplog.text
    assert torch.equal(linear.weight.data, expected) and torch.equal(qw.bias, linear.bias.data)


def logits_error(model: GPT, reference: torch.Tensor, tokens: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(tokens)
    assert torch.isfinite(logits).all()
    return (logits - reference).square().mean().item()


def rtn_model(model: GPT, bits: int, group_size: int) -> GPT:
    model = copy.deepcopy(model)
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            m.weight.data = rtn_quantize(m.weight.data, bits, group_size, sym=True).dequantize()
    return model


@pytest.mark.parametrize("arch, linears", [
    ("llama", ["attn.qkv", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj"]),
    ("neox", ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"]),
])
@pytest.mark.parametrize("true_sequential, desc_act", [(True, False), (False, True)])
def test_quantize_model_is_deterministic_and_beats_rtn(arch, linears, true_sequential, desc_act, caplog):
    torch.manual_seed(0)
    original = GPT(tiny_config(arch))
    original.apply(original._init_weights)
    calibration = torch.randint(0, 96, (16, 64))
    evaluation = torch.randint(0, 96, (4, 64))
    with torch.no_grad():
        reference = original(evaluation)
    config = QuantizeConfig(method="gptq", bits=3, group_size=32, desc_act=desc_act, true_sequential=true_sequential)
    runs = []
    for _ in range(2):
        model = copy.deepcopy(original)
        with caplog.at_level(logging.INFO, logger="litquant.quantize"):
            runs.append((model, quantize_model(model, calibration, config, "cpu", batch_size=8)))
    (model, quantized), (_, again) = runs
    assert list(quantized) == [f"transformer.h.{i}.{name}" for i in range(2) for name in linears]
    for name, qw in quantized.items():
        assert torch.equal(qw.codes, again[name].codes) and torch.equal(qw.scales, again[name].scales)
        # the model holds the dequantized weights
        assert torch.equal(model.get_submodule(name).weight.data, qw.dequantize())
    assert "transformer.h.1.mlp.proj: loss" in caplog.text and "peak CPU memory" in caplog.text
    rtn = logits_error(rtn_model(original, 3, 32), reference, evaluation)
    assert logits_error(model, reference, evaluation) < 0.8 * rtn


def test_quantize_model_on_a_mixture_of_experts_leaves_the_router_alone():
    config = Config(**{**TINY_CONFIGS["llama"], "mlp_class_name": "LLaMAMoE", "n_expert": 4, "n_expert_per_token": 2,
                       "moe_intermediate_size": 96})
    torch.manual_seed(0)
    model = GPT(config)
    model.apply(model._init_weights)
    gate = model.transformer.h[0].mlp.gate.weight.detach().clone()
    quantized = quantize_model(model, torch.randint(0, 96, (8, 32)), QuantizeConfig(method="gptq", group_size=32),
                               "cpu")
    names = {name.split(".", 3)[3] for name in quantized}
    experts = {f"mlp.experts.{j}.{linear}" for j in range(4) for linear in ("fc_1", "fc_2", "proj")}
    assert names == {"attn.qkv", "attn.proj"} | experts
    assert torch.equal(model.transformer.h[0].mlp.gate.weight, gate)


def test_quantize_model_rejects_bad_input():
    model = GPT(tiny_config("llama"))
    with pytest.raises(ValueError, match="needs config.method='gptq', not 'rtn'"):
        quantize_model(model, torch.zeros(2, 8, dtype=torch.long), QuantizeConfig(method="rtn"), "cpu")
    with pytest.raises(ValueError, match=r"must be \[num_samples, seq_len\], got shape \[8\]"):
        quantize_model(model, torch.zeros(8, dtype=torch.long), QuantizeConfig(method="gptq"), "cpu")


def test_ignored_modules_stay_in_full_precision():
    torch.manual_seed(0)
    model = GPT(tiny_config("llama"))
    proj = model.transformer.h[1].attn.proj.weight.detach().clone()
    config = QuantizeConfig(method="gptq", group_size=32, ignore_modules=["lm_head", "transformer.h.1.attn.proj"])
    quantized = quantize_model(model, torch.randint(0, 96, (4, 16)), config, "cpu")
    assert "transformer.h.1.attn.proj" not in quantized and "transformer.h.0.attn.proj" in quantized
    assert torch.equal(model.transformer.h[1].attn.proj.weight, proj)


# ---------------------------------------------------------------- benchmark and recipes


def test_speed_benchmark_runs_tiny_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("quantize_speed", REPO / "benchmarks" / "quantize_speed.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    result = benchmark.main(out_dir=tmp_path, tiny=True, device="cpu")
    assert (tmp_path / "quantize_speed.json").is_file()
    assert len(result["block_seconds"]) == 2 and result["quantized_linears"] == 10
    assert all(0 < g <= b for g, b in zip(result["gptq_seconds"], result["block_seconds"]))


@pytest.mark.parametrize("recipe", sorted((REPO / "config_hub" / "quantize" / "gptq").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_recipes_are_valid_cli_arguments(recipe):
    from litquant.quantize.main import quantize

    settings = yaml.safe_load(recipe.read_text())
    unknown = set(settings) - set(inspect.signature(quantize).parameters)
    assert not unknown, f"{recipe.name}: not parameters of `litquant quantize`: {unknown}"
    assert settings["method"] == "gptq"
    QuantizeConfig(**{k: v for k, v in settings.items() if k in inspect.signature(QuantizeConfig).parameters})


# ---------------------------------------------------------------- quality on a real model


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct, its calibration tokens (from a file of the Jargon File's calibration slice, as a
    user would pass it) and the evaluation slice's tokens."""
    from litgpt.tokenizer import Tokenizer

    from litquant import assets
    from litquant.quantize.calibration import calibration_tokens

    checkpoint_dir = assets.smollm2_checkpoint()
    tokenizer = Tokenizer(checkpoint_dir)
    model = GPT(Config.from_file(checkpoint_dir / "model_config.yaml"))
    model.load_state_dict(torch.load(checkpoint_dir / "lit_model.pth", mmap=True))
    calibration_file = tmp_path_factory.mktemp("calibration") / "jargon.txt"
    calibration_file.write_text(assets.calibration_text())
    calibration = calibration_tokens(tokenizer, calibration_file=calibration_file, num_samples=16, seq_len=512)
    return model.eval(), calibration, tokenizer.encode(assets.evaluation_text()).long()


@pytest.mark.real_model
def test_gptq_beats_rtn_on_smollm2(smollm2):
    """Perplexity on held-out text with the weights replaced by their dequantized QuantizedWeights."""
    from litquant.perplexity import compute_perplexity

    model, calibration, evaluation = smollm2
    perplexity = lambda m: compute_perplexity(m, evaluation, window=512, max_windows=8)[0]  # noqa: E731
    results = {"full precision": perplexity(model)}
    for bits in (4, 3):
        results[f"RTN {bits}-bit g64"] = perplexity(rtn_model(model, bits, 64))
        gptq = copy.deepcopy(model)
        # the settings of config_hub/quantize/gptq/smollm2-135m.yaml, with all Hessians of a block from one
        # pass (true_sequential=False) to keep the test within a few minutes on two cores
        config = QuantizeConfig(method="gptq", bits=bits, group_size=64, desc_act=True, true_sequential=False)
        quantize_model(gptq, calibration, config, "cpu")
        results[f"GPTQ {bits}-bit g64"] = perplexity(gptq)
    print("SmolLM2-135M perplexity:", {name: round(ppl, 2) for name, ppl in results.items()})
    full, rtn4, gptq4 = results["full precision"], results["RTN 4-bit g64"], results["GPTQ 4-bit g64"]
    assert gptq4 < rtn4 - (rtn4 - full) / 3  # closes at least a third of the gap to full precision
    assert results["GPTQ 3-bit g64"] < results["RTN 3-bit g64"] / 2
