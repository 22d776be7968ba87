"""Starting from a pretrained model (issue 18): ``train.init_from`` for facenet-pytorch, arcface_torch and
facepipe files, the recorded pixel normalisation, ``freeze_epochs``, and the fine-tuning optimizer and
schedule settings, each resumed exactly."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from train_helpers import load_weights, synthetic_set, tiny_params, write_params

from facepipe.cli import main
from facepipe.evaluation.embed import to_model_input
from facepipe.io.model_dir import load_backbone, read_model_spec
from facepipe.io.shards import ShardSet
from facepipe.models import create_backbone
from facepipe.stages.train import run
from facepipe.training.checkpoint import list_checkpoints
from facepipe.training.optimizer import build_optimizer
from facepipe.training.schedule import build_scheduler, lr_factor, milestone_steps

from test_models import IRESNET_BLOCKS, arcface_torch_iresnet_layout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shard_pixels(root: Path, count: int) -> np.ndarray:
    """The first ``count`` faces of a shard set: [N, S, S, 3] uint8 RGB."""
    shard_set = ShardSet(root)
    return np.stack([shard_set.record(i).image() for i in range(count)])


def randomize_batchnorm_statistics(module: torch.nn.Module, seed: int) -> None:
    """Running statistics away from (0, 1), so that a forward in eval mode depends on them."""
    generator = torch.Generator().manual_seed(seed)
    for norm in module.modules():
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            norm.running_mean.copy_(torch.randn(norm.running_mean.shape, generator=generator) * 0.1)
            norm.running_var.copy_(torch.rand(norm.running_var.shape, generator=generator) + 0.5)


def frozen_first_step(shard_set: Path, out: Path, **overrides) -> None:
    """One optimizer step with the backbone frozen: the model folder then holds the init weights."""
    params = tiny_params(epochs=2, freeze_epochs=1, batch_size=4, reference_batch=4, **overrides)
    run(params, shard_set, out, max_steps=1)


# --- facenet-pytorch -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faces160(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 identities x 4 faces of 160 x 160, facenet-pytorch's input size."""
    return synthetic_set(tmp_path_factory.mktemp("faces160") / "set", identities=4, per_identity=4, size=160)


@pytest.fixture(scope="module")
def vggface2_file(tmp_path_factory: pytest.TempPathFactory):
    """A state dict in the layout of facenet-pytorch's published ``20180402-114759-vggface2.pt``: its own
    ``InceptionResnetV1(classify=True, num_classes=8631)``, randomly initialised (no download)."""
    from facenet_pytorch import InceptionResnetV1

    torch.manual_seed(0)
    reference = InceptionResnetV1(pretrained=None, classify=True, num_classes=8631)
    randomize_batchnorm_statistics(reference, seed=1)
    path = tmp_path_factory.mktemp("facenet") / "20180402-114759-vggface2.pt"
    torch.save(reference.state_dict(), path)
    return path, reference.eval()


@pytest.mark.slow
def test_a_facenet_pytorch_file_gives_facenet_pytorchs_forward(faces160, vggface2_file, tmp_path, caplog):
    from facenet_pytorch import fixed_image_standardization

    path, reference = vggface2_file
    out = tmp_path / "model"
    with caplog.at_level(logging.INFO, logger="facepipe"):
        frozen_first_step(
            faces160, out, backbone="inception_resnet_v1", embedding_size=512, head="softmax", init_from=str(path)
        )
    dropped = "logits.bias, logits.weight (8631 classes, VGGFace2)"
    assert f"dropped the file's pretraining classifier {dropped}" in caplog.text
    spec = read_model_spec(out)
    assert spec.init_from == {
        "kind": "facenet-pytorch",
        "file": path.name,
        "sha256": sha256(path),
        "dropped": "logits.bias, logits.weight (8631 classes, VGGFace2)",
    }
    assert spec.normalization.model_dump() == {"family": "facenet", "mean": 127.5, "std": 128.0}
    # the first forward: facepipe's model folder fed as model.json says, vs facenet-pytorch fed its way
    model, spec = load_backbone(out)
    pixels = shard_pixels(faces160, 4)
    with torch.no_grad():
        ours = model(to_model_input(pixels, mean=spec.normalization.mean, std=spec.normalization.std))
        theirs_input = fixed_image_standardization(torch.from_numpy(pixels).permute(0, 3, 1, 2).float())
        logits = reference(theirs_input)  # classify=True: logits of the unnormalised embedding
        torch.testing.assert_close(reference.logits(ours), logits, rtol=0, atol=1e-5)
        reference.classify = False  # the L2-normalised embedding
        torch.testing.assert_close(F.normalize(ours, dim=1), reference(theirs_input), rtol=0, atol=1e-5)
        reference.classify = True


@pytest.mark.parametrize(
    "classes,dropped",
    [(10575, "logits.bias, logits.weight (10575 classes, CASIA-WebFace)"), (None, None)],
)
def test_casia_and_classifier_free_facenet_files(tmp_path, caplog, classes, dropped):
    from facenet_pytorch import InceptionResnetV1

    from facepipe.models.pretrained import load_init_weights

    torch.manual_seed(1)
    reference = InceptionResnetV1(pretrained=None, classify=classes is not None, num_classes=classes)
    path = tmp_path / "facenet.pt"
    torch.save(reference.state_dict(), path)
    backbone = create_backbone("inception_resnet_v1", image_size=160)
    with caplog.at_level(logging.INFO, logger="facepipe"):
        record = load_init_weights(backbone, path)
    assert (record.kind, record.dropped, record.sha256) == ("facenet-pytorch", dropped, sha256(path))
    assert ("pretraining classifier" in caplog.text) == (dropped is not None)
    assert all(torch.equal(value, reference.state_dict()[key]) for key, value in backbone.state_dict().items())


# --- arcface_torch ---------------------------------------------------------------------------------


def iresnet_forward(state: dict[str, torch.Tensor], x: torch.Tensor, blocks: list[int]) -> torch.Tensor:
    """arcface_torch ``IResNet.forward`` in eval mode, written from its source with torch.nn.functional
    on a bare state dict (independent of facepipe's modules): [B, 3, 112, 112] -> [B, E]."""

    def bn(prefix: str, h: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(
            h,
            state[f"{prefix}.running_mean"],
            state[f"{prefix}.running_var"],
            state[f"{prefix}.weight"],
            state[f"{prefix}.bias"],
            training=False,
            eps=1e-5,
        )

    h = F.prelu(bn("bn1", F.conv2d(x, state["conv1.weight"], padding=1)), state["prelu.weight"])
    for stage, count in enumerate(blocks, start=1):
        for index in range(count):
            p, stride = f"layer{stage}.{index}", 2 if index == 0 else 1
            out = bn(f"{p}.bn1", h)
            out = F.conv2d(out, state[f"{p}.conv1.weight"], padding=1)
            out = F.prelu(bn(f"{p}.bn2", out), state[f"{p}.prelu.weight"])
            out = bn(f"{p}.bn3", F.conv2d(out, state[f"{p}.conv2.weight"], stride=stride, padding=1))
            shortcut = h
            if f"{p}.downsample.0.weight" in state:
                shortcut = bn(f"{p}.downsample.1", F.conv2d(h, state[f"{p}.downsample.0.weight"], stride=stride))
            h = out + shortcut
    h = torch.flatten(bn("bn2", h), 1)
    return bn("features", F.linear(h, state["fc.weight"], state["fc.bias"]))


def arcface_torch_file(path: Path, *, embedding_size: int = 512, seed: int = 0) -> dict[str, torch.Tensor]:
    """An iresnet18 ``backbone.pth`` in arcface_torch's layout (test_models' transcription), random values."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in arcface_torch_iresnet_layout(IRESNET_BLOCKS["iresnet18"], embedding_size).items():
        if key.endswith("num_batches_tracked"):
            state[key] = torch.tensor(1000, dtype=torch.long)
        elif key.endswith("running_var"):
            state[key] = torch.rand(shape, generator=generator) + 0.5
        elif key.endswith(".weight") and len(shape) == 1 and "prelu" not in key:
            state[key] = 1 + 0.1 * torch.randn(shape, generator=generator)  # BatchNorm scales
        elif len(shape) == 4:  # He-scaled convolutions keep the activations in range through 8 blocks
            state[key] = torch.randn(shape, generator=generator) * math.sqrt(2 / math.prod(shape[1:]))
        else:
            state[key] = torch.randn(shape, generator=generator) * 0.05
    state["features.weight"] = torch.ones(embedding_size)  # arcface_torch fixes the embedding BN's scale
    torch.save(state, path)
    return state


@pytest.fixture(scope="module")
def faces112(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_set(tmp_path_factory.mktemp("faces112") / "set", identities=4, per_identity=4, size=112)


@pytest.mark.slow
def test_an_arcface_torch_file_gives_arcface_torchs_forward(faces112, tmp_path):
    path = tmp_path / "backbone.pth"
    state = arcface_torch_file(path, embedding_size=64)
    out = tmp_path / "model"
    frozen_first_step(faces112, out, backbone="iresnet18", embedding_size=64, head="arcface", init_from=str(path))
    spec = read_model_spec(out)
    assert spec.init_from == {"kind": "arcface_torch", "file": "backbone.pth", "sha256": sha256(path)}
    assert spec.normalization.model_dump() == {"family": "arcface", "mean": 127.5, "std": 127.5}
    model, spec = load_backbone(out)
    pixels = shard_pixels(faces112, 4)
    x = to_model_input(pixels, mean=spec.normalization.mean, std=spec.normalization.std)
    # arcface_torch's (x / 255 - 0.5) / 0.5, up to float32 rounding (which 8 random residual blocks amplify,
    # so both forwards below take the same tensor)
    expected = (torch.from_numpy(pixels).permute(0, 3, 1, 2).double() - 127.5) / 127.5
    torch.testing.assert_close(x.double(), expected, rtol=0, atol=1e-7)
    with torch.no_grad():
        ours = model(x)
        torch.testing.assert_close(ours, iresnet_forward(state, x, IRESNET_BLOCKS["iresnet18"]), rtol=0, atol=1e-5)


# --- a facepipe model, and the files that must be refused ------------------------------------------


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 identities x 12 samples of 16x16: 6 steps of 8 per epoch."""
    return synthetic_set(tmp_path_factory.mktemp("finetune") / "set")


@pytest.fixture(scope="module")
def pretrained(shard_set: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A facepipe model folder: one epoch of the tiny mobilefacenet."""
    out = tmp_path_factory.mktemp("pretrained") / "model"
    run(tiny_params(epochs=1, seed=3), shard_set, out)
    return out


@pytest.mark.parametrize("which", ["folder", "backbone.pt"])
def test_a_facepipe_model_folder_or_its_backbone_starts_the_run(pretrained, shard_set, tmp_path, which):
    source = pretrained if which == "folder" else pretrained / "backbone.pt"
    out = tmp_path / "model"
    frozen_first_step(shard_set, out, init_from=str(source))
    assert read_model_spec(out).init_from == {
        "kind": "facepipe",
        "file": "backbone.pt",
        "sha256": sha256(pretrained / "backbone.pt"),
    }
    before, after = load_weights(pretrained / "backbone.pt"), load_weights(out / "backbone.pt")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def broken_files(folder: Path, pretrained: Path) -> dict[str, tuple[Path, str]]:
    """Files init_from must refuse, each with the one line it must say."""
    state = load_weights(pretrained / "backbone.pt")
    files: dict[str, tuple[Path, str]] = {}

    def save(name: str, value: object, message: str) -> None:
        torch.save(value, folder / name)
        files[name] = (folder / name, message)

    missing = dict(state)
    del missing["conv_sep.layers.1.running_mean"]
    save(
        "missing.pth",
        missing,
        "(arcface_torch) does not fit MobileFaceNet: missing keys (1): conv_sep.layers.1.running_mean",
    )
    extra = {**state, "classifier.weight": torch.zeros(3, 16), "classifier.bias": torch.zeros(3)}
    save("extra.pth", extra, "unexpected keys (2): classifier.weight, classifier.bias")
    reshaped = {**state, "features.layers.2.weight": torch.zeros(32, 512)}
    save("shape.pth", reshaped, "shape mismatch (1): features.layers.2.weight [32, 512] in file vs [16, 512] in model")
    module = create_backbone("mobilefacenet", embedding_size=16, image_size=16)  # a pickled object
    save("module.pth", module, "cannot be read as a state dict")
    files["absent.pth"] = (folder / "absent.pth", "does not exist")
    (folder / "not-a-model").mkdir()
    files["not-a-model"] = (folder / "not-a-model", "is a folder but not a facepipe model folder")
    return files


def test_files_that_do_not_fit_are_one_line_errors_and_nothing_is_written(pretrained, shard_set, tmp_path, capsys):
    for name, (path, message) in broken_files(tmp_path, pretrained).items():
        out = tmp_path / f"out-{name}"
        params = write_params(tmp_path / "params.yaml", init_from=str(path))
        assert main(["train", str(shard_set), str(out), "--params", str(params)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (name, err)
        assert not out.exists() or not any(out.iterdir()), name


def test_a_resumed_checkpoint_wins_over_init_from(pretrained, shard_set, tmp_path, caplog):
    out = tmp_path / "model"
    params = tiny_params(epochs=2, init_from=str(pretrained))
    run(params, shard_set, out, max_steps=3)
    with caplog.at_level(logging.INFO, logger="facepipe"):
        report = run(params, shard_set, out)
    assert report.resumed_from_step == 3 and report.steps == 12
    assert "resuming from the checkpoint of step 3: its weights replace train.init_from's" in caplog.text


# --- freeze_epochs ---------------------------------------------------------------------------------


def test_freeze_epochs_keep_backbone_weights_and_statistics_bit_identical(pretrained, shard_set, tmp_path):
    out = tmp_path / "model"
    run(tiny_params(epochs=2, freeze_epochs=1, init_from=str(pretrained)), shard_set, out)
    start = load_weights(pretrained / "backbone.pt")
    (_, end_of_freeze), (_, end) = list_checkpoints(out / "checkpoints")  # steps 6 and 12
    frozen = torch.load(end_of_freeze, weights_only=True)
    assert frozen["step"] == 6 and frozen["epoch"] == 1
    assert frozen["backbone"].keys() == start.keys()
    changed = [key for key in start if not torch.equal(frozen["backbone"][key], start[key])]
    assert changed == [], changed  # weights, running means and variances, batch counts
    head = create_head_like(frozen)
    assert not torch.equal(frozen["head"]["weight"], head), "the head trains while the backbone is frozen"
    after = torch.load(end, weights_only=True)["backbone"]
    moved = [key for key in start if not torch.equal(after[key], start[key])]
    assert any(key.endswith("running_mean") for key in moved) and any(key.endswith(".weight") for key in moved)


def create_head_like(checkpoint: dict) -> torch.Tensor:
    from facepipe.heads import create_head

    config = checkpoint["config"]
    return create_head(
        config["head"], embedding_size=config["embedding_size"], num_classes=4, seed=config["seed"]
    ).weight.detach()


# --- optimizer and schedule ----------------------------------------------------------------------------


def test_step_decay_is_multisteplr_per_epoch_and_backbone_lr_scale_scales_the_backbone():
    backbone, head = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
    optimizer = build_optimizer(
        [backbone, head], name="adam", lr=0.01, momentum=0.9, weight_decay=1e-3, lr_scales=[0.1, 1.0]
    )
    assert isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW)
    per_epoch = 4
    scheduler = build_scheduler(
        optimizer, total_steps=12 * per_epoch, warmup_steps=0, decay="step",
        milestones=milestone_steps([5, 10], per_epoch), gamma=0.1,
    )
    reference = torch.optim.lr_scheduler.MultiStepLR(
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01), milestones=[5, 10], gamma=0.1
    )
    for epoch in range(12):
        for _ in range(per_epoch):
            rates = [group["lr"] for group in optimizer.param_groups]
            head_rate = reference.get_last_lr()[0]
            assert rates == pytest.approx([head_rate * 0.1] * 2 + [head_rate] * 2, rel=1e-12), epoch
            optimizer.step()
            scheduler.step()
        reference.optimizer.step()
        reference.step()
    assert lr_factor(7, total_steps=9, warmup_steps=2, decay="step", milestones=(4,), gamma=0.5) == 0.5


def test_fine_tuning_settings_resume_exactly(pretrained, shard_set, tmp_path):
    """Adam, step decay, freeze_epochs, backbone_lr_scale and the softmax head: stopped inside the
    frozen epoch and again after the milestone, then resumed, the run ends with the same weights."""
    params = tiny_params(
        epochs=3, init_from=str(pretrained), head="softmax", optimizer="adam", lr=0.002, decay="step",
        milestones=[2], gamma=0.5, freeze_epochs=1, backbone_lr_scale=0.5, checkpoint_every=2,
    )
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run(params, shard_set, straight)
    run(params, shard_set, stopped, max_steps=3)
    run(params, shard_set, stopped, max_steps=14)
    assert run(params, shard_set, stopped).resumed_from_step == 14
    a, b = load_weights(straight / "backbone.pt"), load_weights(stopped / "backbone.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    last = torch.load(list_checkpoints(stopped / "checkpoints")[-1][1], weights_only=True)
    rates = [group["lr"] for group in last["optimizer"]["param_groups"]]
    # the backbone at x0.5, and both x0.5 after the milestone
    assert rates == pytest.approx([0.002 * 0.5 * 0.5] * 2 + [0.002 * 0.5] * 2)


@pytest.mark.parametrize(
    "override,message",
    [
        ({"decay": "step"}, "decay step needs milestones"),
        ({"milestones": [3]}, "milestones are for decay: step (decay is cosine)"),
        ({"decay": "step", "milestones": [3, 2]}, "milestones must be increasing epochs >= 1, got [3, 2]"),
        ({"freeze_epochs": 8, "epochs": 8}, "freeze_epochs (8) must be fewer than epochs (8)"),
        ({"optimizer": "lamb"}, "train.optimizer: Input should be 'sgd', 'adamw' or 'adam'"),
        ({"init_from": ""}, "init_from: give a path, or null for random weights"),
    ],
)
def test_bad_fine_tuning_params_are_one_line_errors(shard_set, tmp_path, capsys, override, message):
    params = write_params(tmp_path / "params.yaml", **override)
    assert main(["train", str(shard_set), str(tmp_path / "out"), "--params", str(params)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
