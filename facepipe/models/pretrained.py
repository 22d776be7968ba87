"""``train.init_from``: a backbone's starting weights from a file users already hold.

Three kinds of file, told apart by their keys (nothing is downloaded, only ``weights_only`` loading):

- ``facepipe``: a facepipe model folder, or the ``backbone.pt`` inside one;
- ``facenet-pytorch``: an ``InceptionResnetV1`` state dict as facenet-pytorch publishes them
  (``20180402-114759-vggface2.pt``: ``logits.*`` for 8631 classes; ``20180408-102900-casia-webface.pt``:
  10575; or none). Its pretraining classifier is not the new run's head: it is dropped, and the log
  says so;
- ``arcface_torch``: an insightface ``arcface_torch`` ``backbone.pth`` (iresnet18-100, mbf).

Every backbone key must be in the file with the model's shape, and the file may hold nothing else;
otherwise ``WeightsError`` names the counts and the first keys of each kind of mismatch.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from facepipe.io.shards import sha256_file
from facepipe.models.backbone import Backbone, WeightsError, describe_mismatch, read_state_dict

log = logging.getLogger("facepipe.models")

#: The file name of a facepipe model folder's weights and its spec (``facepipe.io.model_dir``).
FACEPIPE_WEIGHTS = "backbone.pt"
FACEPIPE_SPEC = "model.json"
#: A key only facenet-pytorch's Inception-ResNet-v1 layout has, and its classifier's prefix.
_FACENET_KEY = "conv2d_1a.conv.weight"
_FACENET_CLASSIFIER = "logits."
#: facenet-pytorch's published classifiers, by their number of classes.
FACENET_DATASETS = {8631: "VGGFace2", 10575: "CASIA-WebFace"}


@dataclass(frozen=True)
class InitRecord:
    """What ``init_from`` loaded, for ``model.json``: the file's kind, name and sha256, and what was dropped."""

    kind: str
    file: str
    sha256: str
    dropped: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


def weights_file(path: str | os.PathLike[str]) -> tuple[Path, bool]:
    """(the file to read, whether it is a facepipe model's ``backbone.pt``) for ``init_from``'s ``path``."""
    path = Path(path)
    if path.is_dir():
        if not (path / FACEPIPE_SPEC).is_file() or not (path / FACEPIPE_WEIGHTS).is_file():
            raise WeightsError(
                f"init_from {str(path)!r} is a folder but not a facepipe model folder "
                f"({FACEPIPE_WEIGHTS} and {FACEPIPE_SPEC})"
            )
        return path / FACEPIPE_WEIGHTS, True
    if not path.is_file():
        raise WeightsError(f"init_from {str(path)!r} does not exist")
    return path, path.name == FACEPIPE_WEIGHTS and (path.parent / FACEPIPE_SPEC).is_file()


def load_init_weights(backbone: Backbone, path: str | os.PathLike[str]) -> InitRecord:
    """Load ``path`` (any kind above) into ``backbone`` strictly; returns what was loaded.

    Raises ``WeightsError`` (one line) on a file that is missing, unreadable, not a plain state dict,
    or does not fit the backbone key for key; ``backbone`` is then unchanged.
    """
    source, is_facepipe = weights_file(path)
    state = read_state_dict(source)
    dropped = None
    if is_facepipe:
        kind = "facepipe"
    elif _FACENET_KEY in state:
        kind = "facenet-pytorch"
        classifier = sorted(key for key in state if key.startswith(_FACENET_CLASSIFIER))
        if classifier:
            classes = state["logits.weight"].shape[0] if "logits.weight" in state else None
            named = FACENET_DATASETS.get(classes, "") if classes else ""
            dropped = f"{', '.join(classifier)} ({classes} classes{', ' + named if named else ''})"
            state = {key: value for key, value in state.items() if not key.startswith(_FACENET_CLASSIFIER)}
    else:
        kind = "arcface_torch"
    problems = describe_mismatch(backbone.state_dict(), state)
    if problems:
        raise WeightsError(f"init_from {str(path)!r} ({kind}) does not fit {type(backbone).__name__}: {problems}")
    backbone.load_state_dict(state, strict=True)
    if dropped:
        log.info("init_from: dropped the file's pretraining classifier %s; the head is this run's own", dropped)
    record = InitRecord(kind=kind, file=source.name, sha256=sha256_file(source), dropped=dropped)
    log.info("init_from: backbone weights from %s (%s, sha256 %s)", source, kind, record.sha256[:16])
    return record
