"""Shard sets, built: the room between the core (io, data) and the stages (docs/architecture.md).

- :mod:`~facepipe.shardset.builder`: :class:`SetBuilder` (outcomes -> shards and metadata), the
  :class:`Generation` a build grows, and the shard-file moves of a generation (link, rename).
- :mod:`~facepipe.shardset.build`: :func:`build_set`, the temporary folder -> builder -> reports ->
  rename skeleton that prepare, both imports and compact call.
- :mod:`~facepipe.shardset.update`: ``prepare --update``'s plan (which files to reuse) and the
  ``sources.jsonl`` reader.

Only this room and :mod:`facepipe.io` name, link or rename shard files; stages produce outcome
streams and call :func:`build_set`.
"""

from facepipe.shardset.build import Built, build_set
from facepipe.shardset.builder import SHARD_SET, Generation, SetBuilder, manifest_params, reasons_text, warn_resized

__all__ = ["SHARD_SET", "Built", "Generation", "SetBuilder", "build_set", "manifest_params", "reasons_text", "warn_resized"]
