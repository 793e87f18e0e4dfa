"""The prep step's records, as its writer (data_prep/pack.py) and its reader (trainer/train/data.py) share them.

A record is little-endian int32 ids (`np.frombuffer(record, "<i4")`), one or more fields of
`seq_len` each, named in the dataset manifest's `stats.record_format`:
- concat: tokens. Documents are concatenated (each ends with EOS) and cut every seq_len tokens;
  only a shard's last record is padded with PAD.
- documents: tokens, segment_ids, positions. segment_ids number the document pieces of the row 1,
  2, 3... (0 on padding); positions count from 0 inside each piece and restart at every document
  start and at the start of every row (0 on padding).
Shards are ArrayRecord files `{split}-{index:05d}-of-{count:05d}.array_record`, split train or val.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from configs import UserError

PAD = -1
DTYPE = "<i4"
FIELDS = {"concat": ("tokens",), "documents": ("tokens", "segment_ids", "positions")}


@dataclass(frozen=True)
class RecordFormat:
    """How one record is laid out: its packing, and its sequence length (0 when a manifest does not say)."""

    packing: str = "concat"
    seq_len: int = 0

    @property
    def fields(self) -> tuple[str, ...]:
        return FIELDS[self.packing]

    def describe(self) -> dict[str, Any]:
        """The manifest's `record_format`."""
        return {"dtype": "int32le", "pad": PAD, "packing": self.packing, "fields": list(self.fields),
                "seq_len": self.seq_len}


def parse_format(described: dict[str, Any], where: str) -> RecordFormat:
    """A manifest's `record_format` back as a RecordFormat; one error line naming `where` if we cannot read it."""
    if described.get("dtype", "int32le") != "int32le" or described.get("pad", PAD) != PAD:
        raise UserError(f"{where}: unsupported record_format {described} (expected int32le with pad {PAD})")
    if "fields" not in described:  # datasets written before packing modes existed
        return RecordFormat(seq_len=int(described.get("seq_len", 0)))
    packing = described.get("packing", "concat")
    if packing not in FIELDS or tuple(described["fields"]) != FIELDS[packing]:
        raise UserError(f"{where}: unsupported record_format packing {packing!r} with fields {described['fields']}")
    return RecordFormat(packing, int(described.get("seq_len", 0)))


def shard_name(split: str, index: int, count: int) -> str:
    """`train-00000-of-00004.array_record`."""
    return f"{split}-{index:05d}-of-{count:05d}.array_record"


def shard_glob(split: str) -> str:
    """The pattern matching every shard of a split."""
    return f"{split}-*.array_record"
