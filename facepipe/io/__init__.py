"""Shard-set I/O: the only code that touches shard files (DESIGN.md, "A prepared shard set")."""

from facepipe.io.records import Record, decode_record, encode_record
from facepipe.io.shards import ShardReader, ShardSet, ShardWriter, ShardSetError

__all__ = [
    "Record",
    "ShardReader",
    "ShardSet",
    "ShardSetError",
    "ShardWriter",
    "decode_record",
    "encode_record",
]
