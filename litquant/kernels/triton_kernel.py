"""The `triton` kernel: a fused dequantize-matmul for 2/3/4/8-bit GPTQ (with or without act_order) and AWQ weights.

This module packs the weights, and picks and launches the Triton programs, which live in `triton_programs` (the
functions named below in backquotes are there, unless this module has them).

Layout (built once at load by `repack`, with vectorized torch on the target device)
    K is cut into chunks of ROWS = 16 * V input rows, V = 32 // bits codes per int32 word (ROWS = 128 at 4 bits;
    at 3 bits ten codes fill 30 bits of a word, so a weight takes 3.2 bits here against 3 on disk, where AutoGPTQ
    packs 32 codes into 3 words and two of them straddle word boundaries, out of reach of one shift and mask).
    `qweight[c, n, w]` (int32 [C, N, 16]) is word w of chunk c of output column n; its field j (bits
    [bits*j, bits*(j+1))) is the code of input row k = c*ROWS + 16*j + w. Hence:
    - one chunk of a [BLOCK_N] column block is one contiguous block of BLOCK_N * 64 bytes (coalesced loads);
    - field j of a [BLOCK_N, 16] word tile is the weight of 16 *consecutive* input rows: it multiplies 16
      consecutive activations, by broadcast FMAs or by a tl.dot with K = 16, with no shuffle of unpacked values;
    - a 16-row run lies inside one quantization group when 16 divides the group size, and when ROWS divides it
      too, so does the whole chunk (`GROUP_PER_CHUNK`: scales are then loaded once per chunk).
    act_order (GPTQ desc_act): rows are sorted by group (`perm`), which makes the groups contiguous again; the
    kernels read activation column perm[k] for sorted row k (for large M, x is permuted once instead).
    `scale_zero` (int32 [G, N]) holds each group's fp16 scale in its low 16 bits and its zero point z (an integer;
    2**(bits-1) for symmetric weights) in the high 16: one 4-byte load, which Triton's pipeliner copies ahead with
    cp.async (a 2-byte one it loads in the loop, and the mma path waited on it every chunk).

Paths, picked per (device, dtype, N, K, M bucket) by timing the candidates once (`choose_config`)
    gemv     BLOCK_M activation rows per program, [BLOCK_N, 16] word tiles, fp32 FMAs on the CUDA cores, split-K over
             chunks for occupancy, chunks streamed through a cp.async pipeline: decode (M = 1..4), memory bound.
             Fields are read as denormal floats (`_field_product`): one AND and one FMA per weight.
    mma      tensor cores: out^T = W @ x^T for a [BLOCK_N, BLOCK_M] tile, the weights being the register operand,
             dequantized in 16 bits where they lie (`_field_pairs`): from sm_90 one dot a chunk, its fields set
             side by side in registers (`_fields_side_by_side`), on sm_80 one K = 16 dot a field; split-K when
             the tiles alone do not fill the GPU, grouped tile order for L2 reuse at large M.
    wgmma    sm_90, M > 64, 2/4-bit codes in groups of whole chunks: the same product in Gluon
             (`triton_wgmma`), which dequantizes each field while the wgmmas of the 4 before it run (the tile
             language waits for a dot's wgmmas before the next dequantization; see there); the tiles of a last,
             partial round of the SMs split over K or shared out stream-K, in the same launch.
    dequant  `dequant_kernel` writes the whole weight in the activation dtype (one [BLOCK_N, ROWS] tile per
             chunk), then cuBLAS: for large, compute-bound M.
    Split-K partial sums go to an fp32 buffer [SPLIT_K, M, N]; the last program of each output tile to finish
    adds them up in split order (deterministic), adds the bias and casts (`_write_result`): one launch per matmul.
    Measured slower on an H200 and not kept (benchmarks/results/2026-11-30-triton-*.log): in gemv, prefetching
    the next chunk into registers with a shift-free decode (AND/OR, then FADD), and (before the denormal decode)
    fields masked into two mantissa windows under the exponent of 1.0; in mma, one K = ROWS dot per chunk
    on a [BLOCK_N, VALUES, 16] -> [BLOCK_N, ROWS] reshaped tile, also with x pre-permuted to the unpacked order
    (0.23-0.40x cuBLAS at M = 64..4096, either operand order), and again with the fields interleaved
    (tl.interleave) against x permuted to match: x then streams through cp.async and the wgmmas overlap, but
    the tile's layout goes through shared memory each chunk, and it was slower than this path at every M
    (2026-12-01-triton-mma-one-dot.log); and with the words read as bytes, one K = 64 dot per nibble plane against
    x permuted to match (the bytes load from shared memory straight into the dot operand's layout), the best
    config was 0.33-0.55x cuBLAS at M = 256 and 0.56-0.69x at M = 4096 (2026-12-01-triton-byte-planes.log). The
    dequant path is already at ~87% of its bandwidth bound (it must write 2 bytes per weight), so dequant +
    cuBLAS cannot pass ~0.5x of cuBLAS at M = 256: large M needs the fused path, one dot a chunk
    (`mma_kernel`).
"""
import contextlib
import logging
import os
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from litquant.formats import QuantizedWeight
from litquant.formats.common import to_int32
from litquant.kernels import triton_programs as programs
from litquant.kernels.base import QuantLinear, dependent_launches_allowed
from litquant.kernels.ops import quant_linear_op

# Triton decides at import (when `triton.jit` runs) whether kernels are compiled or interpreted on the CPU.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
log = logging.getLogger("litquant.kernels.triton")
SUPPORTED_BITS = (2, 3, 4, 8)
WORDS_PER_CHUNK = 16
NO_GROUP = 1 << 30  # the group size the kernels see for group_size -1: every row is in group 0
PERMUTE_X_ABOVE_M = 64  # act_order: above this many rows, permute x once rather than gather it in every tile


def chunk_rows(bits: int) -> int:
    """Input rows per chunk of the packed layout (128 at 4 bits, 160 at 3)."""
    return WORDS_PER_CHUNK * (32 // bits)


@dataclass
class PackedWeight:
    """A `QuantizedWeight` in this kernel's layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 [C, N, 16]
    scale_zero: torch.Tensor  # int32 [G, N]: fp16 scale bits | zero point << 16
    perm: Optional[torch.Tensor]  # int32 [K]: sorted row k is input channel perm[k]; None without act_order
    locks: torch.Tensor  # int32 split-K arrival counters (`new_locks`): zero between calls
    bits: int
    group_size: int


def repack(qw: QuantizedWeight) -> PackedWeight:
    """Repack `qw` (on any device) into the layout of the kernels, with vectorized torch on that device."""
    bits, group_size = qw.bits, qw.group_size
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"the triton kernel supports {'/'.join(map(str, SUPPORTED_BITS))}-bit weights, not {bits}-bit")
    if group_size != -1 and (group_size <= 0 or group_size % WORDS_PER_CHUNK):
        raise ValueError(f"the triton kernel needs group_size -1 or a multiple of {WORDS_PER_CHUNK}, got {group_size}")
    k, n = qw.in_features, qw.out_features
    codes, perm = qw.codes, qw.rows_by_group("triton")
    if perm is not None:
        codes, perm = codes[perm], perm.to(torch.int32)
    values, rows = 32 // bits, chunk_rows(bits)
    chunks = -(-k // rows)
    padded = torch.zeros(chunks * rows, n, dtype=torch.uint8, device=codes.device)
    padded[:k] = codes
    fields = padded.view(chunks, values, WORDS_PER_CHUNK, n)  # [c, j, w, n] holds row c*rows + 16*j + w
    words = torch.zeros(chunks, WORDS_PER_CHUNK, n, dtype=torch.int64, device=codes.device)
    for j in range(values):  # one vectorized pass per field
        words |= fields[:, j].to(torch.int64) << (bits * j)
    words = to_int32(words)
    scale_bits = qw.scales.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    scale_zero = (scale_bits | qw.zeros.to(torch.int32) << 16).contiguous()
    return PackedWeight(words.transpose(1, 2).contiguous(), scale_zero, perm, new_locks(n, codes.device), bits,
                        group_size)


# ---------------------------------------------------------------------------------------------------------------
# Launch, configs and tuning
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    """One way to run the matmul: the path and its tile sizes."""

    path: str  # "gemv", "mma", "wgmma" (Hopper, `triton_wgmma`) or "dequant"
    block_n: int = 128
    block_m: int = 16
    split_k: int = 1  # runs of K's chunks a tile (wgmma: a tile of the last, partial round), summed by the last
    num_warps: int = 4
    num_stages: int = 2
    fields_per_dot: Optional[int] = None  # mma: F of `mma_kernel`; None: `default_fields_per_dot`
    x_descriptor: bool = False  # mma: x through a TMA descriptor where `_x_descriptor` can make one
    dependent: bool = False  # gemv, sm_90 on: launched as a programmatic dependent (see `gemv_kernel`)
    stream_k: bool = False  # wgmma: the last round's chunks shared out over all SMs (`triton_wgmma.launch`)


GEMV_MAX_M = 4
TUNING_ROUNDS = 2
TUNING_CALLS = 8  # calls per timed graph replay, at least
TUNING_MAX_COPIES = 64  # of the weight while tuning (a layer that small is latency bound anyway)
TUNING_SETTLE_S = 0.5  # of replays before timing the candidates for M >= DEQUANT_MIN_M (see `choose_config`)
DEQUANT_MIN_M = 256
WGMMA_BITS = (2, 4)  # the wgmma path's: fields a power of two, codes that fit bf16's mantissa
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_TUNED: Dict[tuple, KernelConfig] = {}


def _before_hopper(device: torch.device) -> bool:
    """A CUDA GPU older than sm_90 (the CPU, under the interpreter, takes Hopper's paths)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9


def _hopper(device: torch.device) -> bool:
    """An sm_90 GPU, the one the wgmma path (Gluon, `triton_wgmma`) is written for."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def default_fields_per_dot(bits: int, device: torch.device) -> int:
    """The mma path's fields a dot unless a config says: the whole chunk (its largest power of two at 3 bits) from
    sm_90 on, and under the interpreter; one below sm_90 (see `mma_kernel`)."""
    if _before_hopper(device):
        return 1
    return 1 << ((32 // bits).bit_length() - 1)


def _x_descriptor(x: torch.Tensor, rows: int, block_m: int, fields: int, bits: int) -> Optional[TensorDescriptor]:
    """A TMA descriptor of x [M, K] with [block_m, rows] blocks, where the mma kernel can take one: not before
    sm_90, at one dot a chunk, with x 16-byte aligned; else None (the kernel then loads x itself)."""
    if _before_hopper(x.device) or fields != 32 // bits or not _tma_aligned(x):
        return None
    return TensorDescriptor.from_tensor(x, [block_m, rows])


def _tma_aligned(x: torch.Tensor) -> bool:
    """Whether x's start and rows are 16-byte aligned, as a TMA descriptor of it needs."""
    return x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0


def _wgmma_supports(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the wgmma path can take this call: sm_90, 16-bit x with K a multiple of 8 (its rows 16-byte aligned
    for the TMA descriptor; the launch copies a misaligned x), WGMMA_BITS, groups of whole chunks or none."""
    return (_hopper(x.device) and x.dtype in (torch.float16, torch.bfloat16) and x.shape[1] % 8 == 0
            and bits in WGMMA_BITS and (group_size == -1 or group_size % chunk_rows(bits) == 0))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def lock_count(n: int, device: torch.device) -> int:
    """Split-K arrival counters that any config may need for N output columns: one per output tile that is split,
    i.e. gemv's rows (<= GEMV_MAX_M) x column tiles (>= 64 wide), mma's tiles (one row tile up to M = 64, and fewer
    tiles than SMs above it, where it splits)."""
    return max(GEMV_MAX_M * -(-n // 64), _sm_count(device))


def new_locks(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed split-K arrival counters for N output columns (the kernels leave them zeroed after each call)."""
    return torch.zeros(lock_count(n, device), dtype=torch.int32, device=device)


def m_bucket(m: int) -> int:
    """The power of two >= m: configs are tuned per bucket, so decode never re-tunes for a new M."""
    return 1 << max(0, (m - 1).bit_length())


def candidate_configs(m: int, n: int, k: int, bits: int, device: torch.device) -> List[KernelConfig]:
    """The configs worth timing for an [m, k] x [k, n] product, the untuned default first."""
    sms, chunks = _sm_count(device), -(-k // chunk_rows(bits))

    def splits(tiles: int, finer: bool = False) -> Tuple[int, ...]:
        """Split-K factors that bring tiles * split to about 2 and 4 programs per SM (powers of two), and when
        `finer` half the first and the factors in between too (3/4 and 3/2 of it: on an H200 at M = 1, 70B-qkv
        20.5 us at 6 splits against 21.6 at 8, 70B-down 43.5 at 12 against 44.4 at 8;
        benchmarks/results/2026-12-01-triton-gemv-splits.log)."""
        want = -(-2 * sms // tiles)
        split = min(1 << (want - 1).bit_length(), chunks)
        factors = {split, min(2 * split, chunks)}
        if finer:
            factors |= {max(1, split // 2), max(1, 3 * split // 4), min(3 * split // 2, chunks)}
        return tuple(sorted(factors))

    configs = []
    if m <= GEMV_MAX_M:
        # Measured on an H200 (benchmarks/results/2026-11-30-triton-gemv.md): 256 columns on 4 warps (8 columns a
        # thread) with a 3-stage cp.async pipeline wins on every Llama-2 layer; the others serve small N. Above one
        # row, a program takes all rows (one read of each weight) or one (fewer registers).
        # From sm_90 the 3-stage ones also run as programmatic dependents (`gemv_kernel`'s DEPENDENT), unless
        # LITQUANT_PDL=0 (`dependent_launches_allowed`).
        pdl = device.type == "cuda" and not _before_hopper(device) and dependent_launches_allowed()
        dependent = (False, True) if pdl else (False,)
        for rows in sorted({m_bucket(m), 1}):
            for block_n, warps, stages in ((256, 4, 3), (256, 4, 2), (128, 4, 3), (64, 4, 2)):
                configs += [KernelConfig("gemv", block_n=block_n, block_m=rows, split_k=s, num_warps=warps,
                                         num_stages=stages, dependent=d)
                            for s in splits(-(-n // block_n) * -(-m // rows), finer=True)
                            for d in dependent if stages == 3 or not d]
    block_m = min(max(16, m_bucket(m)), 128)
    if m <= 64:
        # 3-4 stages: 70B-up at M = 64, 241 us at 4 against 268 at 3 (benchmarks/results/2026-12-01-triton-mma16.md)
        for block_n, stages in ((128, 3), (128, 4), (64, 3)):
            configs += [KernelConfig("mma", block_n=block_n, block_m=block_m, split_k=s, num_stages=stages)
                        for s in splits(-(-n // block_n) * -(-m // block_m))]
    else:
        # With x through TMA (sm_90+), 256-row tiles on 8 warps won on the 70B layers at M = 256 and 1024, and 2
        # stages let two 128 x 128 blocks share an SM (benchmarks/results/2026-12-01-triton-one-dot-a-chunk.md)
        shapes = [(block_m, 128, 4, 3, False), (128, 128, 8, 3, False), (64, 128, 4, 3, False),
                  (128, 256, 8, 3, False)]
        if not _before_hopper(device):
            shapes += [(128, 128, 4, 3, True), (128, 128, 8, 2, True)] + ([(256, 128, 8, 3, True)] if m >= 256 else [])
        if _hopper(device) and bits in WGMMA_BITS:
            # Each also with the tiles of its last, partial round split over K where that fills it better (7B-down
            # at M = 256: 32 tiles of 256 x 128 in 4 runs; 70B-qkv: 132 + 28 tiles of 128 x 128, the 28 in 4), and
            # stream-K (70B-qkv at M = 256: 80 tiles of 256 x 128 over 132 SMs, 7.7% faster than the best of the
            # others; benchmarks/results/2026-12-02-wgmma-stream-k.md).
            from litquant.kernels import triton_wgmma  # Gluon: imported where it runs
            for block_m, stages in ((128, 4), (64, 4)) + (((256, 3),) if m >= 256 and bits == 4 else ()):
                tiles = -(-m // block_m) * -(-n // 128)
                slots = sms * triton_wgmma.stages_and_blocks(bits, 2, block_m, 128, stages, device)[1]
                wgmma = dict(block_n=128, block_m=block_m, num_warps=8, num_stages=stages)
                configs += [KernelConfig("wgmma", split_k=s, **wgmma)
                            for s in sorted({1, triton_wgmma.tail_split(tiles, slots, sms)})]
                if tiles % slots:
                    configs.append(KernelConfig("wgmma", stream_k=True, **wgmma))
        for block_m, block_n, warps, stages, descriptor in shapes:
            tiles = -(-n // block_n) * -(-m // block_m)
            split = 1 if tiles >= sms else splits(tiles)[0]
            configs.append(KernelConfig("mma", block_n=block_n, block_m=block_m, split_k=split, num_warps=warps,
                                        num_stages=stages, x_descriptor=descriptor))
    if m >= DEQUANT_MIN_M:
        configs.append(KernelConfig("dequant"))
    return list(dict.fromkeys(configs))


def _replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    """Median seconds of one replay of `graph` (after a warm-up replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def tuned_configs() -> Dict[tuple, KernelConfig]:
    """The configs chosen so far, keyed by (device, dtype, M bucket, N, K, bits, group_size, act_order?)."""
    return dict(_TUNED)


def choose_config(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, perm: Optional[torch.Tensor],
                  bias: Optional[torch.Tensor], locks: torch.Tensor, bits: int, group_size: int,
                  out: torch.Tensor) -> KernelConfig:
    """The fastest config for this call's (N, K, M bucket), timed once per process on the real tensors.

    Without timing (the interpreter, inside a CUDA-graph capture) the default candidate runs, and is not cached.
    """
    m, k = x.shape
    n = qweight.shape[1]
    key = (x.device, x.dtype, m_bucket(m), n, k, bits, group_size, perm is not None)
    if key in _TUNED:
        return _TUNED[key]
    candidates = [c for c in candidate_configs(m, n, k, bits, x.device)
                  if c.path != "wgmma" or _wgmma_supports(x, bits, group_size)]
    if INTERPRET or x.device.type != "cuda" or torch.cuda.is_current_stream_capturing() or len(candidates) == 1:
        return candidates[0]
    runs = []
    for config in candidates:  # compile them all first (and drop those that do not fit this GPU)
        try:
            launch(config, x, qweight, scale_zero, perm, bias, locks, bits, group_size, out)
            runs.append(config)
        except (OutOfResources, triton.CompilationError) as e:
            warnings.warn(f"triton kernel: skipping {config} for M={m} N={n} K={k}: {type(e).__name__}: {e}")
    if not runs:
        raise RuntimeError(f"triton kernel: no candidate config runs for M={m} N={n} K={k} on {x.device}")
    # Timed as decode runs them: from a CUDA graph (the GPU's time only: timed eagerly, the ~20 us of Python per
    # launch leaked into the 15-25 us of a decode matmul and reordered close configs), calls back to back over
    # copies of the weight that together exceed twice the L2 size (each call streams its weight from DRAM, as
    # in a model; do_bench's flush, a memset, left L2 dirty and favoured other configs than the benchmark's).
    # TUNING_ROUNDS interleaved rounds, each config's best kept (benchmarks/results/2026-11-30-triton-tuning.log,
    # 2026-11-30-triton-split-reduce.log).
    l2_bytes = torch.cuda.get_device_properties(x.device).L2_cache_size
    copies = min(-(-2 * l2_bytes // qweight.nbytes), TUNING_MAX_COPIES)
    weights = [qweight] + [qweight.clone() for _ in range(copies - 1)]
    weights *= -(-TUNING_CALLS // len(weights))
    graphs = {}
    for config in runs:
        graphs[config] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[config]):
            for weight in weights:
                launch(config, x, weight, scale_zero, perm, bias, locks, bits, group_size, out)
    if m >= DEQUANT_MIN_M:
        # Products this large run an H200 at its power cap within a second of a long prefill (its SM clock from
        # 1.98 GHz down to 1.3-1.8), and the ranking of close configs can change there (70B-qkv at M = 256: 128 x
        # 128 tiles split 4 ways beat 256 x 128 unsplit in bursts from idle, 80.5 against 81.1 us, and lost with
        # each config settled on its own, 84.9 against 82.3; benchmarks/results/2026-12-02-wgmma-stream-k.md). So
        # they are timed near the cap, reached by replaying all of them in turn first. (Not measured apart from
        # the stream-K change it came with.)
        until = time.perf_counter() + TUNING_SETTLE_S
        while time.perf_counter() < until:
            for graph in graphs.values():
                graph.replay()
            torch.cuda.synchronize()
    times = {}
    for _ in range(TUNING_ROUNDS):
        for config, graph in graphs.items():
            t = _replay_seconds(graph) / len(weights)
            times[config] = min(t, times.get(config, t))
    _TUNED[key] = min(times, key=times.get)
    log.debug("tuned M<=%d N=%d K=%d %s: %s", m_bucket(m), n, k, x.dtype, "; ".join(
        f"{c.path} bn={c.block_n} bm={c.block_m} split={c.split_k} w={c.num_warps} st={c.num_stages}"
        f"{' tma' if c.x_descriptor else ''}{' pdl' if c.dependent else ''}{' stream-k' if c.stream_k else ''} "
        f"{t * 1e6:.1f} us" for c, t in sorted(times.items(), key=lambda item: item[1])))
    return _TUNED[key]


def launch(config: KernelConfig, x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor,
           perm: Optional[torch.Tensor], bias: Optional[torch.Tensor], locks: torch.Tensor, bits: int, group_size: int,
           out: torch.Tensor) -> None:
    """Write x @ W^T (+ bias) into `out` [M, N] with `config`. x is [M, K] with unit stride along K; `locks` are
    zeroed int32 split-K counters (`new_locks`), left zeroed."""
    m, k = x.shape
    n = qweight.shape[1]
    group = NO_GROUP if group_size == -1 else group_size
    group_per_chunk = group_size == -1 or group % chunk_rows(bits) == 0  # at 3 bits (160-row chunks) only for -1
    flags = dict(GROUP_SIZE=group, BITS=bits, GROUP_PER_CHUNK=group_per_chunk, WORDS=WORDS_PER_CHUNK)
    if config.path == "dequant":
        weight = torch.empty(n, k, dtype=x.dtype, device=x.device)
        programs.dequant_kernel[(triton.cdiv(n, 64), triton.cdiv(k, chunk_rows(bits)))](
            qweight, scale_zero, weight, n, k, BLOCK_N=64, FIELDS=triton.next_power_of_2(32 // bits),
            **flags)
        if perm is not None:
            x = x.index_select(1, perm)
        torch.mm(x, weight.t(), out=out)
        if bias is not None:
            out += bias
        return
    if config.path == "wgmma" and not _wgmma_supports(x, bits, group_size):
        raise ValueError(f"the wgmma path takes sm_90, {' or '.join(map(str, WGMMA_BITS))}-bit codes, groups of "
                         f"whole chunks and K a multiple of 8; got {bits} bits, group {group_size}, K={k} on "
                         f"{x.device}")
    if perm is not None and (m > PERMUTE_X_ABOVE_M or config.x_descriptor or config.path == "wgmma"):
        x, perm = x.index_select(1, perm), None
    # The mma kernel's loop assumes a non-empty run of chunks (see its docstring): at most one split a chunk (nor
    # are more worth running on the wgmma path, which splits in its own launch).
    runs = min(config.split_k, -(-k // chunk_rows(bits)))
    split = {"gemv": config.split_k, "mma": runs}.get(config.path, 1)
    final = split == 1
    partials = out if final else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    args = (x, qweight, scale_zero, perm, bias, out, partials, locks)
    flags.update(HAS_PERM=perm is not None, HAS_BIAS=bias is not None, FINAL=final, BLOCK_N=config.block_n,
                 num_warps=config.num_warps, num_stages=config.num_stages)
    if config.path == "gemv":
        grid = (triton.cdiv(n, config.block_n), split, triton.cdiv(m, config.block_m))
    else:
        grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split)
    if not final and grid[0] * (grid[2] if config.path == "gemv" else 1) > locks.numel():
        raise ValueError(f"{config} for M={m} N={n} splits more output tiles than the {locks.numel()} split-K "
                         f"counters given (see lock_count)")
    even = m % config.block_m == 0 and n % config.block_n == 0 and k % chunk_rows(bits) == 0
    if config.path == "gemv":
        programs.gemv_kernel[grid](*args, m, n, k, x.stride(0), n, m * n, X_EXPONENT=programs.X_EXPONENT,
                                   NUM_STAGES=config.num_stages, BLOCK_M=config.block_m, EVEN=even,
                                   DEPENDENT=config.dependent, launch_pdl=config.dependent, **flags)
    elif config.path == "wgmma":
        from litquant.kernels import triton_wgmma  # Gluon: imported where it runs
        if not _tma_aligned(x):
            x = x.clone(memory_format=torch.contiguous_format)
        triton_wgmma.launch(x, qweight, scale_zero, bias, out, locks, runs, config.stream_k, bits, group_size,
                            config.block_m, config.block_n, config.num_warps, config.num_stages)
    else:
        fields = config.fields_per_dot or default_fields_per_dot(bits, x.device)
        if fields & (fields - 1) or not 1 <= fields <= 32 // bits:
            raise ValueError(f"fields_per_dot must be a power of two from 1 to {32 // bits} at {bits} bits, "
                             f"got {fields}")
        # The interpreter computes bf16 tl.dot wrongly (triton 3.9), and cannot run inline PTX: it gets the same
        # values widened to fp32.
        dot_dtype = tl.float32 if INTERPRET else _TL_DTYPES[x.dtype]
        pairs = dot_dtype == tl.float16 or (dot_dtype == tl.bfloat16 and bits < 8)  # codes must fit the mantissa
        descriptor = config.x_descriptor and _x_descriptor(x, chunk_rows(bits), config.block_m, fields, bits)
        if descriptor:
            args = (descriptor,) + args[1:]
        hopper = x.device.type == "cuda" and not _before_hopper(x.device)  # (the interpreter runs no wgmma)
        programs.mma_kernel[grid](*args, m, n, k, x.stride(0), n, m * n, DOT_DTYPE=dot_dtype,
                                  X_DESCRIPTOR=bool(descriptor), WAIT_FOR_WGMMAS=hopper and fields > 1,
                                  DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32", PAIRS=pairs,
                                  BLOCK_M=config.block_m, GROUP_M=8, EVEN=even, FIELDS_PER_DOT=fields, **flags)


def quant_matmul(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, config: Optional[KernelConfig] = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] in x's dtype, written into `out` if given, with `config` or the tuned one."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    n = weight.qweight.shape[1]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out must be a contiguous {x.dtype} tensor of shape [{m}, {n}], got {out.dtype} "
                         f"{list(out.shape)}")
    if m == 0:
        return out
    tensors = (x, weight.qweight, weight.scale_zero, weight.perm, bias, weight.locks)
    # Triton launches on the current CUDA device, not on its arguments' (and so does the tuner's graph capture)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        if config is None:
            config = choose_config(*tensors, weight.bits, weight.group_size, out)
        launch(config, *tensors, weight.bits, weight.group_size, out)
    return out


@quant_linear_op("litquant::triton_quant_linear")
def triton_quant_linear(x: torch.Tensor, qweight: torch.Tensor, scale_zero: torch.Tensor, perm: Optional[torch.Tensor],
                        bias: Optional[torch.Tensor], locks: torch.Tensor, bits: int, group_size: int,
                        out_features: int) -> torch.Tensor:
    """The custom op behind `TritonQuantLinear.forward`: x [..., K] -> [..., out_features]. `locks` are counted
    on and reset within the call (as marlin's), so the op declares no mutation."""
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    weight = PackedWeight(qweight, scale_zero, perm, locks, bits, group_size)
    quant_matmul(x.reshape(-1, x.shape[-1]), weight, bias, out.view(-1, out_features))
    return out


class TritonQuantLinear(QuantLinear):
    name = "triton"
    bits = SUPPORTED_BITS
    group_sizes = (32, 64, 128, 256, -1)
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    devices = ("cuda", "cpu") if INTERPRET else ("cuda",)
    auto_devices = ("cuda",)  # the interpreter is for tests, never a choice for `auto`
    min_capability = (8, 0)
    description = "fused dequant-matmul in Triton: gemv / split-K / tensor cores / dequant+cuBLAS, autotuned per M"
    # qweight [C, N, 16], scale_zero [G, N]; the locks are zeroed counters, enough for the sum of the columns
    concat_dims = {"qweight": 1, "scale_zero": 1, "perm": None, "locks": 0}

    @classmethod
    def unavailable(cls) -> Optional[str]:
        if INTERPRET or torch.cuda.is_available():
            return None
        return "needs a CUDA GPU (or TRITON_INTERPRET=1 set before import, to run it slowly on the CPU)"

    def load_quantized(self, qw: QuantizedWeight) -> None:
        if (qw.bits, qw.group_size, qw.in_features, qw.out_features) != (
                self.spec.bits, self.spec.group_size, self.in_features, self.out_features):
            raise ValueError(f"weight is {qw.bits}-bit g{qw.group_size} {qw.in_features}x{qw.out_features}, the "
                             f"layer expects {self.spec.bits}-bit g{self.spec.group_size} "
                             f"{self.in_features}x{self.out_features}")
        packed = repack(qw)
        for name in ("qweight", "scale_zero", "perm"):
            self.register_buffer(name, getattr(packed, name))
        self.register_buffer("locks", packed.locks, persistent=False)
        self.set_bias(qw.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return triton_quant_linear(x, self.qweight, self.scale_zero, self.perm, self.bias, self.locks,
                                   self.spec.bits, self.spec.group_size, self.out_features)
