"""Per-layer speed of every quantized-linear kernel against its peers, on one GPU.

    python benchmarks/kernels.py --out-dir benchmarks/results/run       # everything (about ten minutes on an H200)
    python benchmarks/kernels.py --out-dir /tmp/q --shapes 70B-up --m 1,16,1024 --dtypes bf16 --kernels triton,cublas

Kernels: every kernel of `litquant.kernels.REGISTRY` that supports the layer here (the `torch` reference is skipped
above --torch-max-weights elements), and the peers `cublas` (F.linear with the dense weight in the activation
dtype), `tinygemm` (torch's int4 `_weight_int4pack_mm`, g128, bf16 only) and `bnb-nf4` (bitsandbytes, if
importable). Shapes are the Llama-2 7B and 70B linear layers (K x N, with gate and up fused as in the H200
baseline anchors); weights are random 4-bit codes with random scales and zero points (never all zeros), or with
`--sym` symmetric ones (every zero point 2**(bits-1), as GPTQ writes by default: the kernels then read no zero
points).

Timing: each kernel gets enough copies of its weights that one pass over them exceeds 4x the L2 cache, a CUDA
graph replays the calls over all copies (so launch overhead and the CPU stay out, as in `--compile` decode), and the
median over replays, divided by the calls per replay, is the time per call. A kernel whose call cannot be
captured is timed eagerly (CUDA events around a loop) and marked so. The device-to-device copy bandwidth is
measured in the same run; each row reports the effective weight bandwidth (bytes of the layer's weights in that
kernel's format over the time), its fraction of the copy bandwidth, and the speedup over `cublas`.
Writes kernels.json and kernels.md to --out-dir.

Power: from M = 256 on, the kernels (cuBLAS and the quantized ones alike) run an H200 at its 700 W cap, and its SM
clock then drops from 1.98 GHz to 1.3-1.7 GHz within a second; a cell timed right after a heavy one inherits the
lowered clock (marlin on 70B-up at M = 256: 342 us from idle, 384 after a second of itself, 521 right after a
second of cuBLAS at M = 1024; benchmarks/results/2026-12-01-power-state.log). `--settle S` replays each cell for S
seconds before timing it, so that every kernel is timed at its own steady clock, as in a long prefill:

    python benchmarks/kernels.py --out-dir /tmp/q --m 256,1024,4096 --kernels marlin,triton,cublas --settle 0.5
"""
import argparse
import datetime
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from litquant.formats import QuantizedWeight  # noqa: E402
from litquant.formats.common import default_g_idx  # noqa: E402
from litquant.kernels import REGISTRY, kernel_class  # noqa: E402
from litquant.kernels.base import LayerSpec  # noqa: E402

SHAPES: Dict[str, Tuple[int, int]] = {  # name -> (K in_features, N out_features)
    "7B-qkv": (4096, 12288),
    "7B-up": (4096, 22016),
    "7B-down": (11008, 4096),
    "70B-qkv": (8192, 10240),
    "70B-up": (8192, 57344),
    "70B-down": (28672, 8192),
}
M_VALUES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PEERS = ("cublas", "tinygemm", "bnb-nf4")
L2_MULTIPLE = 4  # one pass over the weight copies reads at least this many times the L2 size
MIN_REPLAY_S = 2e-3  # make each graph replay at least this long
# Spin cycles (~100 us) that keep the GPU busy while the CPU launches the graphs timed after them: from an idle GPU,
# the start event completes at once and the time until the graph's first kernel arrives counts as the graph's.
# In `alternate`, the variant timed first in a turn came out 1.1-4.5% slower than identical ones timed after it,
# 0.5-1.7% behind the spin kernel, and within 0.6% once each turn also starts with the next variant
# (benchmarks/results/2026-12-03-harness-launch-gap.md).
BUSY_CYCLES = 200_000


def keep_gpu_busy() -> None:
    torch.cuda._sleep(BUSY_CYCLES)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of 10)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * nbytes / statistics.median(times[2:])


def random_quantized_weight(k: int, n: int, bits: int, group_size: int, device: torch.device,
                            seed: int, sym: bool = False) -> QuantizedWeight:
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = 1 if group_size == -1 else -(-k // group_size)
    codes = torch.randint(0, 2**bits, (k, n), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(groups, n, generator=gen, device=device) * 2e-3 + 1e-3).to(torch.float16)
    zeros = torch.randint(0, 2**bits, (groups, n), generator=gen, device=device, dtype=torch.uint8)
    if sym:
        zeros.fill_(2 ** (bits - 1))
    return QuantizedWeight(codes, scales, zeros, default_g_idx(k, group_size, device), bits, group_size)


def build_litquant(name: str, k: int, n: int, bits: int, group_size: int, dtype: torch.dtype,
                   device: torch.device, seed: int, sym: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    qw = random_quantized_weight(k, n, bits, group_size, device, seed, sym)
    spec = LayerSpec(k, n, bits, group_size, qw.sym, qw.act_order)
    module = kernel_class(name)(k, n, False, spec, dtype)
    module.load_quantized(qw)
    return module


def build_peer(name: str, k: int, n: int, dtype: torch.dtype, device: torch.device,
               seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    if name == "cublas":
        weight = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
        return lambda x: F.linear(x, weight)
    if name == "tinygemm":
        # torch >= 2.5 on CUDA: codes [N, K/2] uint8 (two 4-bit codes a byte, even k in the high nibble), packed
        # with innerKTiles 8; scales and zeros [K/128, N, 2] bf16; w = (q - 8) * scale + zero.
        codes = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack((codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8), 8)
        scales_and_zeros = torch.stack([torch.rand(k // 128, n, generator=gen, device=device) * 2e-3 + 1e-3,
                                        torch.randn(k // 128, n, generator=gen, device=device) * 1e-3], dim=2)
        scales_and_zeros = scales_and_zeros.to(torch.bfloat16).contiguous()
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, 128, scales_and_zeros)
    if name == "bnb-nf4":
        import bitsandbytes as bnb

        weight = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
        packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4", blocksize=64)
        del weight
        return lambda x: bnb.matmul_4bit(x, packed.t(), quant_state=state)
    raise ValueError(f"unknown peer {name!r}")


def peer_problem(name: str, dtype: torch.dtype) -> Optional[str]:
    if name == "tinygemm" and dtype != torch.bfloat16:
        return "bf16 only"
    if name == "bnb-nf4":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as e:
            return f"bitsandbytes not importable: {e}"
    return None


def weight_bytes(name: str, k: int, n: int, bits: int, group_size: int, dtype: torch.dtype,
                 sym: bool = False) -> int:
    """Bytes a kernel must read for the layer's weights: the dense matrix, or the codes plus one 4-byte
    scale/zero pair per group and column (the floor of the H200 anchors); on symmetric weights, for litquant's
    kernels, a 2-byte scale (they read no zero points; the torch reference reads them packed, 4 bits)."""
    if name == "cublas":
        return k * n * torch.finfo(dtype).bits // 8
    group = 64 if name == "bnb-nf4" else 128 if name == "tinygemm" else (k if group_size == -1 else group_size)
    per_group = 2 if sym and name in REGISTRY else 4
    return k * n * bits // 8 + -(-k // group) * n * per_group


def pass_seconds(fns: List[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor) -> float:
    """Seconds of one eager pass over `fns`, after an untimed one (compile, autotune, allocate)."""
    for fn in fns:
        fn(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in fns:
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3


def time_calls(fns: List[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor,
               replays: int = 10, settle_s: float = 0.0) -> Tuple[float, str]:
    """Median seconds per call, rotating over `fns`, replayed from a CUDA graph (or eagerly if capture fails),
    after `settle_s` seconds of untimed replays."""
    estimate = pass_seconds(fns, x) / len(fns)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rounds = max(1, min(200, math.ceil(MIN_REPLAY_S / max(estimate, 1e-7) / len(fns))))
    calls = rounds * len(fns)

    def run() -> None:
        for _ in range(rounds):
            for fn in fns:
                fn(x)

    method = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # warm up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            run()
        replay = graph.replay
    except Exception as e:  # a kernel that cannot be captured
        log(f"    CUDA graph capture failed ({type(e).__name__}: {str(e)[:120]}), timing eagerly")
        torch.cuda.synchronize()
        method, replay = "eager", run
    replay()
    torch.cuda.synchronize()
    settle_until = time.perf_counter() + settle_s
    while time.perf_counter() < settle_until:
        replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        keep_gpu_busy()
        start.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / calls)
    return statistics.median(times), method


def alternate(variants: Dict[str, List[Callable[[torch.Tensor], torch.Tensor]]], x: torch.Tensor,
              settle_s: float = 0.5, turns: int = 40) -> Dict[str, float]:
    """Median us a call of each variant (a list of calls), all their graphs replayed in turn for `settle_s`, then
    `turns` more turns each replay timed by events: every variant runs at the same (power-capped) clock, which is
    fair between them, not against a kernel timed alone."""
    graphs, calls = {}, {}
    for name, fns in variants.items():
        repeats = max(1, math.ceil(1e-3 / pass_seconds(fns, x)))
        calls[name] = repeats * len(fns)
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            for _ in range(repeats):
                for fn in fns:
                    fn(x)
    until = time.perf_counter() + settle_s
    while time.perf_counter() < until:
        for graph in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
    times = {name: [] for name in graphs}
    names = list(graphs)
    for turn in range(turns):
        events = {}
        keep_gpu_busy()
        # Each turn starts with the next variant, so that no variant is always the one timed first.
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            events[name] = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[name][0].record()
            graphs[name].replay()
            events[name][1].record()
        torch.cuda.synchronize()
        for name, (start, end) in events.items():
            times[name].append(start.elapsed_time(end) * 1e3 / calls[name])
    return {name: statistics.median(t) for name, t in times.items()}


def save(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kernels.json").write_text(json.dumps(result, indent=1))
    (out_dir / "kernels.md").write_text(markdown(result))


def benchmark(args: argparse.Namespace) -> dict:
    """Time every kernel at every shape, M and dtype; the result so far is saved after each shape."""
    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    l2_bytes = getattr(props, "L2_cache_size", 60 << 20)
    copy_bps = copy_bandwidth(device)
    log(f"{props.name}: copy bandwidth {copy_bps / 1e12:.2f} TB/s, L2 {l2_bytes >> 20} MiB")
    kernels = args.kernels or [*REGISTRY, *PEERS]
    rows, skipped, tuned = [], {}, {}
    result = dict(meta=dict(device=props.name, torch=torch.__version__, triton=_version("triton"),
                            date=datetime.datetime.now().isoformat(timespec="seconds"), copy_TBps=copy_bps / 1e12,
                            l2_MiB=l2_bytes >> 20, bits=args.bits, group_size=args.group_size, sym=args.sym,
                            settle_s=args.settle, cuda_arch=os.environ.get("LITQUANT_CUDA_ARCH") or None,
                            command=" ".join(sys.argv)),
                  rows=rows, skipped=skipped, triton_configs=tuned)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for shape in args.shapes:
            k, n = SHAPES[shape]
            spec = LayerSpec(k, n, args.bits, args.group_size, args.sym, False)
            shape_rows = []
            for name in kernels:
                if name in PEERS:
                    problem = peer_problem(name, dtype) or (None if args.bits == 4 or name == "cublas"
                                                            else "4-bit only")
                elif name in REGISTRY:
                    problem = kernel_class(name).unsupported(spec, device, dtype)
                    if name == "torch" and k * n > args.torch_max_weights:
                        problem = f"skipped above {args.torch_max_weights:.0e} weights (--torch-max-weights)"
                else:
                    problem = f"unknown kernel; known: {', '.join([*REGISTRY, *PEERS])}"
                if problem:
                    skipped[f"{name} {shape} {dtype_name}"] = problem
                    log(f"skip {name} {shape} {dtype_name}: {problem}")
                    continue
                nbytes = weight_bytes(name, k, n, args.bits, args.group_size, dtype, args.sym)
                copies = max(2, math.ceil(L2_MULTIPLE * l2_bytes / nbytes))
                fns = []
                try:
                    fns = [build_peer(name, k, n, dtype, device, seed) if name in PEERS else
                           build_litquant(name, k, n, args.bits, args.group_size, dtype, device, seed, args.sym)
                           for seed in range(copies)]
                    for m in args.m:
                        x = torch.randn(m, k, device=device).to(dtype)
                        seconds, method = time_calls(fns, x, settle_s=args.settle)
                        shape_rows.append(dict(kernel=name, shape=shape, K=k, N=n, M=m, dtype=dtype_name,
                                               us=seconds * 1e6, weight_bytes=nbytes, copies=copies, timing=method,
                                               eff_TBps=nbytes / seconds / 1e12,
                                               frac_copy_bw=nbytes / seconds / copy_bps))
                        log(f"{name:>10} {shape:>8} {dtype_name} M={m:<5} {seconds * 1e6:9.1f} us  "
                            f"{nbytes / seconds / 1e12:5.2f} TB/s ({method})")
                except Exception as e:  # one broken kernel must not cost the whole run
                    skipped[f"{name} {shape} {dtype_name}"] = f"{type(e).__name__}: {e}"
                    log(f"FAILED {name} {shape} {dtype_name}: {type(e).__name__}: {e}")
                del fns
                torch.cuda.empty_cache()
            dense = {r["M"]: r["us"] for r in shape_rows if r["kernel"] == "cublas"}
            for r in shape_rows:
                r["speedup_vs_dense"] = dense[r["M"]] / r["us"] if r["M"] in dense else None
            rows += shape_rows
            if "triton" in kernels:
                from litquant.kernels import triton_kernel

                tuned.update({f"{key[1]} M<={key[2]} N={key[3]} K={key[4]}": vars(config)
                              for key, config in triton_kernel.tuned_configs().items()})
            save(result, args.out_dir)
    return result


def _version(package: str) -> Optional[str]:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def markdown(result: dict) -> str:
    meta = result["meta"]
    weights = "symmetric" if meta.get("sym") else "zero points"
    lines = [f"# Kernel benchmark: {meta['device']}, {meta['bits']}-bit g{meta['group_size']}, {weights}",
             "", f"torch {meta['torch']}, triton {meta['triton']}, {meta['date']}; "
             f"device-to-device copy {meta['copy_TBps']:.2f} TB/s.",
             "Each cell: microseconds per call / speedup over dense cuBLAS / fraction of copy bandwidth"
             + (f", timed after {meta['settle_s']:g} s of the same calls." if meta.get("settle_s") else "."), ""]
    if meta.get("cuda_arch"):
        lines += [f"The CUDA kernels are built for compute capability {meta['cuda_arch']} (LITQUANT_CUDA_ARCH), "
                  "as PTX that the driver compiled for this GPU: that GPU's code and paths, on this GPU.", ""]
    rows = result["rows"]
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for shape in dict.fromkeys(r["shape"] for r in rows if r["dtype"] == dtype):
            table = [r for r in rows if r["dtype"] == dtype and r["shape"] == shape]
            kernels = list(dict.fromkeys(r["kernel"] for r in table))
            k, n = table[0]["K"], table[0]["N"]
            lines += [f"## {shape} ({k}x{n}), {dtype}", "", "| M | " + " | ".join(kernels) + " |",
                      "|---:|" + "---:|" * len(kernels)]
            for m in sorted({r["M"] for r in table}):
                cells = []
                for name in kernels:
                    r = next((r for r in table if r["kernel"] == name and r["M"] == m), None)
                    speedup = "-" if r is None or r["speedup_vs_dense"] is None else f"{r['speedup_vs_dense']:.2f}x"
                    cells.append("-" if r is None else f"{r['us']:.1f} / {speedup} / {r['frac_copy_bw']:.0%}")
                lines.append(f"| {m} | " + " | ".join(cells) + " |")
            lines.append("")
    if result["skipped"]:
        lines += ["## Skipped", ""] + [f"- {what}: {why}" for what, why in result["skipped"].items()] + [""]
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    csv = lambda s: [v for v in s.split(",") if v]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--kernels", type=csv, default=None,
                        help=f"comma-separated; default: all registered kernels and {', '.join(PEERS)}")
    parser.add_argument("--shapes", type=csv, default=list(SHAPES), help=f"comma-separated from {', '.join(SHAPES)}")
    parser.add_argument("--m", type=lambda s: [int(v) for v in csv(s)], default=list(M_VALUES))
    parser.add_argument("--dtypes", type=csv, default=list(DTYPES), help="comma-separated from bf16, fp16")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--sym", action="store_true",
                        help="symmetric weights (GPTQ's default: no zero points) instead of random zero points")
    parser.add_argument("--settle", type=float, default=0.0,
                        help="seconds of untimed replays before each cell is timed, to let the GPU's clock settle "
                             "at that kernel's own power draw (0.5 suits M >= 256 on an H200)")
    parser.add_argument("--torch-max-weights", type=float, default=1.2e8,
                        help="skip the slow torch reference kernel above this many weights")
    args = parser.parse_args(argv)
    for value, known, what in ((args.shapes, SHAPES, "shape"), (args.dtypes, DTYPES, "dtype")):
        unknown = [v for v in value if v not in known]
        if unknown:
            parser.error(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(known)}")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    logging.basicConfig(format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("litquant.kernels.triton").setLevel(logging.DEBUG)  # the tuner's timings go into the log
    print(markdown(benchmark(args)))


if __name__ == "__main__":
    main()
