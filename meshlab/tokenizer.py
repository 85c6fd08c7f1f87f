"""The byte tokenizer: what the embedded stdlib corpus is tokenized with, and what training's sample
text and serving a byte-token run decode with (a corpus prepared with a Hugging Face tokenizer.json
is read by meshlab/infer/loading.py instead)."""
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
