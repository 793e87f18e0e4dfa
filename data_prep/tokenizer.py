"""Tokenizers: load a given one (HF tokenizer.json or model dir, SentencePiece .model) or train a byte-level BPE.

Whatever the source, prep writes it in canonical form into the dataset's `tokenizer/` folder:
`tokenizer.json` (HF) or `tokenizer.model` (SentencePiece) plus `special_tokens.json`, which is what
the Beam workers, generation and HF export load.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from configs import UserError

EOS = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # a byte-level BPE holds all 256 bytes and EOS
SPECIAL_TOKENS = "special_tokens.json"
HF_FILE, SP_FILE = "tokenizer.json", "tokenizer.model"
# Guessed only when no tokenizer_config.json / special_tokens_map.json names them.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")


@dataclass(frozen=True)
class TokenizerInfo:
    """What `special_tokens.json` holds. `bos_id` is set only if every document starts with BOS;
    `prepend_bos` says the tokenizer's own encode() does not add it (so prep, and a prompt, must)."""

    kind: str  # "hf" | "sentencepiece"
    vocab_size: int  # highest id + 1
    eos_id: int
    eos_token: str
    bos_id: int | None
    bos_token: str | None
    prepend_bos: bool
    append_eos: bool  # false when the tokenizer's post-processor already ends each encoding with EOS


def train_bpe(texts: Iterable[str], vocab_size: int) -> "tokenizers.Tokenizer":  # noqa: F821
    """Train a GPT-2 style byte-level BPE with `<|endoftext|>` (id 0) as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def install(source: str | Path, out_dir: Path, vocab_size: int) -> TokenizerInfo:
    """Copy the tokenizer at `source` into `out_dir` in canonical form; check it fits the model's vocab."""
    path = Path(source).expanduser()
    if not path.exists():
        raise UserError(f"tokenizer {source} does not exist")
    if path.is_dir():
        for name in (HF_FILE, SP_FILE):
            if (path / name).is_file():
                path = path / name
                break
        else:
            raise UserError(f"tokenizer folder {source} holds neither {HF_FILE} nor {SP_FILE}")
    out_dir.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".model":
        shutil.copyfile(path, out_dir / SP_FILE)
        info = _sentencepiece_info(out_dir / SP_FILE, source)
    else:
        shutil.copyfile(path, out_dir / HF_FILE)
        info = _hf_info(out_dir / HF_FILE, _hf_config(path.parent), source)
    return _finish(info, out_dir, vocab_size, source)


def install_trained(tok: "tokenizers.Tokenizer", out_dir: Path, vocab_size: int) -> TokenizerInfo:  # noqa: F821
    """Save a freshly trained BPE in canonical form."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / HF_FILE))
    info = _hf_info(out_dir / HF_FILE, {"eos_token": EOS, "bos_token": None}, "trained BPE")
    return _finish(info, out_dir, vocab_size, "trained BPE")


def _finish(info: TokenizerInfo, out_dir: Path, vocab_size: int, source: str | Path) -> TokenizerInfo:
    if info.vocab_size > vocab_size:
        raise UserError(
            f"the tokenizer ({source}) has {info.vocab_size} tokens, more than model.vocab_size ({vocab_size})"
        )
    (out_dir / SPECIAL_TOKENS).write_text(json.dumps(asdict(info), indent=2) + "\n")
    return info


def _token_name(value: object) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_config(folder: Path) -> dict:
    """eos_token / bos_token / add_bos_token from a HF model folder's config files (empty if it has none)."""
    found: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        file = folder / name
        if file.is_file():
            try:
                data = json.loads(file.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"cannot read {file}: {e}") from None
            for key in ("eos_token", "bos_token", "add_bos_token"):
                if key in data:
                    found[key] = data[key]
    return found


def _hf_info(file: Path, config: dict, source: str | Path) -> TokenizerInfo:
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust loader raises a bare Exception
        raise UserError(f"cannot load tokenizer {source}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    eos = _token_name(config.get("eos_token")) or next((t for t in _EOS_NAMES if t in specials), None)
    if eos is None or eos not in vocab:
        raise UserError(
            f"cannot tell the end-of-text token of tokenizer {source}: put a tokenizer_config.json with eos_token beside it"
        )
    if "bos_token" in config:
        bos = _token_name(config["bos_token"])
    else:
        bos = next((t for t in _BOS_NAMES if t in specials), None)
    if bos is not None and (bos not in vocab or bos == eos or config.get("add_bos_token") is False):
        bos = None  # documents do not start with BOS (e.g. GPT-2: bos == eos, add_bos_token false)
    # Does the tokenizer's own post-processor already add BOS / EOS? Then we must not add them again.
    plain, full = tok.encode("a", add_special_tokens=False).ids, tok.encode("a").ids
    adds_bos = bos is not None and full[:1] == [vocab[bos]] and plain[:1] != [vocab[bos]]
    adds_eos = full[-1:] == [vocab[eos]] and plain[-1:] != [vocab[eos]]
    return TokenizerInfo(
        kind="hf", vocab_size=max(vocab.values()) + 1, eos_id=vocab[eos], eos_token=eos,
        bos_id=vocab[bos] if bos is not None else None, bos_token=bos,
        prepend_bos=bos is not None and not adds_bos, append_eos=not adds_eos,
    )


def _sentencepiece_info(file: Path, source: str | Path) -> TokenizerInfo:
    import sentencepiece as spm

    try:
        sp = spm.SentencePieceProcessor(model_file=str(file))
    except Exception as e:  # OSError or RuntimeError, depending on the damage
        raise UserError(f"cannot load SentencePiece tokenizer {source}: {e}") from None
    if sp.eos_id() < 0:
        raise UserError(f"SentencePiece tokenizer {source} defines no end-of-text (eos) piece")
    bos = sp.bos_id() if sp.bos_id() >= 0 else None
    return TokenizerInfo(
        kind="sentencepiece", vocab_size=sp.get_piece_size(), eos_id=sp.eos_id(), eos_token=sp.id_to_piece(sp.eos_id()),
        bos_id=bos, bos_token=sp.id_to_piece(bos) if bos is not None else None,
        prepend_bos=bos is not None, append_eos=True,
    )


class Encoder:
    """Encodes documents with a canonical tokenizer folder: the tokenizer's own ids, framed by BOS/EOS."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        self.info = TokenizerInfo(**json.loads((folder / SPECIAL_TOKENS).read_text()))
        if self.info.kind == "hf":
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_file(str(folder / HF_FILE))
            self._sp = None
        else:
            import sentencepiece as spm

            self._hf = None
            self._sp = spm.SentencePieceProcessor(model_file=str(folder / SP_FILE))
        # Tokens every document gets regardless of its text (BOS/EOS, post-processor specials).
        self.frame_len = len(self._raw([""])[0]) + self.info.prepend_bos + self.info.append_eos

    def _raw(self, texts: list[str]) -> list[list[int]]:
        if self._hf is not None:
            # encode_batch_fast (tokenizers >= 0.20) = encode_batch without character offsets, which we do not
            # use: the same ids, about 25% less CPU on the stdlib corpus.
            encode = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
            return [e.ids for e in encode(texts)]
        return self._sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens included as text so document boundaries stay visible."""
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._sp.decode(ids)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """int32 ids per text: [BOS] + tokenizer ids + [EOS], each special only if the tokenizer does not add it."""
        head = [self.info.bos_id] if self.info.prepend_bos else []
        tail = [self.info.eos_id] if self.info.append_eos else []
        return [np.asarray(head + ids + tail, dtype="<i4") for ids in self._raw(texts)]
