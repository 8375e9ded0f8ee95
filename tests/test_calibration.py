"""Calibration tokens from text files, from a litgpt DataModule and from the model itself."""
import json
import logging

import pytest
import torch
from litgpt.data import JSON
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer

from conftest import tiny_config, write_tiny_tokenizer
from litquant.quantize.calibration import OPENINGS, calibration_tokens

TEXT = "".join(f"Entry {i}: a hacker is a person who enjoys exploring the details of systems.\n" for i in range(40))


@pytest.fixture
def tokenizer(tmp_path) -> Tokenizer:
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    write_tiny_tokenizer(directory)
    return Tokenizer(directory)


def contains(stream: torch.Tensor, window: torch.Tensor) -> bool:
    return any(torch.equal(stream[i:i + window.numel()], window) for i in range(stream.numel() - window.numel() + 1))


def test_text_file_windows_are_seeded_slices_of_the_text(tokenizer, tmp_path):
    file = tmp_path / "calibration.txt"
    file.write_text(TEXT)
    tokens = calibration_tokens(tokenizer, calibration_file=file, num_samples=6, seq_len=64, seed=1)
    assert tokens.shape == (6, 64) and tokens.dtype == torch.long
    assert torch.equal(tokens, calibration_tokens(tokenizer, calibration_file=file, num_samples=6, seq_len=64, seed=1))
    assert not torch.equal(tokens, calibration_tokens(tokenizer, calibration_file=file, num_samples=6, seq_len=64,
                                                      seed=2))
    stream = tokenizer.encode(TEXT, eos=True).long()
    assert stream[0] == tokenizer.bos_id
    # non-overlapping windows of the stream, in a shuffled order
    starts = [next(i for i in range(0, stream.numel(), 64) if torch.equal(stream[i:i + 64], row)) for row in tokens]
    assert len(set(starts)) == 6 and starts != sorted(starts)


def test_jsonl_json_and_directories(tokenizer, tmp_path):
    records = [{"text": TEXT[:1500]}, {"instruction": "Define hacker.", "input": "", "output": TEXT[:1200]},
               {"instruction": "Translate.", "input": "kludge", "output": TEXT[1200:2500]}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "b.json").write_text(json.dumps(records[1:]))
    (tmp_path / "c.txt").write_text(TEXT)
    (tmp_path / "ignored.md").write_text("not calibration text")
    texts = [TEXT[:1500], "Define hacker.\n" + TEXT[:1200], "Translate.\nkludge\n" + TEXT[1200:2500]]
    tokens = calibration_tokens(tokenizer, calibration_file=tmp_path / "a.jsonl", num_samples=1000, seq_len=32)
    stream = torch.cat([tokenizer.encode(text, eos=True).long() for text in texts])
    assert tokens.shape == (stream.numel() // 32, 32)
    assert all(contains(stream, row) for row in tokens)
    # a directory: its .txt/.jsonl/.json files in name order (a.jsonl, b.json, c.txt)
    from_directory = calibration_tokens(tokenizer, calibration_file=tmp_path, num_samples=1000, seq_len=32)
    length = sum(len(tokenizer.encode(text, eos=True)) for text in texts + texts[1:] + [TEXT])
    assert from_directory.shape == (length // 32, 32)


def test_a_short_text_gives_fewer_samples_with_a_warning(tokenizer, tmp_path, caplog):
    file = tmp_path / "short.txt"
    file.write_text(TEXT[:300])
    count = len(tokenizer.encode(TEXT[:300], eos=True))
    assert 300 <= count < 400
    with caplog.at_level(logging.WARNING, logger="litquant.quantize"):
        tokens = calibration_tokens(tokenizer, calibration_file=file, num_samples=10, seq_len=100)
    assert tokens.shape == (3, 100)
    assert f"has {count} tokens: 3 sequences of 100 tokens, not the 10 asked for; calibrating on 3" in caplog.text
    with pytest.raises(ValueError, match=f"has {count} tokens, fewer than one calibration sequence of seq_len=512"):
        calibration_tokens(tokenizer, calibration_file=file, num_samples=10, seq_len=512)


@pytest.mark.parametrize("name, content, error, message", [
    ("empty.txt", " \n\n", ValueError, "empty.txt is empty: it has no text to calibrate on"),
    ("empty.jsonl", "", ValueError, "empty.jsonl is empty"),
    ("bad.jsonl", '{"text": "ok"}\n{"text": \n', ValueError, r"bad.jsonl:2 is not valid JSON"),
    ("fields.jsonl", '{"prompt": "x", "answer": "y"}\n', ValueError,
     r"fields.jsonl:1: expected a record with a \"text\" field or alpaca-style.*found \['answer', 'prompt'\]"),
    ("dict.json", '{"text": "x"}', ValueError, "expected a JSON list of records, got dict"),
    ("data.csv", "text\nx\n", ValueError, r"expected a .txt/.jsonl/.json file"),
])
def test_bad_calibration_files(tokenizer, tmp_path, name, content, error, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(error, match=message):
        calibration_tokens(tokenizer, calibration_file=tmp_path / name, num_samples=2, seq_len=8)


def test_a_binary_file_is_refused_as_text(tokenizer, tmp_path):
    """Calibration and perplexity refuse bytes that are not UTF-8 (perplexity used to score them as replacement
    characters), and name the file."""
    from litquant.perplexity import read_text

    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(bytes(range(128, 256)) * 8)
    with pytest.raises(ValueError, match=f"calibration file {garbage} is not UTF-8 text \\(byte 0: invalid start byte"):
        calibration_tokens(tokenizer, calibration_file=garbage, num_samples=2, seq_len=8)
    with pytest.raises(ValueError, match=f"text file {garbage} is not UTF-8 text"):
        read_text(garbage)
    fake = tmp_path / "fake.gz"
    fake.write_text("not gzip")
    with pytest.raises(ValueError, match=f"text file {fake} is not a valid .gz file"):
        read_text(fake)


def test_missing_sources(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="calibration file .*nowhere.txt does not exist"):
        calibration_tokens(tokenizer, calibration_file=tmp_path / "nowhere.txt")
    (tmp_path / "docs").mkdir()
    with pytest.raises(ValueError, match="calibration directory .*docs has no .txt/.jsonl/.json files"):
        calibration_tokens(tokenizer, calibration_file=tmp_path / "docs")
    with pytest.raises(ValueError, match="no calibration source: pass `calibration_file`, `data`, or the `model`"):
        calibration_tokens(tokenizer)
    with pytest.raises(ValueError, match="pass either `data` or `calibration_file`"):
        calibration_tokens(tokenizer, data=object(), calibration_file=tmp_path / "docs")
    with pytest.raises(ValueError, match="need num_samples >= 1 and seq_len >= 2"):
        calibration_tokens(tokenizer, calibration_file=tmp_path / "docs", num_samples=0)


def test_a_long_text_file_is_tokenized_in_seeded_pieces(tokenizer, tmp_path, monkeypatch, caplog):
    from litquant.quantize import calibration

    lines = [f"Line {i}: the hacker's {'jargon ' * (i % 7)}entry.\n" for i in range(4000)]
    (tmp_path / "long.txt").write_text("".join(lines))
    tokenized = []
    tokenize = calibration.tokenize_documents
    monkeypatch.setattr(calibration, "tokenize_documents",
                        lambda tok, docs: tokenized.append(docs) or tokenize(tok, docs))
    whole = calibration_tokens(tokenizer, calibration_file=tmp_path / "long.txt", num_samples=32, seq_len=128)
    assert tokenized[-1] == ["".join(lines)]  # under FULL_TEXT_CHARS: all of it, as before

    monkeypatch.setattr(calibration, "FULL_TEXT_CHARS", 10_000)
    with caplog.at_level(logging.INFO, logger="litquant.quantize"):
        tokens = calibration_tokens(tokenizer, calibration_file=tmp_path / "long.txt", num_samples=32,
                                    seq_len=128)
    assert "tokenizing" in caplog.text and "random pieces" in caplog.text
    pieces = tokenized[-1]
    assert 1 < len(pieces) and sum(map(len, pieces)) < len("".join(lines)) / 4
    assert all(piece.endswith("\n") and piece in "".join(lines) for piece in pieces)  # cut at line ends
    assert tokens.shape == whole.shape == (32, 128) and not torch.equal(tokens, whole)
    assert torch.equal(tokens, calibration_tokens(tokenizer, calibration_file=tmp_path / "long.txt", num_samples=32,
                                                  seq_len=128))
    assert tokenized[-1] != calibration.pieces_to_tokenize(tokenizer, ["".join(lines)], 32 * 128, seed=7)


def test_litgpt_datamodule(tokenizer, tmp_path):
    records = [{"instruction": f"Define entry {i}.", "input": "", "output": TEXT[i * 80:(i + 1) * 80]}
               for i in range(30)]
    (tmp_path / "alpaca.json").write_text(json.dumps(records))
    make = lambda: JSON(tmp_path / "alpaca.json", val_split_fraction=0.2, num_workers=0)  # noqa: E731
    tokens = calibration_tokens(tokenizer, data=make(), num_samples=8, seq_len=512)
    assert tokens.shape == (8, 512)
    assert torch.equal(tokens, calibration_tokens(tokenizer, data=make(), num_samples=8, seq_len=512))
    # the records in litgpt's alpaca prompt template
    for words in ("### Instruction:", "Define entry", "a hacker is a person"):
        assert contains(tokens.flatten(), tokenizer.encode(words, bos=False).long())


def test_a_failed_download_says_what_to_do_and_leaves_no_empty_folder(tokenizer, tmp_path, monkeypatch):
    import litgpt.data.alpaca
    from litgpt.data import Alpaca

    def offline(path, url, *args, **kwargs):
        raise ConnectionError(f"Failed to resolve host of {url}")

    monkeypatch.setattr(litgpt.data.alpaca, "download_if_missing", offline)
    (tmp_path / "kept").mkdir()
    for download_dir in (tmp_path / "data" / "alpaca", tmp_path / "kept"):
        with pytest.raises(OSError, match="could not download Alpaca's data: Failed to resolve .*--calibration_file"):
            calibration_tokens(tokenizer, data=Alpaca(download_dir=download_dir), num_samples=1, seq_len=8)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept", "tokenizer"]  # data/alpaca was made, then removed


def test_self_generated_calibration(tokenizer):
    torch.manual_seed(0)
    model = GPT(tiny_config("llama"))
    model.apply(model._init_weights)
    tokens = calibration_tokens(tokenizer, model=model, num_samples=5, seq_len=24, seed=3, batch_size=2)
    assert tokens.shape == (5, 24) and tokens.dtype == torch.long
    for row, opening in zip(tokens, OPENINGS):
        expected = tokenizer.encode(opening, bos=True).long()
        assert torch.equal(row[:expected.numel()], expected)  # BOS, then the opening
    assert (tokens[:, 1:] != tokenizer.eos_id).all() and (tokens < model.config.vocab_size).all()
    assert torch.equal(tokens, calibration_tokens(tokenizer, model=model, num_samples=5, seq_len=24, seed=3,
                                                  batch_size=2))
    assert not torch.equal(tokens, calibration_tokens(tokenizer, model=model, num_samples=5, seq_len=24, seed=4))
    assert model.mask_cache is None and next(model.parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="seq_len=256 is longer than the model's block size 128"):
        calibration_tokens(tokenizer, model=model, num_samples=1, seq_len=256)
