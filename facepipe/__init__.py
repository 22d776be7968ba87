"""facepipe: folders of raw face photos into a trained face recognizer, reproducibly and at scale."""

from facepipe import offline as _offline

_offline.apply()

__version__ = "0.1.0"
