"""The byte tokenizer: what the embedded stdlib corpus is tokenized with, and what training's sample
text and serving decode a byte-token run with; and a Hugging Face tokenizer.json's encode/decode, for
a run on a corpus prepared with one (serving's HFTokenizer, meshlab/infer/loading.py, builds on it)."""
from __future__ import annotations

EOD = 256          # end of document


class ByteTokenizer:
    """Bytes 0..255 plus an end-of-document token; the model pads the vocab to a multiple of 128."""
    vocab_size = 257
    eod_id = EOD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The bytes' text; ids past 255 (the end-of-document token) have none, skipped or not."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class TokenizerJson:
    """A Hugging Face tokenizer.json's encode and decode through the `tokenizers` library."""

    def __init__(self, path):
        from tokenizers import Tokenizer
        self.tk = Tokenizer.from_file(str(path))
        self.vocab_size = self.tk.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)
