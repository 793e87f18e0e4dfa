"""Prep step: tokenize text with Beam and pack it into int32 ArrayRecord shards (see prep.prepare)."""

from data_prep.pack import read_shard
from data_prep.prep import fingerprint, prepare, resolve_inputs
from data_prep.tokenizer import Encoder, TokenizerInfo

__all__ = ["Encoder", "TokenizerInfo", "fingerprint", "prepare", "read_shard", "resolve_inputs"]
