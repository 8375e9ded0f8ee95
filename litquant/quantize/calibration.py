"""Calibration tokens for GPTQ and AWQ: from text files, from a litgpt DataModule, or sampled from the model.

Every source ends the same way: one long stream of token ids is cut into non-overlapping windows of
`seq_len` tokens, and `num_samples` of them are picked in an order shuffled with a fixed seed, so the same
inputs always give the same tokens. When the text holds fewer windows than asked for, all of them are
used, with a warning (calibrating on less is better than failing, and repeating windows adds nothing);
when it holds less than one window, it is an error that says how many tokens there were. A text file far longer
than needed (past 8 M characters) is not tokenized whole: a seeded choice of its pieces is (`pieces_to_tokenize`).

Without data, the model writes its own calibration text (data-free, as in LLM-QAT, Liu et al. 2023,
arXiv:2305.17888): `num_samples` sequences sampled at temperature 1 from the full distribution, each
starting from BOS and one of a few varied short openings. Self-generated text follows the model's own
distribution, which is what the quantized model will see when it generates.
"""
import json
import logging
from pathlib import Path
from typing import List, Optional, Union

import torch
from litgpt.data import DataModule
from litgpt.model import GPT
from litgpt.tokenizer import Tokenizer
from tqdm.auto import tqdm

from litquant.assets import read_text_file

log = logging.getLogger("litquant.quantize")

TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
FULL_TEXT_CHARS = 8_000_000  # calibration text up to this size is tokenized whole (10-15 s at most)
# The openings of self-generated samples (cycled), for variety beyond what sampling gives: prose, dialogue,
# instructions, lists and code. The empty one starts from BOS alone.
OPENINGS = ("", "The", "In", "I", "Once upon a time", "Question:", "def", "1.", "We", "It is", "#", "A",
            "Dear", "This", "Here is", "Chapter")


def calibration_tokens(tokenizer: Tokenizer, *, model: Optional[GPT] = None, data: Optional[DataModule] = None,
                       calibration_file: Optional[Path] = None, num_samples: int = 128, seq_len: int = 2048,
                       seed: int = 42, device: Optional[Union[str, torch.device]] = None,
                       batch_size: int = 16) -> torch.Tensor:
    """Calibration token ids [num_samples, seq_len] (int64): from `calibration_file`, else `data`, else the model.

    Args:
        tokenizer: the model's litgpt tokenizer.
        model: the unquantized model, which samples the calibration text when neither `data` nor
            `calibration_file` is given. It generates on `device` and is moved back where it was.
        data: a litgpt DataModule; its training samples are concatenated.
        calibration_file: a .txt file, a .jsonl/.json file of records with a "text" field (or alpaca-style
            "instruction", "input", "output"), or a directory of such files.
        num_samples: number of sequences (fewer, with a warning, if the text is too short).
        seq_len: tokens per sequence.
        seed: seed of the shuffle (and of the sampling).
        device: where the model generates (default: where it is).
        batch_size: sequences generated at once.
    """
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got num_samples={num_samples}, seq_len={seq_len}")
    if data is not None and calibration_file is not None:
        raise ValueError("pass either `data` or `calibration_file` for calibration, not both")
    if calibration_file is not None:
        calibration_file = Path(calibration_file)
        documents = pieces_to_tokenize(tokenizer, read_documents(calibration_file), num_samples * seq_len, seed)
        stream = tokenize_documents(tokenizer, documents)
        return windows(stream, num_samples, seq_len, seed, str(calibration_file))
    if data is not None:
        stream = datamodule_stream(data, tokenizer, seq_len, num_samples * seq_len)
        return windows(stream, num_samples, seq_len, seed, type(data).__name__)
    if model is None:
        raise ValueError("no calibration source: pass `calibration_file`, `data`, or the `model` to sample text from")
    return self_generated_tokens(model, tokenizer, num_samples, seq_len, seed, device, batch_size)


def windows(stream: torch.Tensor, num_samples: int, seq_len: int, seed: int, source: str) -> torch.Tensor:
    """`num_samples` non-overlapping windows of `seq_len` tokens of the 1-D `stream`, in a seeded random order."""
    available = stream.numel() // seq_len
    if available == 0:
        raise ValueError(f"{source} has {stream.numel()} tokens, fewer than one calibration sequence of "
                         f"seq_len={seq_len} tokens; give more text or a smaller seq_len")
    if available < num_samples:
        log.warning(f"{source} has {stream.numel()} tokens: {available} sequences of {seq_len} tokens, not the "
                    f"{num_samples} asked for; calibrating on {available}")
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:num_samples]
    return stream[: available * seq_len].view(available, seq_len)[order].long()


def read_documents(path: Path) -> List[str]:
    """The documents of a calibration file, or of every .txt/.jsonl/.json file of a directory (sorted by name)."""
    documents = [doc for file in calibration_files(path) for doc in _file_documents(file) if doc.strip()]
    if not documents:
        raise ValueError(f"calibration file {path} is empty: it has no text to calibrate on")
    return documents


def calibration_files(path: Path) -> List[Path]:
    """The files that `read_documents` reads for `path`, or the error that says why there are none; cheap, so
    `quantize` calls it before any work."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise ValueError(f"calibration directory {path} has no {'/'.join(TEXT_SUFFIXES)} files")
    elif path.is_file():
        if path.suffix not in TEXT_SUFFIXES:
            raise ValueError(f"calibration file {path}: expected a {'/'.join(TEXT_SUFFIXES)} file")
        files = [path]
    else:
        raise FileNotFoundError(f"calibration file {path} does not exist")
    return files


def _file_documents(file: Path) -> List[str]:
    text = read_text_file(file, "calibration file")
    if file.suffix == ".txt":
        return [text]
    if file.suffix == ".jsonl":
        records = []
        for line_number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((json.loads(line), f"{file}:{line_number}"))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{line_number} is not valid JSON: {e}") from None
    else:
        try:
            loaded = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(loaded, list):
            raise ValueError(f"{file}: expected a JSON list of records, got {type(loaded).__name__}")
        records = [(record, f"{file}[{i}]") for i, record in enumerate(loaded)]
    return [_record_text(record, where) for record, where in records]


def _record_text(record: object, where: str) -> str:
    """The text of a record: its "text" field, or an alpaca-style instruction, input and output, one per line."""
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return record["text"]
    if isinstance(record, dict) and isinstance(record.get("instruction"), str):
        return "\n".join(record[key] for key in ("instruction", "input", "output") if record.get(key))
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where}: expected a record with a \"text\" field or alpaca-style \"instruction\"/\"output\" "
                     f"fields, found {keys}")


def pieces_to_tokenize(tokenizer: Tokenizer, documents: List[str], tokens_needed: int, seed: int) -> List[str]:
    """The documents, whole; or, when they are far longer than the calibration needs, a seeded random choice of
    pieces of them (cut at line ends, in their order in the text) holding about twice the text needed.

    Tokenizing runs at well under a MB a second (SmolLM2's tokenizer: 65 MB in 101 s), so a whole corpus would take
    minutes for the ~1 MB that 128 sequences of 2048 tokens hold. Text up to `FULL_TEXT_CHARS` (or 4x the need) is
    always tokenized whole, so its windows come from anywhere in it, as they always have.
    """
    total = sum(len(doc) for doc in documents)
    if total <= FULL_TEXT_CHARS:
        return documents
    sample = ""
    for doc in documents:  # the first 64 K characters, for the characters a token
        sample += doc[:65536 - len(sample)]
        if len(sample) >= 65536:
            break
    chars_per_token = len(sample) / max(1, tokenizer.encode(sample, bos=False).numel())
    wanted = 2 * tokens_needed * chars_per_token
    if total <= 4 * wanted:
        return documents
    piece_chars = max(4096, int(wanted / 256))  # at least 256 pieces to choose from
    pieces = [piece for doc in documents for piece in cut_at_line_ends(doc, piece_chars)]
    order = torch.randperm(len(pieces), generator=torch.Generator().manual_seed(seed)).tolist()
    chosen, chars = [], 0
    for i in order:
        chosen.append(i)
        chars += len(pieces[i])
        if chars >= wanted:
            break
    log.info(f"calibration text: {total:,} characters; tokenizing {len(chosen)} random pieces of it "
             f"({chars:,} characters, about twice the {tokens_needed:,} tokens needed)")
    return [pieces[i] for i in sorted(chosen)]


def cut_at_line_ends(text: str, size: int) -> List[str]:
    """`text` in consecutive pieces of about `size` characters, each ending at a line end where one is near."""
    pieces, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            line_end = text.rfind("\n", start + size // 2, end)
            end = line_end + 1 if line_end >= 0 else end
        pieces.append(text[start:end])
        start = end
    return pieces


def tokenize_documents(tokenizer: Tokenizer, documents: List[str]) -> torch.Tensor:
    """One stream of token ids: each document as the tokenizer encodes it (BOS as it decides), then EOS."""
    eos = tokenizer.eos_id is not None
    return torch.cat([tokenizer.encode(doc, eos=eos).long() for doc in documents])


def datamodule_stream(data: DataModule, tokenizer: Tokenizer, seq_len: int, max_tokens: int) -> torch.Tensor:
    """The `input_ids` of `data`'s training samples, concatenated, stopping once `max_tokens` are collected."""
    data.connect(tokenizer=tokenizer, batch_size=1, max_seq_length=seq_len)
    prepare_datamodule(data)
    data.setup()
    chunks, total = [], 0
    for batch in data.train_dataloader():  # batch size 1: no padding
        ids = (batch["input_ids"] if isinstance(batch, dict) else batch).reshape(-1).long()
        chunks.append(ids)
        total += ids.numel()
        if total >= max_tokens:
            break
    if not chunks:
        raise ValueError(f"{type(data).__name__} has no training samples to calibrate on")
    return torch.cat(chunks)


def prepare_datamodule(data: DataModule) -> None:
    """`data.prepare_data()` (a download, for most of litgpt's DataModules), leaving no empty download folder behind
    when it fails, and saying what to do instead."""
    download_dir = getattr(data, "download_dir", None)
    created = [] if download_dir is None else [p for p in (Path(download_dir), *Path(download_dir).parents)
                                               if not p.exists()]
    try:
        data.prepare_data()
    except BaseException as e:
        for folder in created:  # deepest first; only the ones this call created, and only while empty
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if isinstance(e, OSError):  # no network, most often (requests' errors are OSErrors)
            raise OSError(f"could not download {type(data).__name__}'s data: {e}; without network, calibrate on a "
                          "local file with --calibration_file") from e
        raise


@torch.no_grad()
def self_generated_tokens(model: GPT, tokenizer: Tokenizer, num_samples: int, seq_len: int, seed: int,
                          device: Optional[Union[str, torch.device]] = None, batch_size: int = 16) -> torch.Tensor:
    """`num_samples` sequences of `seq_len` tokens sampled from `model` (temperature 1, no top-k).

    Each sequence starts with BOS (when the tokenizer has one) and an opening from `OPENINGS`; EOS is
    never sampled, so every sequence is one text of `seq_len` tokens.
    """
    home = next(model.parameters()).device
    device = torch.device(device) if device is not None else home
    if seq_len > model.config.block_size:
        raise ValueError(f"seq_len={seq_len} is longer than the model's block size {model.config.block_size}")
    openings = [_opening(tokenizer, text, seq_len) for text in OPENINGS]
    model.to(device)
    if model.max_seq_length < seq_len:
        model.max_seq_length = seq_len
    generator = torch.Generator(device=device).manual_seed(seed)
    samples = []
    progress = tqdm(total=num_samples * seq_len, desc="self-generating calibration text", unit="tok",
                    dynamic_ncols=True)
    try:
        for first in range(0, num_samples, batch_size):
            rows = min(batch_size, num_samples - first)
            prompts = [openings[(first + r) % len(openings)] for r in range(rows)]
            samples.append(_sample(model, prompts, seq_len, tokenizer.eos_id, generator, device, progress))
    finally:
        progress.close()
        model.clear_kv_cache()
        model.to(home)
    return torch.cat(samples).cpu()


def _opening(tokenizer: Tokenizer, text: str, seq_len: int) -> torch.Tensor:
    ids = tokenizer.encode(text, bos=tokenizer.bos_id is not None).long()
    if ids.numel() == 0:  # no BOS and an empty opening: start from a space
        ids = tokenizer.encode(" ", bos=False).long()
    return ids[: seq_len - 1]


def _sample(model: GPT, prompts: List[torch.Tensor], seq_len: int, eos_id: Optional[int],
            generator: torch.Generator, device: torch.device, progress: tqdm) -> torch.Tensor:
    """One batch of sequences: the prompts are fed token by token, then each next token is sampled.

    Feeding every position one step at a time lets prompts of different lengths share one batch.
    """
    rows = len(prompts)
    tokens = torch.zeros(rows, seq_len, dtype=torch.long, device=device)
    prompt_len = torch.tensor([p.numel() for p in prompts], device=device)
    for r, p in enumerate(prompts):
        tokens[r, : p.numel()] = p.to(device)
    model.set_kv_cache(batch_size=rows, max_seq_length=seq_len, device=device, dtype=next(model.parameters()).dtype)
    for pos in range(seq_len - 1):
        logits = model(tokens[:, pos:pos + 1], input_pos=torch.tensor([pos], device=device),
                       input_pos_maxp1=pos + 1)[:, -1].float()
        logits[:, model.config.vocab_size:] = float("-inf")  # the padding rows of the vocabulary
        if eos_id is not None:
            logits[:, eos_id] = float("-inf")
        sampled = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)[:, 0]
        tokens[:, pos + 1] = torch.where(pos + 1 < prompt_len, tokens[:, pos + 1], sampled)
        progress.update(rows)
    progress.update(rows)
    return tokens
