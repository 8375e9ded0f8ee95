"""litquant's tokenizer streams whole characters, and the whole answer's text, where litgpt's decodes each token
alone."""
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from conftest import write_tiny_tokenizer
from litquant.load import load_tokenizer
from litquant.tokenizer import Tokenizer

TEXT = "Café 😀 naïve, “quoted” 日本語 ok"


def byte_level_tokenizer(directory: Path) -> Tokenizer:
    """One token a UTF-8 byte (GPT-2's byte alphabet, no merges): every character past ASCII spans tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    processor = HFTokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    processor.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    processor.decoder = decoders.ByteLevel()
    directory.mkdir()
    processor.save(str(directory / "tokenizer.json"))
    return Tokenizer(directory)


def streamed(tokenizer: Tokenizer, ids: torch.Tensor) -> list:
    return list(tokenizer.decode_stream(token.view(1) for token in ids))


def test_characters_split_over_tokens_stream_whole(tmp_path):
    tokenizer = byte_level_tokenizer(tmp_path / "bytes")
    ids = tokenizer.encode(TEXT, bos=False, eos=False)
    assert len(ids) == len(TEXT.encode("utf-8"))
    pieces = streamed(tokenizer, ids)
    assert len(pieces) == len(ids)  # one string a token ("" while a character is incomplete): litgpt's chat counts
    assert "".join(pieces) == TEXT and "\ufffd" not in "".join(pieces)
    assert pieces[TEXT.encode("utf-8").index("😀".encode("utf-8")):][:4] == ["", "", "", "😀"]
    # litgpt's own stream, for contrast: each byte of the emoji alone
    assert "\ufffd" in "".join(super(Tokenizer, tokenizer).decode_stream(token.view(1) for token in ids))


def test_a_stream_that_ends_inside_a_character_still_gives_its_bytes(tmp_path):
    tokenizer = byte_level_tokenizer(tmp_path / "bytes")
    ids = tokenizer.encode("ok 😀", bos=False, eos=False)[:-2]
    assert "".join(streamed(tokenizer, ids)) == "ok \ufffd"


def test_a_tokenizer_that_drops_a_lone_tokens_space_streams_its_spaces(tmp_path):
    """The tiny test tokenizer's decoder puts a space between tokens, which litgpt's stream drops: the text streamed
    is the whole answer's."""
    write_tiny_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert isinstance(tokenizer, Tokenizer)
    ids = tokenizer.encode("hello there", bos=False, eos=False)
    assert "".join(streamed(tokenizer, ids)) == tokenizer.decode(ids) != "".join(tokenizer.decode(i) for i in ids)
