"""`litquant generate` and `litquant chat`: litgpt's generation and chat loop over any checkpoint
`litquant.load.load_model` can load, quantized checkpoints included."""
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional

import lightning as L
import litgpt.generate.base as litgpt_generate
import torch
from litgpt.config import Config
from litgpt.prompts import PromptStyle, has_prompt_style, load_prompt_style
from torch.nn.attention import SDPBackend, sdpa_kernel

from litquant.attention import use_flex_decoding
from litquant.kernels.base import QuantLinear, dependent_launches_allowed
from litquant.load import LoadedModel, load_model

# `decode` reads the new tokens back to the host this many at a time, so the host queues that many decode steps
# ahead of the GPU. litgpt's loop reads every token back (`.item()`), and the GPU idles while Python prepares the
# next step: on an H200, compiled, a Llama-2-7B-shaped marlin model decoded 348-390 tokens/s that way against
# 438-446 with this loop, the same greedy tokens (benchmarks/results/2026-12-01-generate-loop.md).
READBACK_EVERY = 16


def checkpoint_prompt_style(checkpoint_dir: Path, config) -> PromptStyle:
    """The checkpoint's own prompt style (prompt_style.yaml), else the one litgpt knows for the model."""
    return load_prompt_style(checkpoint_dir) if has_prompt_style(checkpoint_dir) else PromptStyle.from_config(config)


def compile_options() -> dict:
    """torch.compile's options for decoding: those of mode "reduce-overhead" (Inductor, CUDA graphs) and, where this
    torch has it, Inductor's kernels launched as programmatic dependents of the kernel ahead (sm_90 on; each may
    start while the one before it ends, and waits in the kernel for that one's outputs), as marlin's and triton's
    kernels already are. `LITQUANT_PDL=0` leaves it out. On an H200 (Llama-2-7B-shaped model, batch 1, litquant's
    decode loop; benchmarks/results/2026-12-03-inductor-pdl.md): marlin 2-6% more tokens/s (460 -> 488, and 456-467
    -> 476), as the Inductor kernel after each quantized matmul no longer waits for its launch; bf16 1%."""
    options = dict(torch._inductor.list_mode_options("reduce-overhead"))
    if hasattr(torch._inductor.config.triton, "enable_pdl") and dependent_launches_allowed():
        options["triton.enable_pdl"] = True
    return options


# litgpt's decode step. litgpt's generation loops (generate, chat, its `LLM` that `serve` runs) and `decode` look it
# up in litgpt's module on every step, so `set_next_token` swaps litquant's step in there.
LITGPT_NEXT_TOKEN = litgpt_generate.next_token

# The attention backends of the eager steps: all of torch's SDPA backends but cuDNN's. Eagerly, litgpt gives attention
# only the filled part of the KV cache (`input_pos_maxp1`): a new key length every token. cuDNN builds an execution
# plan for every new shape, once a process, so a process's first answer paid a plan a token. On an H200
# (Llama-2-7B-shaped marlin model, 200 tokens eagerly, a process's first pass and then its second):
# 10.6 and 17.2 tokens/s with cuDNN, then 43.8 and 39.6; without it 39.8, then 50.2
# (benchmarks/results/2026-12-04-eager-attention.md). The compiled step keeps cuDNN: it has one shape.
EAGER_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def eager_next_token(*args, **kwargs) -> torch.Tensor:
    """litgpt's `next_token` with its attention on any SDPA backend but cuDNN's (`EAGER_ATTENTION_BACKENDS`)."""
    with sdpa_kernel(EAGER_ATTENTION_BACKENDS):
        return LITGPT_NEXT_TOKEN(*args, **kwargs)


def set_next_token(model: torch.nn.Module, compile: bool, flex_decoding: bool = False) -> None:
    """Swap litgpt's `next_token` for litquant's decode step: `eager_next_token`, or with `compile` the one-token steps
    under torch.compile (prompts run eagerly), eager with a warning when the kernel cannot compile. `flex_decoding`:
    the compiled one-token attention step through FlexAttention over the filled part of the KV cache
    (`litquant.attention`), for a long cache that each turn fills from position 0 (chat's) or for grouped-query
    attention on a GPU (`flex_decoding_pays_in_generate`); otherwise litgpt's SDPA."""
    litgpt_generate.next_token = eager_next_token
    if not compile:
        return
    if not _kernel_compiles(model):
        print("warning: --compile: this kernel is not compatible with torch.compile/CUDA graphs; running eagerly",
              file=sys.stderr)
        return
    use_flex_decoding(model, flex_decoding)
    mark_quantized_layers_after_small_kernels(model)
    compiled = torch.compile(LITGPT_NEXT_TOKEN, options=compile_options())

    def step(model, input_pos, x, *args, input_pos_maxp1=None, **kwargs):
        # A prompt (more than one token) runs eagerly: it is one forward pass. Compiled, it was a graph of its own,
        # and the step was then compiled again with dynamic shapes: on the CPU (SmolLM2-135M, RTN, torch's kernel,
        # Inductor's caches empty) the first 8 tokens took 134 s, 80 s of it before the first, against 76 s now
        # (0.3 s to the first).
        if x.size(-1) > 1:
            return eager_next_token(model, input_pos, x, *args, input_pos_maxp1=input_pos_maxp1, **kwargs)
        # litgpt passes input_pos_maxp1, the filled length of the KV cache, so that attention reads only that
        # much: an int that grows every token, which under CUDA graphs records a new graph for every length.
        # Without it attention reads the whole static cache under its mask (same tokens), one graph for all.
        # (Lengths rounded up to 256 positions, one graph per bucket, were tried: on a 7B-shaped model, runs
        # past the first bucket stopped giving the same tokens; benchmarks/results/2026-12-01-generate-loop.md.)
        # Each decode step is a new CUDA-graph step (the KV cache is updated in place), and its output lives
        # in memory the next replay overwrites: the caller keeps every token, so copy each one out.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(model, input_pos, x, *args, **kwargs).clone()

    litgpt_generate.next_token = step


def mark_quantized_layers_after_small_kernels(model: torch.nn.Module) -> None:
    """Tell the model's quantized layers that under torch.compile the kernel ahead of each of their calls is one of
    Inductor's small fused kernels (a norm, RoPE, SiLU) or attention, not another quantized matmul
    (`QuantLinear.after_small_kernels`). marlin then launches every decode grid as a programmatic dependent, not only
    those that fill the GPU: on an H200, Llama-2-7B shapes, compiled, 542.4 -> 550.6 tokens/s (three balanced pairs
    of processes; benchmarks/results/2026-12-04-decode-dependent-all.md)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.after_small_kernels = True


def flex_decoding_pays_in_generate(config: Config, device: torch.device) -> bool:
    """Whether `generate`'s compiled step should go through FlexAttention: on a GPU, for grouped-query attention,
    where litgpt's SDPA path copies the cache's key/value heads out for every query head each token and FlexAttention
    reads them as they are. Measured on the H200 (marlin, cache = prompt + 200 new tokens, tokens/s; SDPA against
    Flex; benchmarks/results/2026-12-03-flex-generate.md): Llama-3.1-8B shapes (8 key/value heads) 400.3 / 410.6
    with a 16-token prompt, 302.6 / 405.6 with 1000; Llama-2-7B shapes (no grouping) 509.7 / 493.2 and 471.3 / 445.5,
    and 511.8 / 491.6 with the order of the two compiles balanced (2026-12-03-e2e-order.md), so there litgpt's SDPA
    stays. On the CPU (SmolLM2-135M, 3 key/value heads for 9) Flex decoded 4% slower and
    took 66 s more to compile."""
    return device.type == "cuda" and config.n_query_groups < config.n_head


def set_kv_cache(model, device: torch.device) -> None:
    """A batch-1 KV cache in the model's compute dtype (that of its embedding). litgpt converts a cache of another
    dtype on the first step by re-assigning the buffer, which under CUDA graphs leaves the module holding graph
    memory that the next replay overwrites."""
    model.set_kv_cache(batch_size=1, device=device, dtype=model.transformer.wte.weight.dtype)


# The KV cache of `chat` and of `serve --compile`: every turn or request fills it from position 0, and compiled
# attention reads only its filled part, so its size bounds a turn's prompt and answer, not the time a token takes.
SHARED_CACHE_POSITIONS = 4096


def set_shared_kv_cache(model, config: Config, device: torch.device, compile: bool) -> None:
    """One KV cache of min(block size, SHARED_CACHE_POSITIONS) positions for every turn or request, and litquant's
    decode step (`set_next_token`); with `compile`, its one-token attention through FlexAttention over the filled part
    of the cache (`litquant.attention`), which a turn fills only to its prompt and answer."""
    model.clear_kv_cache()  # (with a smaller cache in place, litgpt would keep it and warn)
    model.max_seq_length = min(config.block_size, SHARED_CACHE_POSITIONS)
    set_kv_cache(model, device)
    set_next_token(model, compile, flex_decoding=True)


def prepare_decoding(loaded: LoadedModel, checkpoint_dir: Path, prompt: str, max_new_tokens: int, compile: bool, *,
                     apply_prompt_style: bool = True, cache_positions: int = 0) -> torch.Tensor:
    """The prompt's token ids on the model's device, in the checkpoint's chat template unless not
    `apply_prompt_style`, with the model made ready to `decode` them: its KV cache sized for the prompt and
    `max_new_tokens` (or `cache_positions` if more) and its decode step set (`set_next_token`)."""
    if apply_prompt_style:
        prompt = checkpoint_prompt_style(Path(checkpoint_dir), loaded.config).apply(prompt)
    device = loaded.fabric.device
    encoded = loaded.tokenizer.encode(prompt, device=device)
    if encoded.size(0) + max_new_tokens > loaded.config.block_size:
        raise ValueError(f"the prompt's {encoded.size(0)} tokens and max_new_tokens {max_new_tokens} do not fit the "
                         f"model's context, {loaded.config.block_size} tokens")
    loaded.model.max_seq_length = max(encoded.size(0) + max_new_tokens, cache_positions)
    set_kv_cache(loaded.model, device)
    set_next_token(loaded.model, compile, flex_decoding=flex_decoding_pays_in_generate(loaded.config, device))
    return encoded


@torch.inference_mode()
def decode(model, prompt: torch.Tensor, max_new_tokens: int, *, eos_id: Optional[int] = None,
           readback_every: int = READBACK_EVERY, **sample_kwargs) -> Iterator[List[int]]:
    """Continue `prompt` (1-D token ids) by up to `max_new_tokens` tokens: litgpt's decoding (its `next_token`, or
    litquant's step if `set_next_token` swapped it in, with the same positions and KV cache), the same tokens as
    litgpt's `generate`, but read back to the host in runs: the first token alone (the time to the first
    token), then `readback_every` at a time. The host meanwhile queues the next steps, and those queued past an
    EOS are computed and dropped. Yields each run's tokens, up to and including the EOS."""
    prompt_size = prompt.size(0)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if model.max_seq_length < prompt_size + max_new_tokens - 1:
        raise ValueError(f"the KV cache holds {model.max_seq_length} positions, fewer than the {prompt_size} of the "
                         f"prompt and the {max_new_tokens - 1} fed back")
    input_pos = torch.arange(prompt_size, device=prompt.device)
    token, queued = prompt, []
    for i in range(max_new_tokens):
        # step i feeds position prompt_size + i - 1 (the whole prompt at i = 0) and attends to the cache before it
        token = litgpt_generate.next_token(model, input_pos, token.view(1, -1), input_pos_maxp1=prompt_size + i,
                                           **sample_kwargs)
        queued.append(token)
        input_pos = input_pos[-1:] + 1  # on the GPU: no copy from the host that would wait for the queue
        if i == 0 or len(queued) == readback_every or i == max_new_tokens - 1:
            tokens = torch.cat(queued).tolist()
            queued = []
            if eos_id in tokens:
                yield tokens[:tokens.index(eos_id) + 1]
                return
            yield tokens


def check_sampling(max_new_tokens: int, temperature: float, top_k: Optional[int], top_p: float) -> None:
    """Refuse sampling settings that cannot sample (callers check them before loading a model)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be 0 (greedy) or more, not {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or none, for every token), not {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], not {top_p}")


@torch.inference_mode()
def generate(
    checkpoint_dir: Path,
    prompt: str = "What food do llamas eat?",
    *,
    max_new_tokens: int = 50,
    temperature: float = 0.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    num_samples: int = 1,
    kernel: Optional[str] = None,
    quantize: Optional[str] = None,
    precision: Optional[str] = None,
    device: Optional[str] = None,
    compile: bool = False,
    apply_prompt_style: bool = True,
) -> str:
    """Generate text from a quantized (or ordinary) checkpoint.

    Args:
        checkpoint_dir: a quantized checkpoint from `litquant quantize`, or an ordinary litgpt checkpoint.
        prompt: the prompt.
        max_new_tokens: tokens to generate.
        temperature: sampling temperature; 0 is greedy.
        top_k: sample among the k most probable tokens.
        top_p: nucleus sampling threshold.
        num_samples: how many completions.
        kernel: kernel for quantized Linears: auto, or one that `litquant kernels` lists (torch, triton, marlin, ...).
            Default: the checkpoint's.
        quantize: for an ordinary checkpoint, quantize while loading: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq
            (bitsandbytes) or rtn.int<bits>[-g<group_size>], e.g. rtn.int4-g128 (litquant's kernels).
        precision: bf16-true, 16-true or 32-true. Default: bf16-true on a GPU that has bf16 (else 16-true), 32-true
            on the CPU.
        device: cuda, cuda:<index> or cpu. Default: cuda (the current GPU) if available.
        compile: compile the decode step with torch.compile (with CUDA graphs on a GPU).
        apply_prompt_style: wrap the prompt in the model's chat template.
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, not {num_samples}")
    loaded = load_model(checkpoint_dir, kernel=kernel, quantize=quantize, precision=precision, device=device)
    fabric, model, tokenizer = loaded.fabric, loaded.model, loaded.tokenizer
    print(f"loaded {checkpoint_dir} ({loaded.quantization}, kernel {loaded.kernel or '-'}) in {loaded.load_seconds:.2f} s",
          file=sys.stderr)
    encoded = prepare_decoding(loaded, checkpoint_dir, prompt, max_new_tokens, compile,
                               apply_prompt_style=apply_prompt_style)
    L.seed_everything(1234)
    text = ""
    for i in range(num_samples):
        t0 = time.perf_counter()
        runs = decode(model, encoded, max_new_tokens, eos_id=tokenizer.eos_id, temperature=temperature, top_k=top_k,
                      top_p=top_p)
        y = next(runs)  # the first token alone
        first_token_seconds = time.perf_counter() - t0
        for run in runs:
            y += run
        seconds = time.perf_counter() - t0
        for block in model.transformer.h:
            block.attn.kv_cache.reset_parameters()
        text = tokenizer.decode(torch.tensor(y))
        fabric.print(text)
        rest = f"; the other {len(y) - 1} at {(len(y) - 1) / (seconds - first_token_seconds):.2f} tokens/s" if len(y) > 1 else ""
        print(f"sample {i + 1}: {len(y)} tokens in {seconds:.2f} s, {len(y) / seconds:.2f} tokens/s (first token after "
              f"{first_token_seconds:.3f} s{rest})", file=sys.stderr)
    if fabric.device.type == "cuda":
        print(f"memory used: {torch.cuda.max_memory_allocated() / 1e9:.02f} GB", file=sys.stderr)
    return text


def _kernel_compiles(model: torch.nn.Module) -> bool:
    return all(type(m).compiles for m in model.modules() if isinstance(m, QuantLinear))


@torch.inference_mode()
def chat(
    checkpoint_dir: Path,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    kernel: Optional[str] = None,
    quantize: Optional[str] = None,
    precision: Optional[str] = None,
    device: Optional[str] = None,
    compile: bool = False,
    multiline: bool = False,
) -> None:
    """Chat with a quantized (or ordinary) checkpoint. An empty prompt, !quit or the end of the input quits.

    Args:
        checkpoint_dir: a quantized checkpoint from `litquant quantize`, or an ordinary litgpt checkpoint.
        max_new_tokens: the most tokens per answer.
        temperature: sampling temperature.
        top_k: sample among the k most probable tokens.
        top_p: nucleus sampling threshold.
        kernel: kernel for quantized Linears: auto, or one that `litquant kernels` lists (torch, triton, marlin, ...).
            Default: the checkpoint's.
        quantize: for an ordinary checkpoint, quantize while loading: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq
            (bitsandbytes) or rtn.int<bits>[-g<group_size>], e.g. rtn.int4-g128 (litquant's kernels).
        precision: bf16-true, 16-true or 32-true. Default: bf16-true on a GPU that has bf16 (else 16-true), 32-true
            on the CPU.
        device: cuda, cuda:<index> or cpu. Default: cuda (the current GPU) if available.
        compile: compile the decode step with torch.compile (with CUDA graphs on a GPU; the attention reads only the
            filled part of a KV cache of up to 4096 positions, or the model's block size where smaller, through
            FlexAttention).
        multiline: multi-line prompts (end with '!submit' on its own line).
    """
    from litgpt.chat.base import interact

    check_sampling(max_new_tokens, temperature, top_k, top_p)
    loaded = load_model(checkpoint_dir, kernel=kernel, quantize=quantize, precision=precision, device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    # litgpt's chat starts every turn at position 0 of the cache (it does not carry the conversation over)
    set_shared_kv_cache(model, loaded.config, loaded.fabric.device, compile=compile)
    style = checkpoint_prompt_style(Path(checkpoint_dir), loaded.config)
    print(f"Now chatting with {loaded.config.name} ({loaded.quantization}, kernel {loaded.kernel or '-'}).\n"
          "To exit, press 'Enter' on an empty prompt, type !quit, or press Ctrl-D.\n")
    L.seed_everything(1234)
    try:
        interact(multiline=multiline, model=model, tokenizer=tokenizer, prompt_style=style, fabric=loaded.fabric,
                 temperature=temperature, max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p,
                 stop_tokens=style.stop_tokens(tokenizer))
    except EOFError:  # the end of piped input, or Ctrl-D: litgpt's loop reads with input(), which raises this
        print()
