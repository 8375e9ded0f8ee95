"""The shared grid arithmetic: RTN's vectorized groups equal group-by-group quantization, errors are bounded."""
import pytest
import torch

from litquant.quantize.quantizer import dequantize_codes, find_params, quantize_codes, rtn_quantize


def group_bounds(in_features: int, group_size: int):
    """(start, end) of each group of input columns, one at a time: the reference for RTN's vectorized groups."""
    size = in_features if group_size == -1 else group_size
    return [(s, min(s + size, in_features)) for s in range(0, in_features, size)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("k,group_size", [(96, 32), (100, 32), (64, -1), (70, 64)])
def test_rtn_equals_group_by_group(bits, sym, k, group_size):
    torch.manual_seed(0)
    w = torch.randn(24, k) * torch.rand(24, 1)
    qw = rtn_quantize(w, bits, group_size, sym)
    deq = qw.dequantize()
    for i, (s, e) in enumerate(group_bounds(k, group_size)):
        scale, zero = find_params(w[:, s:e], bits, sym)
        assert torch.equal(qw.scales[i].float(), scale) and torch.equal(qw.zeros[i].float(), zero)
        expected = dequantize_codes(quantize_codes(w[:, s:e], scale, zero, bits), scale, zero)
        assert torch.allclose(deq[:, s:e], expected)
        # symmetric: off by at most half a step; zero-point: the rounded zero shifts the grid by up to half a step
        step = scale.unsqueeze(1) * (0.5 if sym else 1.0)
        assert ((deq[:, s:e] - w[:, s:e]).abs() <= step * (1 + 1e-5)).all()
    if sym:
        assert (qw.zeros == 2 ** (bits - 1)).all()


def test_dead_rows_and_tiny_ranges_stay_finite():
    w = torch.zeros(4, 32)
    w[1] = 1e-9
    qw = rtn_quantize(w, 4, 32, False)
    assert torch.isfinite(qw.dequantize()).all() and (qw.scales > 0).all()
