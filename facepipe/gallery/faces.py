"""How ``embed`` finds and cuts faces: as the model's training set did (model.json ``faces``)."""

from __future__ import annotations

import logging
from typing import Any

from facepipe.config import PrepareParams
from facepipe.errors import FacepipeError
from facepipe.io.manifest import weights_record
from facepipe.io.model_dir import ModelSpec

log = logging.getLogger("facepipe.embed")

#: prepare params that do not change a face's pixels: scanning and packing only.
NOT_FACES = frozenset({"samples_per_shard", "follow_symlinks"})


def training_faces(spec: ModelSpec, given: PrepareParams | None = None) -> PrepareParams:
    """The prepare params to cut faces for ``spec``'s model: its training set's, recorded in
    model.json. ``given`` (a params file's prepare section) must agree with them on every field that
    changes a face; a model that records none (trained before it was recorded, or converted) takes
    ``given`` (or the defaults) when its image size and crop match the model's. Raises FacepipeError."""
    if spec.faces is None:
        params = given if given is not None else PrepareParams()
        log.warning("embed: the model does not record how its training set was prepared: using the prepare section of the params given (or the defaults)")
        for name in ("image_size", "crop"):
            if getattr(params, name) != getattr(spec, name):
                raise FacepipeError(
                    f"prepare.{name} is {getattr(params, name)!r}, the model takes {getattr(spec, name)!r} faces (model.json)"
                )
        return params
    recorded = _recorded(spec.faces, given)
    if given is not None:
        for name in PrepareParams.model_fields:
            if name not in NOT_FACES and getattr(given, name) != getattr(recorded, name):
                raise FacepipeError(
                    f"prepare.{name} is {getattr(given, name)!r} in the params given, the model's training set used "
                    f"{getattr(recorded, name)!r} (model.json faces): embeddings would not match the model"
                )
        return recorded.model_copy(update={"follow_symlinks": given.follow_symlinks})
    return recorded


def _recorded(faces: dict[str, Any], given: PrepareParams | None) -> PrepareParams:
    """model.json's ``faces`` (a manifest's params) as PrepareParams; weights recorded by name and
    sha256 are taken from ``given`` when it names a file with that sha256."""
    content = dict(faces)
    weights = content.pop("detector_weights", None)
    if weights is not None:
        path = given.detector_weights if given is not None else None
        if path is None or weights_record(path) != weights:
            raise FacepipeError(
                f"the model's training set was detected with {weights.get('file')} (sha256 {weights.get('sha256')}):"
                " give that file as prepare.detector_weights in --params"
            )
        content["detector_weights"] = path
    try:
        return PrepareParams.model_validate(content)
    except ValueError as error:
        raise FacepipeError(f"model.json faces: not prepare params this facepipe reads ({str(error).splitlines()[0]})") from None
