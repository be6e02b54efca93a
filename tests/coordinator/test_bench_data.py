"""The benchmark's text and image inputs."""

from __future__ import annotations

from pathlib import Path

from coordinator.bench_data import CHAR_SEQ_LEN, text_data
from model_zoo.data import SHAKESPEARE_VOCAB


def test_text_data_makes_next_character_windows_from_licence_texts(tmp_path: Path):
    # Prepare: one file of 1000 characters, one of them outside the vocabulary.
    letters = "the quick brown fox jumps over the lazy dog. "
    text = (letters * 30)[:999] + "~"
    (tmp_path / "LICENSE").write_text(text)
    ids = [SHAKESPEARE_VOCAB.index(c) for c in text if c in SHAKESPEARE_VOCAB]  # drops "~"

    # Execute
    data = text_data(50, seed=0, license_dir=tmp_path)

    # Assert: every sample is 80 consecutive characters and the label the one after them;
    # training windows come from the first 85% of the text, test windows from the rest.
    assert data is not None and data.name == "licence texts"
    cut = int(len(ids) * 0.85)
    for x, y, part in (
        (data.x_train, data.y_train, ids[:cut]),
        (data.x_test, data.y_test, ids[cut:]),
    ):
        assert x.shape[1:] == (CHAR_SEQ_LEN,) and len(x) == len(y) > 0
        for window, label in zip(x.tolist(), y.tolist(), strict=True):
            starts = [
                s for s in range(len(part) - CHAR_SEQ_LEN) if part[s : s + CHAR_SEQ_LEN] == window
            ]
            assert any(part[s + CHAR_SEQ_LEN] == label for s in starts)
    assert len(data.x_train) == 50 and data.classes == list(SHAKESPEARE_VOCAB)
    assert text_data(50, license_dir=tmp_path / "nowhere") is None
