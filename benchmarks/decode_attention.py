"""Prototype: batch-1 decode attention over a static KV cache that reads only the positions its mask lets it see.

Not part of litquant yet: this script holds the kernel and measures it against torch's SDPA (cuDNN on Hopper) at
decode shapes, so that it is moved into the package only if it pays. Why: compiled, litgpt's attention reads the
whole static cache under its mask (the filled length, `input_pos_maxp1`, would record a CUDA graph per length),
and at decode cuDNN takes ~7 us a layer at 144 positions and 28 us at 4096 (benchmarks/results/
2026-12-01-sdpa-decode.log): a tenth of a Llama-2-7B marlin token, and +0.57 ms a token with chat's 4096-position
cache.

The kernel (split-KV "flash decoding"): program (b, h, s) takes the 64-position tiles s, s + S, s + 2S, ... of the
cache (interleaved, so the filled prefix spreads over all S splits whatever its length), loads a tile's mask first
and skips the tile's keys and values where nothing is visible, and keeps an online softmax in fp32 (running max,
sum and weighted values). A second program per (b, h) rescales the S partial results to a common max and adds
them in split order: the same shapes every step (one CUDA graph), deterministic, and only the visible positions'
keys and values are read.

    python benchmarks/decode_attention.py                      # GPU: check, then time against torch's SDPA
    python benchmarks/decode_attention.py --e2e                # GPU: and in a compiled Llama-2-7B-shaped model
    python benchmarks/decode_attention.py --self-test          # CPU: the Triton interpreter, small shapes
"""
import argparse
import math
import os
import sys

if "--self-test" in sys.argv:  # Triton decides at import whether kernels are compiled or interpreted
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the other benchmarks, for their helpers
BLOCK_N = 64


@triton.jit
def _attend_split(q_ptr, k_ptr, v_ptr, mask_ptr, part_ptr, L, scale,
                  stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                  stride_mb, stride_mn,
                  H: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Partial attention of query (b, h) over tiles split, split + SPLITS, ...: writes [acc (D), max, sum]."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b, h = bh // H, bh % H
    kv_head = h // GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32) * scale
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    running_max = tl.full([], float("-inf"), tl.float32)
    running_sum = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D], tl.float32)
    for tile in range(split, tl.cdiv(L, BLOCK_N), SPLITS):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = tl.load(mask_ptr + b * stride_mb + n * stride_mn, mask=n < L, other=0) != 0
        if tl.max(visible.to(tl.int32), 0) > 0:  # else nothing of this tile is read
            k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=visible[:, None], other=0.0)
            scores = tl.where(visible, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, 0))
            rescale = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max)
            v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=visible[:, None], other=0.0)
            acc = acc * rescale + tl.sum(p[:, None] * v.to(tl.float32), 0)
            running_sum = running_sum * rescale + tl.sum(p, 0)
            running_max = new_max
    out = part_ptr + (bh * SPLITS + split) * (D + 2)
    tl.store(out + d, acc)
    tl.store(out + D, running_max)
    tl.store(out + D + 1, running_sum)


@triton.jit
def _combine_splits(part_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                    SPLITS_POW2: tl.constexpr):
    """out[b, h] = the S partial results rescaled to their common max, added in split order, over their sum."""
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, D)
    rows = part_ptr + (bh * SPLITS + s) * (D + 2)
    maxes = tl.load(rows + D, mask=s < SPLITS, other=float("-inf"))
    sums = tl.load(rows + D + 1, mask=s < SPLITS, other=0.0)
    accs = tl.load(rows[:, None] + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
    top = tl.max(maxes, 0)
    weights = tl.where(maxes == float("-inf"), 0.0, tl.exp(maxes - top))  # splits that saw nothing weigh 0
    total = tl.sum(weights[:, None] * accs, 0) / tl.sum(weights * sums, 0)
    tl.store(out_ptr + bh * D + d, total.to(out_ptr.dtype.element_ty))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float = None, min_programs: int = 264, out: torch.Tensor = None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for one query token: q [B, H, 1, D]; k, v [B, Hkv, L, D] (H a multiple of
    Hkv; the last dim contiguous); mask bool [B or 1, 1, 1, L], True where a position is visible. Written into
    `out` (contiguous [B, H, 1, D]) if given."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if T != 1 or H % Hkv or k.stride(-1) != 1 or v.stride(-1) != 1 or D & (D - 1):
        raise ValueError(f"decode_attention takes one query token, H a multiple of Hkv, contiguous head dims of a "
                         f"power of two; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    scale = scale if scale is not None else D ** -0.5
    tiles = triton.cdiv(L, BLOCK_N)
    splits = max(1, min(tiles, triton.cdiv(min_programs, B * H)))  # enough programs to fill the GPU
    partial = torch.empty(B * H, splits, D + 2, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, 1, D, dtype=q.dtype, device=q.device) if out is None else out
    mask = mask.reshape(mask.shape[0], L)
    stride_mb = mask.stride(0) if mask.shape[0] > 1 else 0
    _attend_split[(B * H, splits)](q, k, v, mask, partial, L, scale, q.stride(0), q.stride(1), k.stride(0),
                                   k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), stride_mb,
                                   mask.stride(1), H=H, GROUP=H // Hkv, D=D, SPLITS=splits, BLOCK_N=BLOCK_N)
    _combine_splits[(B * H,)](partial, out, H=H, D=D, SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits))
    return out


def reference(q, k, v, mask, scale=None):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)


def relative_error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def check(device: str, dtype: torch.dtype, H: int, Hkv: int, D: int, cache: int, filled: int, bound: float) -> float:
    """Random q and cache (positions past `filled` poisoned with NaN: they must not be read), output poisoned."""
    q = torch.randn(1, H, 1, D, device=device, dtype=dtype)
    k = torch.randn(1, Hkv, cache, D, device=device, dtype=dtype)
    v = torch.randn_like(k)
    mask = torch.zeros(1, 1, 1, cache, dtype=torch.bool, device=device)
    mask[..., :filled] = True
    ref = reference(q, k, v, mask)
    k[:, :, filled:], v[:, :, filled:] = float("nan"), float("nan")
    out = torch.full_like(q, float("nan"))
    err = relative_error(decode_attention(q, k, v, mask, out=out), ref)
    assert err < bound, f"H={H} Hkv={Hkv} D={D} cache={cache} filled={filled}: relative error {err:.2e}"
    return err


def self_test() -> None:
    """Under the Triton interpreter, on the CPU, at small shapes: odd fills, a fill inside the first tile, GQA;
    then a tiny litgpt model's greedy tokens with `use_decode_attention` against litgpt's own attention."""
    from litgpt.config import Config
    from litgpt.model import GPT

    from litquant.generate import decode

    torch.manual_seed(0)
    for H, Hkv, D, cache, filled in [(4, 4, 32, 200, 1), (4, 2, 32, 200, 77), (6, 2, 16, 130, 130), (2, 1, 64, 64, 64)]:
        err = check("cpu", torch.float32, H, Hkv, D, cache, filled, 1e-5)
        print(f"H={H} Hkv={Hkv} D={D} cache={cache} filled={filled}: relative error {err:.1e}")
    config = Config(block_size=96, vocab_size=96, padded_vocab_size=96, n_layer=2, n_head=4, n_query_groups=2,
                    n_embd=128, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
                    mlp_class_name="LLaMAMLP", intermediate_size=256)
    model = GPT(config).eval()
    model.max_seq_length = 80
    prompt = torch.randint(0, 96, (7,))
    runs = []
    for patched in (False, True):
        if patched:
            use_decode_attention(model)
        model.set_kv_cache(batch_size=1)
        runs.append([t for part in decode(model, prompt, 60, temperature=0.0) for t in part])
    assert runs[0] == runs[1], "a tiny model's greedy tokens with decode_attention differ from litgpt's"
    print("tiny litgpt model: the same 60 greedy tokens with decode_attention")


def benchmark(H: int = 32, Hkv: int = 32, D: int = 128) -> None:
    """Llama-2-7B's attention (32 heads of 128) in bf16: caches of 144 and 4096 positions, several fills; each call
    replayed from a CUDA graph, as in the compiled model (benchmarks/kernels.py's timing)."""
    from kernels import time_calls

    torch.manual_seed(0)
    for cache, filled in [(144, 144), (4096, 144), (4096, 1024), (4096, 4096)]:
        err = check("cuda", torch.bfloat16, H, Hkv, D, cache, filled, 1e-2)
        q = torch.randn(1, H, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, Hkv, cache, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.zeros(1, 1, 1, cache, dtype=torch.bool, device="cuda")
        mask[..., :filled] = True
        ours = time_calls([lambda q: decode_attention(q, k, v, mask)], q)[0] * 1e6
        group = H // Hkv
        kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        sdpa = time_calls([lambda q: F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)], q)[0] * 1e6
        print(f"cache {cache:5d} filled {filled:5d}: decode_attention {ours:6.2f} us (error {err:.1e}), "
              f"torch SDPA {sdpa:6.2f} us", flush=True)


@torch.library.custom_op("litquant_prototype::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    return decode_attention(q, k, v, mask, scale)


@decode_attention_op.register_fake
def _(q, k, v, mask, scale):
    return q.new_empty(q.shape)


def use_decode_attention(model) -> None:
    """Route each litgpt attention layer's one-token steps with a boolean mask (batch decode over the KV cache) to
    `decode_attention`; everything else (prefill, softcapping, sliding-window biases) stays on litgpt's code."""
    for block in model.transformer.h:
        attn, original = block.attn, block.attn.scaled_dot_product_attention

        def attend(q, k, v, mask=None, attn=attn, original=original):
            if q.size(2) == 1 and mask is not None and mask.dtype == torch.bool \
                    and attn.config.attention_logit_softcapping is None:
                scale = attn.mscale ** 2 / math.sqrt(attn.config.attention_scores_scalar or attn.config.head_size)
                return decode_attention_op(q, k, v, mask, scale).transpose(1, 2)
            return original(q, k, v, mask)

        attn.scaled_dot_product_attention = attend


def end_to_end(variant: str = "marlin", tokens: int = 100) -> None:
    """A Llama-2-7B-shaped model (benchmarks/e2e_decode.py), compiled decode, litgpt's attention against
    `decode_attention`, with caches of 124 and 4096 positions; then greedy tokens of both, eager, compared."""
    from litgpt.config import Config

    from e2e_decode import build, decoder
    from litquant.generate import decode, set_kv_cache

    model = build(Config.from_name("Llama-2-7b-hf"), variant)
    speeds = {}
    for patched in (False, True):
        if patched:
            use_decode_attention(model)
        for cache in (16 + tokens + 8, 4096):
            torch._dynamo.reset()
            speeds[patched, cache] = tokens / decoder(model, True, cache - 16 - 8)(tokens)
            print(f"{'decode_attention' if patched else 'litgpt SDPA':16} cache {cache:5d}: "
                  f"{speeds[patched, cache]:6.1f} tok/s", flush=True)
    # eager greedy tokens, patched against litgpt's attention (the same model, another attention kernel)
    prompt = torch.randint(0, model.config.vocab_size, (16,), device="cuda")
    model.max_seq_length = 16 + 32
    runs = {}
    for patched in (True, False):
        if not patched:
            for block in model.transformer.h:
                del block.attn.scaled_dot_product_attention  # back to the class's method
        set_kv_cache(model, torch.device("cuda"))
        runs[patched] = [t for part in decode(model, prompt, 32, temperature=0.0) for t in part]
    same = next((i for i, (a, b) in enumerate(zip(runs[True], runs[False])) if a != b), 32)
    print(f"eager greedy tokens: the first {same} of 32 agree", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true", help="run on the CPU under the Triton interpreter")
    parser.add_argument("--e2e", action="store_true", help="also time a compiled 7B-shaped model with it")
    args = parser.parse_args()
    if args.self_test:
        self_test()
    else:
        benchmark()
        if args.e2e:
            end_to_end()
