"""`litquant serve`: litgpt's LitServe server, for litquant's quantized checkpoints as well as ordinary ones.

litgpt's server classes (`litgpt.deploy.serve`) load their model with `LLM.load(...).distribute(...)`, which reads
only full-precision checkpoints and quantizes only with bitsandbytes. The classes here are litgpt's own (request
decoding, sampling, streaming and the OpenAI spec stay litgpt's code) with one method swapped: `setup` loads the
model with litquant's loader, so a quantized checkpoint runs on its kernel, and `--quantize` also takes RTN on load.
Streamed text comes in whole characters (`WholeCharacterLLM`), and the OpenAI endpoint reads a request's sampling
settings as OpenAI's clients mean them (`OpenAIAPI.predict`).
The server runs one model on one device, and generates with litgpt's `LLM.generate`: eagerly, or with `--compile`
through the compiled decode step of `litquant chat --compile` (`serving_llm`).
"""
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from litgpt.api import LLM, Preprocessor
from litgpt.constants import _LITSERVE_AVAILABLE
from litgpt.deploy.serve import BaseLitAPI, OpenAISpecLitAPI, SimpleLitAPI, StreamLitAPI

from litquant.generate import check_sampling, checkpoint_prompt_style, set_next_token, set_shared_kv_cache
from litquant.load import LoadedModel, load_model, plan_load

if _LITSERVE_AVAILABLE:
    from fastapi import HTTPException  # LitServe's dependencies
    from pydantic import BaseModel
else:  # as litgpt.deploy.serve does: the module imports, and `serve` says what is missing
    BaseModel = object


def serving_llm(loaded: LoadedModel, checkpoint_dir: Path, compile: bool = False) -> LLM:
    """litgpt's `LLM` over a model that `load_model` loaded, with the checkpoint's prompt style and litquant's decode
    step (`litquant.generate.set_next_token`).

    With `compile`, its decode step is litgpt's `next_token` under torch.compile with CUDA graphs, on chat's cache
    (`litquant.generate.set_shared_kv_cache`): one cache for every request, where litgpt's `LLM` would resize it for
    longer requests (each new cache is new memory for the graphs). A kernel that cannot compile runs eagerly, with a
    warning.
    """
    cache = {}
    if compile:
        set_shared_kv_cache(loaded.model, loaded.config, loaded.fabric.device, compile=True)
        cache = dict(kv_cache_initialized=True, fixed_kv_cache_size=loaded.model.max_seq_length)
    else:
        set_next_token(loaded.model, compile=False)
    return WholeCharacterLLM(loaded.model, Preprocessor(loaded.tokenizer, device=loaded.fabric.device),
                             checkpoint_prompt_style(checkpoint_dir, loaded.config), config=loaded.config,
                             checkpoint_dir=checkpoint_dir, fabric=loaded.fabric, **cache)


class WholeCharacterLLM(LLM):
    """litgpt's `LLM`, streaming its text in whole characters (`litquant.tokenizer`), where litgpt's decodes each
    token alone (a character split over tokens then streams as U+FFFD, for the streamed and the OpenAI APIs)."""

    def generate(self, *args, stream: bool = False, return_as_token_ids: bool = False, **kwargs):
        if not stream or return_as_token_ids:
            return super().generate(*args, stream=stream, return_as_token_ids=return_as_token_ids, **kwargs)
        tokens = super().generate(*args, stream=True, return_as_token_ids=True, **kwargs)
        return (piece for piece in self.preprocessor.tokenizer.decode_stream(tokens) if piece)


class LitquantLoading(BaseLitAPI):
    """litgpt's `BaseLitAPI`, its model loaded by `litquant.load.load_model` on the device LitServe gives it.

    It sits between each litgpt API class and `BaseLitAPI` in the method order (see the classes below), so each
    class's own `setup` reaches this one through `super()` (the OpenAI class then reads the chat template)."""

    kernel: Optional[str] = None  # for quantized checkpoints and RTN on load; None: the checkpoint's
    compile: bool = False

    def setup(self, device: str) -> None:
        loaded = load_model(self.checkpoint_dir, kernel=self.kernel, quantize=self.quantize, precision=self.precision,
                            device=device)
        print(f"loaded {self.checkpoint_dir} ({loaded.quantization}, kernel {loaded.kernel or '-'}) on {device} in "
              f"{loaded.load_seconds:.2f} s", file=sys.stderr)
        self.llm = serving_llm(loaded, self.checkpoint_dir, compile=self.compile)
        if self.compile:  # compile now, not in the first client's request, with the sampling settings every request
            # uses (prompts run eagerly, so one request compiles the step for all)
            t0 = time.perf_counter()
            self.llm.generate("Hi", max_new_tokens=4, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
            print(f"compiled the decode step in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


class PromptRequest(BaseModel):
    """The body of a request to `api_path`. LitServe validates it against `decode_request`'s annotation before a
    worker sees it, so a request without a prompt is answered with HTTP 422 and the missing field, streamed or not
    (litgpt's own `decode_request` reads `request["prompt"]` in the worker: a KeyError and HTTP 500)."""

    prompt: str


class PromptDecoding:
    """Takes the prompt from a request that LitServe has validated as a `PromptRequest`."""

    def decode_request(self, request: PromptRequest) -> str:
        return request.prompt


class SimpleAPI(PromptDecoding, SimpleLitAPI, LitquantLoading):
    """POST {"prompt": ...} -> {"output": ...}."""


class StreamAPI(PromptDecoding, StreamLitAPI, LitquantLoading):
    """POST {"prompt": ...} -> a stream of {"output": ...}, a piece of text each."""


class OpenAIAPI(OpenAISpecLitAPI, LitquantLoading):
    """OpenAI-compatible `/v1/chat/completions`."""

    def predict(self, inputs: str, context: dict) -> Iterator[str]:
        """litgpt's, except that a request's `temperature: 0` is greedy (litgpt's takes 0 for unset and samples at the
        server's temperature), `max_tokens` (the older name of `max_completion_tokens`) counts too, and sampling
        settings that cannot sample are the client's error (HTTP 400), not the server's."""
        temperature, top_p = context.get("temperature"), context.get("top_p")
        temperature = self.temperature if temperature is None else temperature
        top_p = self.top_p if top_p is None else top_p
        max_new_tokens = context.get("max_completion_tokens") or context.get("max_tokens") or self.max_new_tokens
        try:
            check_sampling(max_new_tokens, temperature, self.top_k, top_p)
        except ValueError as e:
            raise HTTPException(status_code=400, detail=str(e)) from None
        yield from self.llm.generate(inputs, temperature=temperature, top_k=self.top_k, top_p=top_p,
                                     max_new_tokens=max_new_tokens, stream=True)


def serve(
    checkpoint_dir: Path,
    *,
    kernel: Optional[str] = None,
    quantize: Optional[str] = None,
    precision: Optional[str] = None,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    max_new_tokens: int = 50,
    accelerator: str = "auto",
    port: int = 8000,
    stream: bool = False,
    openai_spec: bool = False,
    api_path: str = "/predict",
    timeout: int = 30,
    compile: bool = False,
) -> None:
    """Serve a quantized (or ordinary) checkpoint over HTTP with LitServe, as `litgpt serve` does.

    Args:
        checkpoint_dir: a quantized checkpoint from `litquant quantize`, or an ordinary litgpt checkpoint.
        kernel: kernel for quantized Linears: auto, or one that `litquant kernels` lists (torch, triton, marlin, ...).
            Default: the checkpoint's.
        quantize: for an ordinary checkpoint, quantize while loading: bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq
            (bitsandbytes) or rtn.int<bits>[-g<group_size>], e.g. rtn.int4-g128 (litquant's kernels).
        precision: bf16-true, 16-true or 32-true. Default: bf16-true on a GPU that has bf16 (else 16-true), 32-true
            on the CPU.
        temperature: sampling temperature.
        top_k: sample among the k most probable tokens (1: greedy).
        top_p: nucleus sampling threshold.
        max_new_tokens: the most tokens per answer.
        accelerator: auto, cuda or cpu.
        port: the port to listen on.
        stream: stream each answer as it is generated.
        openai_spec: serve OpenAI-compatible `/v1/chat/completions` instead of `api_path`.
        api_path: the endpoint's path.
        timeout: seconds a request may wait.
        compile: compile the decode step with torch.compile (with CUDA graphs on a GPU), at startup. Every request
            then shares one KV cache of up to 4096 positions (its prompt and answer must fit) and attention reads only
            its filled part.
    """
    if not _LITSERVE_AVAILABLE:
        raise ImportError("litquant serve needs LitServe: pip install litserve")
    from litserve import LitServer
    from litserve.specs.openai import OpenAISpec

    checkpoint_dir = Path(checkpoint_dir)
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    # a bad checkpoint, device or kernel fails here, in one line, not in a worker's traceback
    plan_load(checkpoint_dir, kernel=kernel, quantize=quantize, precision=precision,
              device=None if accelerator == "auto" else accelerator)
    api_class = OpenAIAPI if openai_spec else StreamAPI if stream else SimpleAPI
    api = api_class(checkpoint_dir, quantize=quantize, precision=precision, temperature=temperature, top_k=top_k,
                    top_p=top_p, max_new_tokens=max_new_tokens, devices=1, api_path=api_path)
    # litgpt's API classes take neither `spec` nor `stream`, and LitServer's arguments for them are deprecated
    api.kernel, api.compile, api.stream = kernel, compile, stream
    if openai_spec:
        api.spec, api.stream = OpenAISpec(), True
    server = LitServer(api, accelerator=accelerator, devices=1, timeout=timeout)
    server.run(port=port, generate_client_file=False)
