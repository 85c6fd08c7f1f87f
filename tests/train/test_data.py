"""Batches are a function of (seed, step, row); packed documents get segment ids and positions."""
import numpy as np
import pytest

from meshlab.tokenizer import ByteTokenizer
from meshlab.train.data import GlobalBatches, make_example, TokenWindows


def windows(tmp_path, dtype="uint16", n=5000, vocab=300):
    path = tmp_path / "t.bin"
    np.random.default_rng(0).integers(0, vocab, n).astype(dtype).tofile(path)
    return TokenWindows(path, 16, dtype=dtype)


def test_rows_of_a_process_are_the_rows_of_the_global_batch(tmp_path):
    gb = GlobalBatches(windows(tmp_path), global_batch=8, seed=3)
    full = gb.batch(5)
    half = gb.batch(5, rows=range(4, 8))
    np.testing.assert_array_equal(full["tokens"][4:], half["tokens"])
    again = GlobalBatches(windows(tmp_path), global_batch=8, seed=3).batch(5)
    np.testing.assert_array_equal(full["tokens"], again["tokens"])
    other_seed = GlobalBatches(windows(tmp_path), global_batch=8, seed=4).batch(5)
    assert not np.array_equal(full["tokens"], other_seed["tokens"])
    np.testing.assert_array_equal(full["labels"][:, :-1], full["tokens"][:, 1:])   # next-token labels


def test_iterator_yields_the_same_batches_as_direct_indexing(tmp_path):
    gb = GlobalBatches(windows(tmp_path), global_batch=4, seed=0)
    it = gb.iterator(start_step=7, num_steps=3)
    for step in (7, 8, 9):
        np.testing.assert_array_equal(next(it)["tokens"], gb.batch(step)["tokens"])


def test_uint32_token_files(tmp_path):
    w = windows(tmp_path, dtype="uint32", vocab=100_000)
    assert w[0].max() >= 65536 or w[1].max() >= 65536


def test_an_empty_token_file_is_named(tmp_path):
    (tmp_path / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'val.bin'} is empty: it holds no tokens"):
        TokenWindows(tmp_path / "val.bin", 16)


def test_packed_documents_restart_positions_and_mask_the_boundary():
    eod = 7
    window = np.array([1, 2, eod, 3, 4, 5, eod, 6, 9], np.int32)
    ex = make_example(window, segment_docs=True, eod_id=eod)
    np.testing.assert_array_equal(ex["segment_ids"], [0, 0, 0, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(ex["positions"], [0, 1, 2, 0, 1, 2, 3, 0])
    assert ex["labels"][2] == -1 and ex["labels"][6] == -1     # EOD predicts nothing across documents
    assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"


def test_a_tiny_byte_budget_still_gives_train_and_val_a_document(tmp_path):
    """data.max_bytes below one file: the corpus takes two documents anyway (one was all there was, and it went
    to val, leaving train.bin empty: "need at least one array to concatenate")."""
    from meshlab.train.data import prepare_stdlib
    out = prepare_stdlib(tmp_path / "corpus", max_bytes=300)
    assert (out / "train.bin").stat().st_size > 0 and (out / "val.bin").stat().st_size > 0
