"""fc_1 and fc_2 of LLaMA-style MLPs as one quantized layer (litquant.fuse, `QuantLinear.concat`)."""
from dataclasses import replace

import pytest
import torch
from litgpt.model import LLaMAMLP

import litquant.load
from litquant.fuse import GateUpMLP
from litquant.kernels.base import LayerSpec
from litquant.kernels.torch_dequant import TorchQuantLinear
from litquant.load import load_model
from litquant.quantize.main import quantize
from litquant.quantize.quantizer import rtn_quantize


def torch_layer(qw, act_order: bool = False) -> TorchQuantLinear:
    spec = LayerSpec(qw.in_features, qw.out_features, qw.bits, qw.group_size, qw.sym, act_order)
    layer = TorchQuantLinear(qw.in_features, qw.out_features, qw.bias is not None, spec, torch.float32)
    layer.load_quantized(qw)
    return layer


def shuffled_g_idx(k: int, group_size: int, seed: int) -> torch.Tensor:
    """A GPTQ act_order g_idx: group i holds the rows at positions [i*g, (i+1)*g) of a random order."""
    order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


@pytest.mark.parametrize("bits,sym,act_order,bias", [(4, True, False, False), (4, False, True, True),
                                                     (3, False, False, False), (8, True, True, False)])
def test_concat_is_both_layers_side_by_side(bits, sym, act_order, bias):
    torch.manual_seed(0)
    first, second = (rtn_quantize(torch.randn(n, 64), bits, 32, sym) for n in (96, 64))
    if act_order:
        first = replace(first, g_idx=shuffled_g_idx(64, 32, seed=1))
        second = replace(second, g_idx=first.g_idx.clone())
    if bias:
        first, second = replace(first, bias=torch.randn(96)), replace(second, bias=torch.randn(64))
    a, b = torch_layer(first, act_order), torch_layer(second, act_order)
    fused = a.concat(b)
    assert fused is not None and fused.out_features == 160 and fused.spec.out_features == 160
    assert not any(t.data_ptr() == u.data_ptr() for t in fused.buffers() for u in a.buffers() if t.numel())
    x = torch.randn(5, 64)
    torch.testing.assert_close(fused(x), torch.cat([a(x), b(x)], -1), rtol=1e-5, atol=1e-5)
    assert a.out_features == 96 and a(x).shape == (5, 96)  # the originals are untouched


def test_layers_that_do_not_line_up_stay_apart():
    torch.manual_seed(0)
    qw = rtn_quantize(torch.randn(64, 64), 4, 32, False)
    a = torch_layer(replace(qw, g_idx=shuffled_g_idx(64, 32, seed=1)), act_order=True)
    b = torch_layer(replace(qw, g_idx=shuffled_g_idx(64, 32, seed=2)), act_order=True)
    assert a.concat(b) is None  # two different act_order permutations
    assert torch_layer(qw).concat(torch_layer(rtn_quantize(torch.randn(64, 64), 4, 16, False))) is None  # group size
    assert torch_layer(qw).concat(torch_layer(rtn_quantize(torch.randn(64, 128), 4, 32, False))) is None  # K
    three_bit = rtn_quantize(torch.randn(40, 64), 3, 32, False)  # 40 x 3 bits of zero points: not whole words
    assert torch_layer(three_bit).concat(torch_layer(three_bit)) is None


def test_loaded_model_runs_gate_and_up_as_one_layer(tiny_llama_checkpoint, tmp_path, monkeypatch):
    out = quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, kernel="torch",
                   device="cpu")
    fused = load_model(out, device="cpu", precision="32-true").model
    mlps = [block.mlp for block in fused.transformer.h]
    assert all(type(mlp) is GateUpMLP and mlp.fc_1_2.out_features == 2 * 160 for mlp in mlps)
    monkeypatch.setattr(litquant.load, "fuse_gate_up", lambda model: 0)
    separate = load_model(out, device="cpu", precision="32-true").model
    assert all(type(block.mlp) is LLaMAMLP for block in separate.transformer.h)
    idx = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(fused(idx), separate(idx), rtol=1e-5, atol=1e-5)
