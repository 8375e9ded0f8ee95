"""The format-neutral quantized weight, and the bit packing and tensor check that GPTQ and AWQ share."""
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class QuantizedWeight:
    """One quantized Linear with `in_features` K and `out_features` N, unpacked.

    The dequantized weight is `W[n, k] = scales[g_idx[k], n] * (codes[k, n] - zeros[g_idx[k], n])`.
    Rows are input channels (the GPTQ orientation, `W.T`). Zeros are true zero points (no GPTQ v1
    "-1" quirk); a symmetric quantization has every zero at `2 ** (bits - 1)`.
    """

    codes: torch.Tensor  # uint8 [K, N], each in [0, 2**bits)
    scales: torch.Tensor  # float16 [G, N]
    zeros: torch.Tensor  # uint8 [G, N]
    g_idx: torch.Tensor  # int32 [K], the group of each input row
    bits: int
    group_size: int  # -1: one group over all of K
    bias: Optional[torch.Tensor] = None  # [N]

    @property
    def in_features(self) -> int:
        return self.codes.shape[0]

    @property
    def out_features(self) -> int:
        return self.codes.shape[1]

    @property
    def sym(self) -> bool:
        return bool((self.zeros == 2 ** (self.bits - 1)).all())

    @property
    def act_order(self) -> bool:
        """True when g_idx is not the plain `k // group_size`, i.e. rows were quantized out of order."""
        return not torch.equal(self.g_idx, default_g_idx(self.in_features, self.group_size, self.g_idx.device))

    def rows_by_group(self, kernel: str) -> Optional[torch.Tensor]:
        """act_order: the input rows sorted by group (int64 [K]), which makes every group a contiguous run of rows
        again; None without act_order. A kernel that takes them so needs groups of exactly `group_size` rows, as
        GPTQ's desc_act writes them (the torch kernel takes any g_idx)."""
        if not self.act_order:
            return None
        rows = torch.argsort(self.g_idx, stable=True)
        if not torch.equal(self.g_idx[rows], default_g_idx(self.in_features, self.group_size, self.g_idx.device)):
            raise ValueError(f"{kernel}'s act_order needs every group to hold exactly group_size rows (as GPTQ desc_act "
                             "writes them); this g_idx does not. The torch kernel can run it.")
        return rows

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as [N, K] in `dtype`, the layout of `nn.Linear.weight`."""
        g = self.g_idx.long()
        w = (self.codes.to(torch.float32) - self.zeros[g].to(torch.float32)) * self.scales[g].to(torch.float32)
        return w.t().to(dtype).contiguous()

    def to(self, device) -> "QuantizedWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedWeight(move(self.codes), move(self.scales), move(self.zeros), move(self.g_idx),
                               self.bits, self.group_size, move(self.bias))


def check_tensors(tensors: dict, expected: dict, format_name: str, where: str = "") -> None:
    """Raise a ValueError naming every tensor of `expected` ({name: (shape, dtype)}) that `tensors` lacks or holds
    with another shape or dtype (`where` prefixes the names)."""
    problems = []
    for name, (shape, dtype) in expected.items():
        t = tensors.get(name)
        if t is None:
            problems.append(f"{where}{name} is missing")
        elif tuple(t.shape) != shape or t.dtype != dtype:
            problems.append(f"{where}{name} is {t.dtype} {list(t.shape)}, expected {dtype} {list(shape)}")
    if problems:
        raise ValueError(f"{format_name} tensors do not match the layer: " + "; ".join(problems))


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size == -1 else -(-in_features // group_size)


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """`k // group_size` for every input row (all zeros for group_size -1)."""
    k = torch.arange(in_features, dtype=torch.int32, device=device)
    return torch.zeros_like(k) if group_size == -1 else k // group_size


def pack_along_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-wide codes [R, C] into int32 words [R * bits / 32, C] along dim 0.

    Value j of the bit stream of a column sits at bits [bits*j, bits*j+bits) of that stream, least
    significant first, with the stream laid over consecutive 32-bit words. For 2/4/8 bits a value never
    crosses a word; for 3 bits, 32 values fill 3 words and values 10 and 21 straddle word boundaries
    (the AutoGPTQ 3-bit layout). R must be a multiple of 32 / gcd(32, bits) (pad before calling).
    """
    rows, cols = codes.shape
    if (rows * bits) % 32:
        raise ValueError(f"cannot pack {rows} rows of {bits}-bit codes into whole 32-bit words")
    # Each code contributes its bit b to stream position bits*j + b. Build the stream as a bit matrix
    # [rows*bits, cols], then fold every 32 stream bits into one word.
    c = codes.to(torch.int64)
    shifts = torch.arange(bits, device=codes.device)
    stream = ((c.unsqueeze(1) >> shifts.view(1, bits, 1)) & 1).reshape(rows * bits, cols)
    stream = stream.view(rows * bits // 32, 32, cols)
    weights = (torch.ones(32, dtype=torch.int64, device=codes.device) << torch.arange(32, device=codes.device))
    words = (stream * weights.view(1, 32, 1)).sum(1)
    return to_int32(words)


def unpack_along_rows(words: torch.Tensor, bits: int, rows: Optional[int] = None) -> torch.Tensor:
    """Inverse of `pack_along_rows`: int32 [R * bits / 32, C] -> uint8 [rows, C] (rows <= R)."""
    nwords, cols = words.shape
    total = nwords * 32 // bits
    if 32 % bits == 0:  # fast path: whole codes per word; int32 shifts (the sign fill is masked away)
        per = 32 // bits
        shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
        codes = ((words.unsqueeze(1) >> shifts.view(1, per, 1)) & ((1 << bits) - 1)).reshape(total, cols)
    else:  # general path through the bit stream (3-bit)
        w = words.to(torch.int64) & 0xFFFFFFFF
        stream = ((w.unsqueeze(1) >> torch.arange(32, device=words.device).view(1, 32, 1)) & 1)
        stream = stream.reshape(total, bits, cols)
        codes = (stream << torch.arange(bits, device=words.device).view(1, bits, 1)).sum(1)
    codes = codes.to(torch.uint8)
    return codes if rows is None else codes[:rows]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64 -> the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def rows_multiple(bits: int) -> int:
    """Smallest number of rows that packs into whole 32-bit words."""
    from math import gcd

    return 32 // gcd(32, bits)
