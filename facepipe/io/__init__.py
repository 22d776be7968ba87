"""File formats: shard files and their set, records, metadata, packs (docs/architecture.md, "Rooms").

With :mod:`facepipe.shardset` (which builds sets), the only code that names, links or renames shard
files (docs/architecture.md, "A prepared shard set")."""

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
