"""The dataset's tokenizer, as prep wrote it: HF `tokenizer.json` or SentencePiece `tokenizer.model`.

`special_tokens.json` beside it names the kind, vocab size and special ids:
{"kind": "hf"|"sentencepiece", "vocab_size", "eos_id", "eos_token", "bos_id" (or null), "bos_token"}.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from configs import UserError

SPECIAL_TOKENS = "special_tokens.json"
FILES = {"hf": "tokenizer.json", "sentencepiece": "tokenizer.model"}


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` or `sentencepiece.SentencePieceProcessor`."""

    def __init__(self, kind: str, backend: Any, vocab_size: int, eos_id: int, bos_id: int | None) -> None:
        self.kind = kind
        self.backend = backend
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.bos_id = bos_id

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added (the caller decides on BOS)."""
        if self.kind == "hf":
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.backend.encode(text))

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; special tokens and ids outside the vocabulary (a padded model vocab) are dropped."""
        ids = [int(i) for i in ids if 0 <= i < self.vocab_size and i not in (self.eos_id, self.bos_id)]
        if self.kind == "hf":
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.backend.decode(ids)


def load_tokenizer(tokenizer_dir: str | Path) -> Tokenizer:
    """Load the tokenizer prep wrote to `tokenizer_dir`; UserError if it is missing or unreadable."""
    directory = Path(tokenizer_dir)
    meta_path = directory / SPECIAL_TOKENS
    if not meta_path.is_file():
        raise UserError(f"no tokenizer at {directory} (missing {SPECIAL_TOKENS})")
    try:
        meta = json.loads(meta_path.read_text())
        kind, eos_id, bos_id = meta["kind"], int(meta["eos_id"]), meta.get("bos_id")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"unreadable {meta_path}: {err}") from None
    if kind not in FILES:
        raise UserError(f"{meta_path}: unknown tokenizer kind {kind!r} (expected one of {sorted(FILES)})")
    path = directory / FILES[kind]
    if not path.is_file():
        raise UserError(f"no {FILES[kind]} in {directory}")
    try:
        if kind == "hf":
            import tokenizers

            backend = tokenizers.Tokenizer.from_file(str(path))
            backend_vocab = backend.get_vocab_size(with_added_tokens=True)
        else:
            import sentencepiece as spm

            backend = spm.SentencePieceProcessor(model_file=str(path))
            backend_vocab = backend.get_piece_size()
    except Exception as err:  # both libraries raise their own untyped errors on a bad file
        raise UserError(f"unreadable tokenizer {path}: {err}") from None
    vocab_size = int(meta.get("vocab_size") or backend_vocab)
    if not 0 <= eos_id < vocab_size:
        raise UserError(f"{meta_path}: eos_id {eos_id} is outside the vocabulary of {vocab_size}")
    return Tokenizer(kind, backend, vocab_size, eos_id, None if bos_id is None else int(bos_id))
