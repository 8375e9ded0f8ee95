"""quantize -> save -> load -> generate on tiny random LitGPT models, and every bad input on the way."""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from litgpt.config import Config
from litgpt.model import GPT

from litquant.checkpoint import WEIGHTS_NAME, CheckpointError
from litquant.config import QuantizeConfig
from litquant.generate import chat, generate
from litquant.kernels import KernelNotSupported
from litquant.load import load_model
from litquant.perplexity import perplexity
from litquant.quantize.main import quantize
from litquant.quantize.quantizer import rtn_quantize


def fake_quantized_reference(checkpoint_dir: Path, config, bits: int, group_size: int, sym: bool) -> GPT:
    """The original model with each quantizable Linear replaced by its RTN dequantization, and everything
    else rounded to bf16 the way the checkpoint stores it."""
    state = torch.load(checkpoint_dir / "lit_model.pth")
    model = GPT(config)
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    for name, t in state.items():
        module, _, key = name.rpartition(".")
        if module in linears and key == "weight":
            state[name] = rtn_quantize(t.float(), bits, group_size, sym).dequantize()
        else:
            state[name] = t.bfloat16().float()
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("bits,group_size,sym", [(4, 32, True), (3, 32, False), (8, -1, True), (2, 64, False)])
def test_quantized_logits_match_fake_quantized_reference(tiny_checkpoint, tmp_path, bits, group_size, sym):
    out = quantize(tiny_checkpoint, tmp_path / "q", method="rtn", bits=bits, group_size=group_size, sym=sym,
                   kernel="torch", device="cpu")
    loaded = load_model(out, device="cpu")
    assert loaded.kernel == "torch" and loaded.quantization.startswith(f"rtn {bits}-bit g{group_size}")
    reference = fake_quantized_reference(tiny_checkpoint, loaded.config, bits, group_size, sym)
    idx = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        out_logits, ref_logits = loaded.model(idx), reference(idx)
    assert torch.isfinite(out_logits).all()
    assert (out_logits - ref_logits).norm() / ref_logits.norm() < 1e-5


def test_checkpoint_files_follow_the_gptq_spec(tiny_llama_checkpoint, tmp_path):
    out = quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, kernel="torch", device="cpu")
    saved = json.loads((out / "quantize_config.json").read_text())
    assert saved["quant_method"] == "gptq" and saved["checkpoint_format"] == "gptq" and saved["sym"] is True
    assert saved["litquant"] == {"method": "rtn", "kernel": "torch", "ignore_modules": ["lm_head"]}
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS_NAME), "pt") as f:
        names = set(f.keys())
        qkv = f.get_tensor("transformer.h.0.attn.qkv.qzeros")
        assert f.get_tensor("transformer.h.0.attn.qkv.qweight").shape == (64 * 4 // 32, 128)  # [K*bits/32, N]
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert (qkv == 0x77777777).all()  # symmetric 4-bit, v1 zero-minus-one
    assert "transformer.h.0.attn.qkv.weight" not in names and "lm_head.qweight" not in names
    assert sorted(p.name for p in out.iterdir()) == ["lit_model.safetensors", "model_config.yaml",
                                                     "quantize_config.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.parametrize("source_name, uses_bos", [("SmolLM2-135M-Instruct", True), ("tiny-llama", False)])
def test_quantized_checkpoint_tokenizes_as_its_source(tmp_path, source_name, uses_bos):
    """litgpt adds BOS in a directory named SmolLM2-*-Instruct whatever its tokenizer config says (and elsewhere drops
    a leading one): the quantized checkpoint, under another name, keeps its source's decision."""
    from conftest import make_tiny_checkpoint
    from litgpt.tokenizer import Tokenizer

    source = make_tiny_checkpoint(tmp_path / source_name)
    tokenizer_config = source / "tokenizer_config.json"
    tokenizer_config.write_text(tokenizer_config.read_text().replace('"add_bos_token": true', '"add_bos_token": false'))
    out = quantize(source, tmp_path / "q", method="rtn", group_size=32, kernel="torch", device="cpu")
    for checkpoint in (source, out):
        tokenizer = Tokenizer(checkpoint)
        assert tokenizer.use_bos == uses_bos
        assert tokenizer.encode("hi").tolist() == ([0] if uses_bos else []) + tokenizer.encode("hi", bos=False).tolist()


def test_rtn_while_loading_matches_the_checkpoint_path(tiny_llama_checkpoint, tmp_path):
    out = quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, kernel="torch", device="cpu")
    from_checkpoint = load_model(out, device="cpu", precision="32-true").model
    on_load = load_model(tiny_llama_checkpoint, quantize="rtn.int4-g32", device="cpu", precision="32-true").model
    idx = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        a, b = from_checkpoint(idx), on_load(idx)
    # same quantized Linears; only the bf16 storage of the unquantized tensors differs
    assert (a - b).norm() / b.norm() < 1e-2


def test_generate_and_perplexity_from_a_quantized_checkpoint(tiny_checkpoint, tmp_path, capsys):

    out = quantize(tiny_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, kernel="torch", device="cpu")
    text = generate(out, prompt="hello", max_new_tokens=8, device="cpu", apply_prompt_style=False)
    text_file = tmp_path / "text.txt"
    text_file.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    ppl = perplexity(out, text_file, window=64, device="cpu")
    printed = capsys.readouterr()

    # the references: greedy decoding by full forward passes (no KV cache), and each window scored on its own
    loaded = load_model(out, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = prompt = tokenizer.encode("hello")
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids[None])[0, -1].argmax().view(1)])
            if ids[-1] == tokenizer.eos_id:
                break
        assert text == tokenizer.decode(ids[len(prompt):])
        tokens = tokenizer.encode(text_file.read_text(), bos=False, eos=False)
        windows = tokens[: tokens.numel() // 64 * 64].long().view(-1, 64)
        nll = sum(torch.nn.functional.cross_entropy(model(w[None, :-1])[0], w[1:], reduction="sum") for w in windows)
    count = windows.numel() - len(windows)
    assert ppl == pytest.approx(torch.exp(nll / count).item(), rel=1e-4)
    assert "tokens/s" in printed.err
    assert f"perplexity: {ppl:.4f}" in printed.out and f"tokens evaluated: {count} " in printed.out


def test_quantization_is_atomic(tiny_llama_checkpoint, tmp_path, monkeypatch):
    import litquant.checkpoint as ckpt

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, device="cpu")
    assert list(tmp_path.iterdir()) == [tiny_llama_checkpoint]  # no out_dir, no temp dir left


def test_existing_out_dir_is_not_overwritten(tiny_llama_checkpoint, tmp_path):
    out = quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, device="cpu")
    before = (out / WEIGHTS_NAME).read_bytes()
    with pytest.raises(FileExistsError, match="already exists and is not empty; pass --overwrite true"):
        quantize(tiny_llama_checkpoint, out, method="rtn", bits=8, group_size=32, device="cpu")
    assert (out / WEIGHTS_NAME).read_bytes() == before
    quantize(tiny_llama_checkpoint, out, method="rtn", bits=8, group_size=32, device="cpu", overwrite=True)
    assert QuantizeConfig.load(out).bits == 8
    # every file of the checkpoint is as readable as the config files (safetensors writes its file 0600)
    assert len({(p.stat().st_mode & 0o777) for p in out.iterdir()}) == 1


def test_overwrite_never_replaces_what_is_not_a_quantized_checkpoint(tiny_llama_checkpoint, tmp_path):
    """--overwrite replaces an earlier quantized checkpoint only: not a directory of the user's files, and not the
    unquantized checkpoint itself."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a quantized checkpoint .* --overwrite never replaces"):
        quantize(tiny_llama_checkpoint, mine, method="rtn", bits=4, group_size=32, device="cpu", overwrite=True)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    before = sorted(p.name for p in tiny_llama_checkpoint.iterdir())
    with pytest.raises(FileExistsError, match="is not a quantized checkpoint"):
        quantize(tiny_llama_checkpoint, tiny_llama_checkpoint, method="rtn", bits=4, group_size=32, device="cpu",
                 overwrite=True)
    assert sorted(p.name for p in tiny_llama_checkpoint.iterdir()) == before


def test_quantize_names_a_directory_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_config.yaml not found: not a litgpt or litquant checkpoint"):
        quantize(tmp_path / "nowhere", tmp_path / "q", method="rtn", device="cpu")
    assert not (tmp_path / "q").exists()


@pytest.fixture
def quantized(tiny_llama_checkpoint, tmp_path) -> Path:
    return quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, kernel="torch", device="cpu")


def test_truncated_checkpoint_is_an_error(quantized):
    path = quantized / WEIGHTS_NAME
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(quantized, device="cpu")


def test_garbage_checkpoint_is_an_error(quantized):
    (quantized / WEIGHTS_NAME).write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_model(quantized, device="cpu")


def test_a_quantized_checkpoint_without_its_config_is_named_as_such(quantized):
    (quantized / "quantize_config.json").unlink()
    with pytest.raises(CheckpointError, match="has lit_model.safetensors but no quantize_config.json"):
        load_model(quantized, device="cpu")


def test_settings_that_cannot_work_are_refused_before_any_model_loads(tmp_path):
    """Each is refused before the checkpoint (here a directory that does not exist) is even read."""
    missing = tmp_path / "missing"
    for call, message in [
        (lambda: quantize(missing, method="gptq", seq_len=0), "seq_len >= 2"),
        (lambda: quantize(missing, method="awq", batch_size=0), "batch_size >= 1"),
        (lambda: perplexity(missing, text_file=missing, window=1), "window must be at least 2 tokens, not 1"),
        (lambda: perplexity(missing, text_file=missing, batch_size=0), "batch_size must be at least 1, not 0"),
        (lambda: generate(missing, top_k=0), "top_k must be at least 1"),
        (lambda: generate(missing, temperature=-1.0), "temperature must be 0"),
        (lambda: generate(missing, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (lambda: generate(missing, max_new_tokens=0), "max_new_tokens must be at least 1"),
        (lambda: generate(missing, num_samples=0), "num_samples must be at least 1"),
        (lambda: chat(missing, top_k=0), "top_k must be at least 1"),
        (lambda: quantize(missing, method="awq", calibration_file=tmp_path), "calibration directory .* has no"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(FileNotFoundError, match="calibration file .*nowhere.txt does not exist"):
        quantize(missing, method="gptq", calibration_file=tmp_path / "nowhere.txt")


def test_chat_ends_quietly_at_the_end_of_its_input(tiny_llama_checkpoint, monkeypatch, capsys):
    def no_more_input(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", no_more_input)
    chat(tiny_llama_checkpoint, device="cpu")
    assert "Now chatting with" in capsys.readouterr().out


def test_missing_weights_file_is_an_error(quantized):
    (quantized / WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match="lit_model.safetensors not found"):
        load_model(quantized, device="cpu")


def test_checkpoint_that_does_not_match_its_config(quantized):
    config = json.loads((quantized / "quantize_config.json").read_text())
    config["bits"] = 8
    (quantized / "quantize_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"transformer.h.0.attn.qkv.qweight is torch.int32 \[8, 128\], expected torch.int32 \[16, 128\]") as error:
        load_model(quantized, device="cpu")
    assert str(error.value).endswith(" more)")  # the first problems, and a count of the rest


def test_missing_tensor_is_named(quantized):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(quantized / WEIGHTS_NAME))
    del tensors["transformer.h.1.mlp.proj.scales"], tensors["transformer.ln_f.weight"]
    save_file(tensors, str(quantized / WEIGHTS_NAME))
    with pytest.raises(CheckpointError, match="missing tensors: transformer.h.1.mlp.proj.scales, transformer.ln_f.weight"):
        load_model(quantized, device="cpu")


def test_config_errors(quantized):
    path = quantized / "quantize_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "bogus_field": 1}))
    with pytest.raises(ValueError, match=r"unknown GPTQ fields \['bogus_field'\]"):
        load_model(quantized, device="cpu")
    path.write_text(json.dumps({**config, "bits": 5}))
    with pytest.raises(ValueError, match="bits must be 2, 3, 4 or 8, not 5"):
        load_model(quantized, device="cpu")
    path.write_text(json.dumps({**config, "group_size": "128"}))
    with pytest.raises(ValueError, match="group_size must be an integer, not '128'"):
        load_model(quantized, device="cpu")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_model(quantized, device="cpu")
    with pytest.raises(ValueError, match="AWQ checkpoints store zero points: use sym=False"):
        QuantizeConfig(method="awq", checkpoint_format="awq_gemm", sym=True)


def test_unsupported_kernel_fails_before_loading_weights(quantized, monkeypatch):
    import litquant.kernels as registry
    from litquant.kernels.torch_dequant import TorchQuantLinear

    class EightBitOnly(TorchQuantLinear):
        name = "eightbit"
        bits = (8,)

    monkeypatch.setitem(registry.REGISTRY, "eightbit", "tests_fake:EightBitOnly")
    monkeypatch.setitem(sys.modules, "tests_fake", type(sys)("tests_fake"))
    sys.modules["tests_fake"].EightBitOnly = EightBitOnly
    (quantized / WEIGHTS_NAME).write_bytes(b"not read")  # proves no weight is read before the check
    with pytest.raises(KernelNotSupported, match=r"kernel 'eightbit' cannot run this checkpoint on cpu in float32: "
                                                 r"transformer.h.0.attn.qkv: supports 8-bit, not 4-bit. Kernels that can run it here: .*torch"):
        load_model(quantized, device="cpu", kernel="eightbit")
    config = json.loads((quantized / "quantize_config.json").read_text())
    config["litquant"]["kernel"] = "eightbit"  # as `quantize --kernel eightbit` records it
    (quantized / "quantize_config.json").write_text(json.dumps(config))
    with pytest.raises(KernelNotSupported, match=r"Kernels that can run it here: .*torch\. 'eightbit' is the kernel "
                                                 r"that the checkpoint's quantize_config.json names; --kernel picks"):
        load_model(quantized, device="cpu")
    with pytest.raises(KernelNotSupported, match="unknown kernel 'nope'"):
        load_model(quantized, device="cpu", kernel="nope")


def test_auto_moves_past_a_kernel_whose_build_fails(quantized, monkeypatch):
    import litquant.kernels as registry
    from litquant.kernels.torch_dequant import TorchQuantLinear

    class BuildFails(TorchQuantLinear):
        name = "buildfails"

        @classmethod
        def prepare(cls, device):
            return "the CUDA build failed: nvcc exited with 1"

    monkeypatch.setitem(registry.REGISTRY, "buildfails", "tests_fake:BuildFails")
    monkeypatch.setitem(sys.modules, "tests_fake", type(sys)("tests_fake"))
    sys.modules["tests_fake"].BuildFails = BuildFails
    monkeypatch.setattr(registry, "AUTO_ORDER", ("buildfails", "torch"))
    with pytest.warns(UserWarning, match="kernel 'auto': skipping buildfails: the CUDA build failed"):
        model = load_model(quantized, device="cpu", kernel="auto")
    assert {type(m) for m in model.model.modules() if isinstance(m, registry.QuantLinear)} == {TorchQuantLinear}


def test_quantize_validates_the_kernel_before_any_work(tiny_llama_checkpoint, tmp_path, monkeypatch):
    import litquant.kernels as registry
    from litquant.kernels.torch_dequant import TorchQuantLinear

    class SymmetricOnly(TorchQuantLinear):
        name = "symonly"
        zero_point = False

    monkeypatch.setattr(registry, "kernel_class", lambda name: SymmetricOnly if name == "symonly" else TorchQuantLinear)
    monkeypatch.setitem(registry.REGISTRY, "symonly", "x:y")
    with pytest.raises(KernelNotSupported, match="kernel 'symonly' cannot run the checkpoint these settings produce: "
                                                 "transformer.h.0.attn.qkv: supports symmetric weights only"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", sym=False, kernel="symonly", device="cpu")
    assert not (tmp_path / "q").exists()


def test_nan_weights_are_refused(tiny_llama_checkpoint, tmp_path):
    state = torch.load(tiny_llama_checkpoint / "lit_model.pth")
    state["transformer.h.0.mlp.fc_1.weight"][3, 5] = float("nan")
    torch.save(state, tiny_llama_checkpoint / "lit_model.pth")
    with pytest.raises(FloatingPointError, match="transformer.h.0.mlp.fc_1.weight has NaN"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", device="cpu", group_size=32)


def test_corrupt_source_checkpoint(tiny_llama_checkpoint, tmp_path):
    path = tiny_llama_checkpoint / "lit_model.pth"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="lit_model.pth is corrupt or truncated"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", device="cpu", group_size=32)


def test_a_device_this_machine_lacks_is_refused_before_any_work(tiny_llama_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': torch sees no CUDA GPU here \(torch .*\); use cpu"):
        load_model(tiny_llama_checkpoint, device="cuda")
    with pytest.raises(ValueError, match="unknown device 'tpu': use cuda, cuda:<index> or cpu"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", group_size=32, device="tpu")
    with pytest.raises(ValueError, match="device 'meta' is not supported: use cuda, cuda:<index> or cpu"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", group_size=32, device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"device 'cuda:2': this machine has 2 CUDA GPU\(s\)"):
        load_model(tiny_llama_checkpoint, device="cuda:2")
    assert not (tmp_path / "q").exists()


def test_bnb_nf4_baseline_loads_plain_checkpoints(tiny_llama_checkpoint):
    """bnb.nf4 quantizes a plain checkpoint at load: its logits are the unquantized model's within NF4's error
    (about 11% on this random model's weights)."""
    import bitsandbytes as bnb

    tokens = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(0))
    logits = {}
    for quantize_as in (None, "bnb.nf4"):
        loaded = load_model(tiny_llama_checkpoint, quantize=quantize_as, device="cpu", precision="bf16-true")
        with torch.no_grad():
            logits[quantize_as] = loaded.model(tokens).float()
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in loaded.model.modules())
    error = ((logits["bnb.nf4"] - logits[None]).norm() / logits[None].norm()).item()
    assert 0 < error < 0.25


def test_cli_help_lists_litgpt_and_litquant_commands():
    out = subprocess.run([sys.executable, "-m", "litquant", "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("finetune_lora", "pretrain", "download", "quantize", "generate", "chat", "serve", "perplexity",
                    "convert_gguf_to_litgpt", "kernels", "demo"):
        assert command in out
    out = subprocess.run([sys.executable, "-m", "litquant", "quantize", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "--desc_act" in out and "act_order" in out and "--kernel" in out


def test_cli_says_what_is_wrong_with_the_input_in_one_line(tmp_path):
    """Bad input ends the command with its message and exit status 1, not a traceback (unless LITQUANT_TRACEBACK)."""
    command = [sys.executable, "-m", "litquant", "generate", str(tmp_path / "missing")]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"litquant: error: {tmp_path / 'missing'}/model_config.yaml not found: not a litgpt or litquant checkpoint" \
        in done.stderr
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "LITQUANT_TRACEBACK": "1"})
    assert done.returncode == 1 and "Traceback" in done.stderr and "FileNotFoundError" in done.stderr


def test_litgpts_commands_refuse_a_quantized_checkpoint_up_front(quantized, tiny_llama_checkpoint, tmp_path):
    """litgpt's commands read lit_model.pth: `litquant.__main__.full_precision_only` names the problem before they
    start (litgpt's `convert_from_litgpt` wrote a model.pth before failing), and passes ordinary checkpoints on."""
    from litquant.__main__ import COMMANDS

    message = f"{quantized} is a litquant quantized checkpoint, and litgpt's `convert_from_litgpt` reads only"
    with pytest.raises(ValueError, match=re.escape(message)):
        COMMANDS["convert_from_litgpt"](quantized, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ValueError, match="`generate_speculatively` reads only full-precision"):
        COMMANDS["generate_speculatively"](tiny_llama_checkpoint, target_model_checkpoint_dir=quantized)
    COMMANDS["convert_from_litgpt"](tiny_llama_checkpoint, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.pth").is_file()
    done = subprocess.run([sys.executable, "-m", "litquant", "finetune_lora", str(quantized)], capture_output=True,
                          text=True)
    assert done.returncode == 1 and "litgpt's `finetune_lora` reads only full-precision" in done.stderr


@pytest.mark.parametrize("arguments, message", [
    (["quantize", "--method", "foo"], 'Parser key "method": expected one of rtn, gptq, awq'),
    (["benchmark", "--methods", "[rtn,foo]"], 'Parser key "methods": expected one of rtn, gptq, awq'),
])
def test_cli_names_the_choices_of_a_mistyped_choice(arguments, message):
    """Not jsonargparse 4.41's "Cannot take a Union of no types." (`litquant.__main__.Parser`)."""
    done = subprocess.run([sys.executable, "-m", "litquant", *arguments], capture_output=True, text=True)
    assert done.returncode == 2 and f"error: {message}\n" in done.stderr and "Union" not in done.stderr


def test_readme_rtn_quantize_and_generate_commands_run(tiny_llama_checkpoint, tmp_path):
    """The README's RTN quantize and generate lines, as written there, on a tiny checkpoint."""
    readme = (Path(__file__).parents[1] / "README.md").read_text().splitlines()
    lines = [line.strip() for line in readme
             if line.strip().startswith(("litquant quantize checkpoints/smollm2 --method rtn", "litquant generate"))]
    assert len(lines) == 2
    runs = []
    for line in lines:
        line = line.replace("checkpoints/smollm2", str(tiny_llama_checkpoint)).replace("q/", f"{tmp_path}/q/")
        runs.append(subprocess.run([sys.executable, "-m", *shlex.split(line)], capture_output=True, text=True))
        assert runs[-1].returncode == 0, runs[-1].stderr[-2000:]

    out = tmp_path / "q" / "smollm2-rtn4"
    config = QuantizeConfig.load(out)
    assert (config.method, config.bits, config.group_size, config.kernel) == ("rtn", 4, 64, "auto")
    text = generate(out, prompt="What is a hacker?", max_new_tokens=40, kernel="torch", device="cpu")
    assert runs[1].stdout == text + "\n" and "tokens/s" in runs[1].stderr


def test_cli_quantize_from_yaml_config(tiny_llama_checkpoint, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"checkpoint_dir: {tiny_llama_checkpoint}\nout_dir: {tmp_path / 'q'}\nmethod: rtn\nbits: 3\n"
                      "group_size: 32\nsym: false\nkernel: torch\ndevice: cpu\n")
    subprocess.run([sys.executable, "-m", "litquant", "quantize", "--config", str(recipe)], check=True,
                   capture_output=True, text=True)
    config = QuantizeConfig.load(tmp_path / "q")
    assert (config.bits, config.group_size, config.sym, config.method) == (3, 32, False, "rtn")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,precision,bits", [("torch", "32-true", 4), ("triton", "32-true", 4),
                                                  ("marlin", "16-true", 4), ("marlin", "16-true", 8)])
def test_generate_on_gpu_eager_compiled_and_across_kernels(tmp_path, kernel, precision, bits):
    """`litquant generate --compile` gives the eager greedy tokens, and each kernel agrees with torch's logits.

    A random tiny model has near-ties among its logits, which bf16 rounding differences between inductor's fused
    code and eager code flip (seen on an H200: 2 of 3 kernels diverged at token 11 in bf16). So the token check
    runs in the widest dtype each kernel takes (fp32, or fp16 for marlin), where such ties stay resolved."""
    from conftest import make_tiny_checkpoint

    checkpoint = make_tiny_checkpoint(tmp_path / "ck", "llama_gpu")
    out = quantize(checkpoint, tmp_path / "q", method="rtn", bits=bits, group_size=64, kernel=kernel, device="cuda")
    options = dict(prompt="hello", max_new_tokens=12, device="cuda", precision=precision, apply_prompt_style=False)
    eager = generate(out, **options)
    compiled = generate(out, compile=True, **options)
    assert compiled == eager
    idx = torch.randint(0, 96, (2, 32), device="cuda")
    with torch.no_grad():
        logits = load_model(out, device="cuda").model(idx).float()
        reference = load_model(out, device="cuda", kernel="torch").model(idx).float()
    assert (logits - reference).norm() / reference.norm() < 2e-2


def test_a_gpu_device_keeps_its_index_to_the_fabric(monkeypatch):
    """`--device cuda:1` must reach Fabric as that GPU: its `devices=1` alone is the first GPU. Plain `cuda` is the
    current GPU, by its index. (Lightning is told of two GPUs; nothing runs on them.)"""
    import lightning.fabric.accelerators.cuda as lightning_cuda

    from litquant.kernels import resolve_device
    from litquant.load import one_device_fabric

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(lightning_cuda, "num_cuda_devices", lambda: 2)
    assert resolve_device("cuda") == resolve_device(None) == resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert one_device_fabric(torch.device("cuda", 1), precision="16-true").device == torch.device("cuda", 1)
    assert one_device_fabric(torch.device("cpu"), precision="32-true").device == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("kernel,precision", [("torch", "32-true"), ("triton", "32-true"), ("marlin", "16-true")])
def test_gpu_a_second_gpu_runs_the_model_there(tmp_path, kernel, precision):
    """`--device cuda:1` quantizes, loads and generates on the second GPU, with the first GPU's tokens; and its
    layers still run there when the first GPU is the current device (Triton launches on the current one)."""
    from conftest import make_tiny_checkpoint

    second = torch.device("cuda", 1)
    checkpoint = make_tiny_checkpoint(tmp_path / "ck", "llama_gpu")
    try:
        out = quantize(checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=64, kernel=kernel, device="cuda:1")
        options = dict(prompt="hello", max_new_tokens=12, precision=precision, apply_prompt_style=False)
        assert generate(out, device="cuda:1", **options) == generate(out, device="cuda:0", **options)
        loaded = load_model(out, device="cuda:1", precision=precision)
        assert torch.cuda.current_device() == 1 and loaded.fabric.device == second
        assert {t.device for t in [*loaded.model.parameters(), *loaded.model.buffers()]} == {second}
        reference = load_model(out, device="cuda:1", precision=precision, kernel="torch").model
        torch.cuda.set_device(0)
        idx = torch.randint(0, 96, (2, 32), device=second)
        with torch.no_grad():
            logits, expected = loaded.model(idx).float(), reference(idx).float()
        assert logits.device == second and (logits - expected).norm() / expected.norm() < 2e-2
    finally:
        torch.cuda.set_device(0)


@pytest.mark.parametrize("method,extra", [("gptq", {"desc_act": True}), ("gptq", {"checkpoint_format": "gptq_v2"}),
                                          ("awq", {"version": "gemm"}), ("awq", {"version": "gemv"})])
def test_calibrated_recipes_end_to_end(tiny_llama_checkpoint, tmp_path, method, extra):
    """`litquant quantize --method gptq|awq` writes a checkpoint that loads and stays close to the original."""
    text = tmp_path / "calibration.txt"
    text.write_text("the quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 30)
    out = quantize(tiny_llama_checkpoint, tmp_path / "q", method=method, bits=4, group_size=32, kernel="torch",
                   calibration_file=text, num_samples=8, seq_len=32, batch_size=4, device="cpu", **extra)
    config = QuantizeConfig.load(out)
    assert config.method == method and (config.is_awq == (method == "awq"))
    quantized = load_model(out, device="cpu", precision="32-true").model
    original = load_model(tiny_llama_checkpoint, device="cpu", precision="32-true").model
    idx = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        q, ref = quantized(idx), original(idx)
    assert torch.isfinite(q).all()
    # 4-bit g32 on a random 2-block model costs ~13% of the logits' norm; a wrong fold or unpack costs ~100%
    assert (q - ref).norm() / ref.norm() < 0.25


def drop_tensor(checkpoint_dir: Path, name: str) -> None:
    state = torch.load(checkpoint_dir / "lit_model.pth")
    del state[name]
    torch.save(state, checkpoint_dir / "lit_model.pth")


@pytest.mark.parametrize("path", ["plain", "bnb.nf4", "rtn on load", "quantize rtn", "quantize gptq"])
def test_a_tensor_missing_from_lit_model_pth_is_named_before_any_work(tiny_llama_checkpoint, tmp_path, path):
    """Every path that reads a litgpt checkpoint names the missing tensor in one CheckpointError, where it used to end
    in a KeyError, torch's strict-load RuntimeError, or (RTN while loading) a model that failed at its first call."""
    drop_tensor(tiny_llama_checkpoint, "transformer.h.1.attn.qkv.weight")
    expected = r"lit_model.pth does not match model_config.yaml: missing tensors: transformer.h.1.attn.qkv.weight$"
    with pytest.raises(CheckpointError, match=expected):
        if path.startswith("quantize"):
            quantize(tiny_llama_checkpoint, tmp_path / "q", method=path.split()[1], group_size=32, device="cpu",
                     num_samples=1, seq_len=8)
        else:
            load_model(tiny_llama_checkpoint, device="cpu",
                       quantize={"plain": None, "bnb.nf4": "bnb.nf4", "rtn on load": "rtn.int4-g32"}[path])
    assert not (tmp_path / "q").exists()


def test_legacy_interleaved_qkv_checkpoints_load_on_every_path(tiny_llama_checkpoint):
    """litgpt < 0.5.5 stored each query group's q heads, k and v together under `attn.attn`; litquant converts them
    as litgpt's own loader does, for its RTN paths too."""
    from litquant.checkpoint import load_litgpt_state

    config = Config.from_file(tiny_llama_checkpoint / "model_config.yaml")
    state = torch.load(tiny_llama_checkpoint / "lit_model.pth")
    current = dict(state)
    groups, per_group, head = config.n_query_groups, config.n_head // config.n_query_groups, config.head_size
    for i in range(config.n_layer):
        q, k, v = state.pop(f"transformer.h.{i}.attn.qkv.weight").split(
            [config.n_head * head, groups * head, groups * head])
        legacy = torch.cat([q.view(groups, per_group * head, -1), k.view(groups, head, -1), v.view(groups, head, -1)],
                           dim=1)
        state[f"transformer.h.{i}.attn.attn.weight"] = legacy.reshape(-1, config.n_embd)
    torch.save(state, tiny_llama_checkpoint / "lit_model.pth")
    converted = load_litgpt_state(tiny_llama_checkpoint, config)
    assert converted.keys() == current.keys()
    assert all(torch.equal(converted[name], current[name]) for name in current)
    x = torch.tensor([[5, 9, 12, 40]])
    plain = load_model(tiny_llama_checkpoint, device="cpu").model(x)
    rtn = load_model(tiny_llama_checkpoint, device="cpu", quantize="rtn.int4-g32").model(x)
    model = GPT(config)
    model.load_state_dict(current)
    assert torch.allclose(plain, model(x), atol=1e-5)
    assert (rtn - plain).norm() / plain.norm() < 0.2


def test_gptq_and_awq_refuse_linears_outside_the_blocks_before_any_work(tiny_llama_checkpoint, tmp_path,
                                                                          monkeypatch):
    """They quantize inside the transformer blocks only: with lm_head not ignored, the checkpoint would not load.
    The refusal comes before the calibration text (which the model may take minutes to write)."""
    import litquant.quantize.main as main

    monkeypatch.setattr(main, "calibration_tokens", lambda *args, **kwargs: pytest.fail("calibration ran"))
    for method in ("gptq", "awq"):
        with pytest.raises(ValueError, match=f"{method.upper()} quantizes the Linears of the transformer blocks, and "
                                             r"lm_head lies outside them: add it to ignore_modules \(as the default, "
                                             r"\['lm_head'\], does\), or quantize with rtn"):
            quantize(tiny_llama_checkpoint, tmp_path / "q", method=method, group_size=32, device="cpu",
                     ignore_modules=[])
    with pytest.raises(ValueError, match="AWQ needs in_features to be a multiple of group_size: transformer.h.0.attn.qkv "
                                         "has 64 inputs, group_size is 128"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="awq", group_size=128, device="cpu")
    assert not (tmp_path / "q").exists()


def test_rtn_refuses_act_order():
    with pytest.raises(ValueError, match=r"RTN quantizes every weight on its own, in order: desc_act \(act_order\) "
                                         "needs GPTQ"):
        QuantizeConfig(method="rtn", desc_act=True)


def test_kernels_command_checks_the_dtype_asked_for(monkeypatch, capsys):
    """`litquant kernels --dtype` reports a kernel that cannot take that dtype here (it once ignored the option)."""
    import litquant.kernels as registry
    from litquant.kernels import kernels
    from litquant.kernels.torch_dequant import TorchQuantLinear

    class HalfOnly(TorchQuantLinear):
        name = "halfonly"
        dtypes = (torch.float16,)

    monkeypatch.setitem(registry.REGISTRY, "halfonly", "tests_fake:HalfOnly")
    monkeypatch.setitem(sys.modules, "tests_fake", type(sys)("tests_fake"))
    sys.modules["tests_fake"].HalfOnly = HalfOnly
    kernels(device="cpu")
    listing = capsys.readouterr().out
    assert listing.startswith("kernels on cpu (float32):\n")
    assert "  halfonly   unavailable: supports float16, not float32\n" in listing
    assert "  torch      ok\n" in listing
    kernels(device="cpu", dtype="float16")
    assert "  halfonly   ok\n" in capsys.readouterr().out
    with pytest.raises(ValueError, match="dtype must be float16, bfloat16 or float32, not 'fp8'"):
        kernels(device="cpu", dtype="fp8")


def test_a_checkpoint_without_a_tokenizer_fails_before_any_work(tiny_llama_checkpoint, tmp_path):
    (tiny_llama_checkpoint / "tokenizer.json").unlink()
    expected = "has no tokenizer.json or tokenizer.model: copy the tokenizer files of the model into it"
    with pytest.raises(FileNotFoundError, match=expected):
        load_model(tiny_llama_checkpoint, device="cpu")
    with pytest.raises(FileNotFoundError, match=expected):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", group_size=32, device="cpu")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("name, content, message", [
    ("model_config.yaml", "name: [tiny\n", r"model_config.yaml is not a valid litgpt model config \(ParserError"),
    ("model_config.yaml", "- a list\n", "model_config.yaml is not a valid litgpt model config"),
    ("model_config.yaml", "bogus_field: 1\n", "unexpected keyword argument 'bogus_field'"),
    ("tokenizer.json", '{"version": ', "tokenizer.json is corrupt: Expecting value"),
    ("tokenizer_config.json", "{bad", "tokenizer_config.json is corrupt: Expecting property name"),
])
def test_an_unreadable_config_or_tokenizer_is_named_before_any_work(tiny_llama_checkpoint, tmp_path, name, content,
                                                                     message):
    (tiny_llama_checkpoint / name).write_text(content)
    with pytest.raises(CheckpointError, match=message):
        load_model(tiny_llama_checkpoint, device="cpu")
    with pytest.raises(CheckpointError, match=message):  # RTN quantized everything before it read the tokenizer
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", group_size=32, device="cpu")
    assert not (tmp_path / "q").exists()


def test_an_out_dir_that_cannot_be_written_is_refused_before_any_work(tiny_llama_checkpoint, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    with pytest.raises(FileExistsError, match="cannot create .*afile/q: .*afile is a file, not a directory"):
        quantize(tiny_llama_checkpoint, tmp_path / "afile" / "q", method="rtn", group_size=32, device="cpu")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path and real_access(path, mode))
    with pytest.raises(PermissionError, match=f"cannot write .*new/q: {tmp_path} is not writable"):
        quantize(tiny_llama_checkpoint, tmp_path / "new" / "q", method="rtn", group_size=32, device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", tiny_llama_checkpoint.name]


def test_quantize_names_its_default_out_dir_after_the_checkpoint(tiny_llama_checkpoint, monkeypatch):
    """`litquant quantize .` inside a checkpoint writes beside it, not into it as "-rtn-4bit-g32"."""
    monkeypatch.chdir(tiny_llama_checkpoint)
    out = quantize(Path("."), method="rtn", group_size=32, device="cpu")
    assert out == tiny_llama_checkpoint.parent / f"{tiny_llama_checkpoint.name}-rtn-4bit-g32"
    with pytest.raises(ValueError, match="is already quantized: quantize the full-precision checkpoint it came from"):
        quantize(out, method="rtn", group_size=32, device="cpu")


def test_a_swap_over_an_earlier_result_finishes_before_ctrl_c_lands(tiny_llama_checkpoint, tmp_path, monkeypatch):
    """--overwrite moves the earlier result away, the new one in and deletes the earlier one: a Ctrl-C in between
    used to leave no checkpoint at out_dir (the earlier one hidden beside it). It now lands after the swap."""
    import litquant.checkpoint as ckpt

    out = quantize(tiny_llama_checkpoint, tmp_path / "q", method="rtn", bits=4, group_size=32, device="cpu")
    real_rmtree = shutil.rmtree

    def ctrl_c_then_rmtree(path, *args, **kwargs):  # the signal arrives while the earlier result is being deleted
        os.kill(os.getpid(), signal.SIGINT)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(ckpt.shutil, "rmtree", ctrl_c_then_rmtree)
    with pytest.raises(KeyboardInterrupt):
        quantize(tiny_llama_checkpoint, out, method="rtn", bits=8, group_size=32, device="cpu", overwrite=True)
    assert QuantizeConfig.load(out).bits == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([tiny_llama_checkpoint.name, "q"])


def test_ctrl_c_ends_the_cli_in_one_line(monkeypatch, capsys):
    from litquant.__main__ import COMMANDS, main

    def kernels() -> None:
        raise KeyboardInterrupt

    monkeypatch.setitem(COMMANDS, "kernels", kernels)
    monkeypatch.setattr(sys, "argv", ["litquant", "kernels"])
    with pytest.raises(SystemExit) as exit:
        main()
    assert exit.value.code == 130 and capsys.readouterr().err == "\nlitquant: interrupted\n"


def test_lengths_past_the_models_context_are_refused_by_name(tiny_llama_checkpoint, tmp_path):
    """The tiny model's context is 128 tokens: litgpt's own message named neither option, and came later."""
    with pytest.raises(ValueError, match="seq_len 4096 is longer than the model's context, 128 tokens"):
        quantize(tiny_llama_checkpoint, tmp_path / "q", method="gptq", seq_len=4096, device="cpu")
    with pytest.raises(ValueError, match="window 4096 is longer than the model's context, 128 tokens"):
        perplexity(tiny_llama_checkpoint, text_file=tmp_path / "not read", window=4096, device="cpu")
    with pytest.raises(ValueError, match="tokens and max_new_tokens 1000 do not fit the model's context, 128 tokens"):
        generate(tiny_llama_checkpoint, max_new_tokens=1000, device="cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == [tiny_llama_checkpoint.name]


@pytest.mark.parametrize("options, message", [
    (dict(method="rtn", ignore_modules=["lm_hed"]), "ignore_modules entry 'lm_hed' names no Linear of this model (a "
     "name or a prefix up to a dot); its Linears: lm_head, transformer.h.0.attn.qkv, transformer.h.0.attn.proj, "
     "transformer.h.0.mlp.fc_1, transformer.h.0.mlp.fc_2, transformer.h.0.mlp.proj, and so on in each block"),
    (dict(method="awq", checkpoint_format="gptq_v2"), "checkpoint_format 'gptq_v2' is a GPTQ format; AWQ's layout"),
    (dict(method="gptq", version="gemv"), "version 'gemv' is an AWQ layout; gptq writes a GPTQ checkpoint_format"),
])
def test_options_that_would_be_ignored_are_refused(tiny_llama_checkpoint, tmp_path, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        quantize(tiny_llama_checkpoint, tmp_path / "q", group_size=32, device="cpu", **options)
    assert not (tmp_path / "q").exists()
