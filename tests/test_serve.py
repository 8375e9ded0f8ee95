"""`litquant serve` on a tiny quantized checkpoint: the HTTP answers are `litquant generate`'s greedy text."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import litserve
import pytest
from fastapi.testclient import TestClient  # LitServe's dependency
from litserve.utils import wrap_litserve_start

from litquant.generate import generate
from litquant.quantize.main import quantize
from litquant.serve import serve

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> Path:
    from conftest import make_tiny_checkpoint

    tmp = tmp_path_factory.mktemp("serve")
    return quantize(make_tiny_checkpoint(tmp / "tiny"), tmp / "q", method="rtn", bits=4, group_size=32,
                    kernel="torch", device="cpu")


def started(monkeypatch, checkpoint_dir: Path, **options):
    """The server `serve` builds, started in this process as LitServe's own tests do (no port is opened)."""
    servers = []
    monkeypatch.setattr(litserve.LitServer, "run", lambda server, **_: servers.append(server))
    serve(checkpoint_dir, **{"top_k": 1, "max_new_tokens": NEW_TOKENS, "accelerator": "cpu", **options})
    return wrap_litserve_start(servers[0])


@pytest.mark.parametrize("stream", [False, True])
def test_served_answer_is_generates_greedy_text(quantized, monkeypatch, stream):
    expected = generate(quantized, prompt="hello", max_new_tokens=NEW_TOKENS, device="cpu", temperature=0.0)
    with started(monkeypatch, quantized, stream=stream) as server, TestClient(server.app) as client:
        response = client.post("/predict", json={"prompt": "hello"})
    assert response.status_code == 200
    if stream:  # one JSON line a token, which join into the answer (the tiny tokenizer puts a space between tokens)
        pieces = [json.loads(line)["output"] for line in response.text.splitlines() if line]
        assert "".join(pieces) == expected and len(pieces) == len(expected.split(" "))
    else:
        assert response.json() == {"output": expected}


@pytest.mark.parametrize("stream", [False, True])
def test_request_without_a_prompt_is_the_clients_error(quantized, monkeypatch, stream):
    with started(monkeypatch, quantized, stream=stream) as server, TestClient(server.app) as client:
        for request in ({"text": "hello"}, ["hello"], {"prompt": ["hello"]}):
            response = client.post("/predict", json=request)
            assert response.status_code == 422  # FastAPI's answer to a body that fails validation
            assert response.json()["detail"][0]["loc"] in (["body", "prompt"], ["body"])
        assert client.post("/predict", json={"prompt": "hello"}).status_code == 200  # the server lives on


def test_openai_chat_completions(quantized, monkeypatch):
    """The OpenAI endpoint's answer to one user message is `generate`'s greedy text for the message in litgpt's
    default chat template (the tiny checkpoint's tokenizer config has none), its streamed tokens joined."""
    assert "chat_template" not in (quantized / "tokenizer_config.json").read_text()
    expected = generate(quantized, prompt="user: hello\nAssistant: ", max_new_tokens=NEW_TOKENS, device="cpu",
                        temperature=0.0)
    with started(monkeypatch, quantized, openai_spec=True) as server, TestClient(server.app) as client:
        response = client.post("/v1/chat/completions",
                               json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200
    answer = response.json()["choices"][0]["message"]
    assert (answer["role"], answer["content"]) == ("assistant", expected) and expected.strip()


def test_openai_requests_sampling_settings(quantized, monkeypatch):
    """A request's `temperature: 0` is greedy on a server that samples (litgpt's took 0 for unset), `max_tokens`
    bounds the answer as `max_completion_tokens` does, and settings that cannot sample are the client's error."""
    prompt = "user: hello\nAssistant: "
    greedy = {n: generate(quantized, prompt=prompt, max_new_tokens=n, device="cpu", temperature=0.0)
              for n in (3, NEW_TOKENS)}
    assert greedy[3] != greedy[NEW_TOKENS]
    messages = [{"role": "user", "content": "hello"}]
    with (started(monkeypatch, quantized, openai_spec=True, top_k=None, temperature=1.0) as server,
          TestClient(server.app) as client):
        def answer(**settings):
            response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, **settings})
            return response.status_code, response.json()
        for settings, n in [({}, NEW_TOKENS), ({"max_tokens": 3}, 3), ({"max_completion_tokens": 3}, 3)]:
            status, body = answer(temperature=0, **settings)
            assert (status, body["choices"][0]["message"]["content"]) == (200, greedy[n])
        status, body = answer(temperature=0, top_p=0)
        assert status == 400 and "top_p must be in (0, 1], not 0" in json.dumps(body)


def test_serve_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_config.yaml"):
        serve(tmp_path, accelerator="cpu")


def test_serve_refuses_what_its_worker_would_before_starting_one(quantized, tmp_path, monkeypatch):
    """LitServe loads the model in a worker process, where a refusal ends in a traceback: `serve` refuses a
    kernel that cannot run here, a truncated weights file and bad sampling settings itself, before any server."""
    monkeypatch.setattr(litserve.LitServer, "__init__", lambda *_, **__: pytest.fail("a server was built"))
    with pytest.raises(ValueError, match="kernel 'marlin' cannot run this checkpoint on cpu"):
        serve(quantized, accelerator="cpu", kernel="marlin")
    with pytest.raises(ValueError, match="top_k must be at least 1"):
        serve(quantized, accelerator="cpu", top_k=0)
    truncated = tmp_path / "truncated"
    shutil.copytree(quantized, truncated)
    weights = truncated / "lit_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="lit_model.safetensors is corrupt or truncated"):
        serve(truncated, accelerator="cpu")


def post(url: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_served_from_the_command_line_and_stopped_by_ctrl_c(quantized, tmp_path, accelerator):
    """`litquant serve` as a user runs it: in its own process (LitServe's workers in theirs), answering over a real
    port, and ended by Ctrl-C, which a terminal sends to the whole process group. (On the GPU, the server's process
    checks the device itself, `plan_load`, before LitServe's worker loads the model.)"""
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "litquant", "serve", str(quantized), "--accelerator", accelerator, "--port", str(port),
         "--top_k", "1", "--max_new_tokens", str(NEW_TOKENS)],
        stdout=(log := open(tmp_path / "serve.log", "w")), stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job would ignore it
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5).close()
                break
            except (urllib.error.URLError, ConnectionError):  # not up yet, or workers still loading
                assert server.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(0.5)
        expected = generate(quantized, prompt="hello", max_new_tokens=NEW_TOKENS, device=accelerator, temperature=0.0)
        assert post(f"{url}/predict", {"prompt": "hello"}) == (200, {"output": expected})
        status, answer = post(f"{url}/predict", {"text": "hello"})
        assert status == 422 and answer["detail"][0]["loc"] == ["body", "prompt"]
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    assert "KeyboardInterrupt received" in (tmp_path / "serve.log").read_text()


def eager_and_compiled_answers(monkeypatch, capfd, checkpoint_dir: Path, prompts, **options) -> tuple:
    """The simple endpoint's answers to `prompts`, from an eager server and then from one compiled at startup (in
    that order: `--compile` swaps litgpt's `next_token` for the process)."""
    answers = []
    for compile in (False, True):  # (a request may wait for the startup compile: LitServe's tests do not)
        with started(monkeypatch, checkpoint_dir, compile=compile, timeout=600, **options) as server, \
                TestClient(server.app) as client:
            answers.append([client.post("/predict", json={"prompt": p}).json()["output"] for p in prompts])
    assert "compiled the decode step" in capfd.readouterr().err
    return tuple(answers)


def test_compiled_server_answers_as_the_eager_one(quantized, monkeypatch, capfd):
    """`--compile`: after its startup compile, requests of other lengths get the eager server's greedy text."""
    eager, compiled = eager_and_compiled_answers(monkeypatch, capfd, quantized, ["hello", "the cat sat on the mat"])
    assert compiled == eager


@pytest.mark.gpu
def test_compiled_server_on_gpu_answers_as_the_eager_one(tmp_path, monkeypatch, capfd):
    """The same on the GPU, marlin (CUDA graphs; fp16, where a tiny random model's near-tied logits stay resolved)."""
    from conftest import make_tiny_checkpoint

    checkpoint = quantize(make_tiny_checkpoint(tmp_path / "ck", "llama_gpu"), tmp_path / "q", method="rtn", bits=4,
                          group_size=64, kernel="marlin", device="cuda")
    eager, compiled = eager_and_compiled_answers(monkeypatch, capfd, checkpoint, ["hello", "the cat sat on the mat"],
                                                 accelerator="cuda", precision="16-true")
    assert compiled == eager
