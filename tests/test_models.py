"""Backbones: registry, shapes, gradients, activation checkpointing, weight files, reference layouts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import facepipe.models.backbone as backbone_module
from facepipe.models import Backbone, WeightsError, create_backbone, list_backbones

SLOW = {"iresnet100"}  # 65M parameters: only its layout is checked by default
# same code path as iresnet18, at 2-4x the cost: run in CI only for the tests that repeat a model
HEAVY = SLOW | {"iresnet34", "iresnet50"}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def image_size(name: str) -> int:
    return 160 if name == "inception_resnet_v1" else 112


def each_backbone(slow: set[str] = SLOW) -> list:
    return [pytest.param(name, marks=pytest.mark.slow) if name in slow else name for name in list_backbones()]


def images(name: str, seed: int = 0, size: int | None = None) -> torch.Tensor:
    size = size or image_size(name)
    return torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_registry_holds_the_documented_backbones():
    assert list_backbones() == sorted(
        ["iresnet18", "iresnet34", "iresnet50", "iresnet100", "mobilefacenet", "inception_resnet_v1"]
    )


def test_unknown_name_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="'resnet9000'.*iresnet50.*mobilefacenet"):
        create_backbone("resnet9000")


@pytest.mark.parametrize("name", each_backbone())
def test_forward_backward_on_a_batch_of_two(name: str):
    torch.manual_seed(0)
    model = create_backbone(name, embedding_size=128, image_size=image_size(name))
    assert isinstance(model, Backbone)
    out = model(images(name))
    assert out.shape == (2, 128) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    out.square().sum().backward()
    for key, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), key


@pytest.mark.parametrize("name", each_backbone(HEAVY))
def test_gradient_checkpointing_changes_memory_not_results(name: str, monkeypatch: pytest.MonkeyPatch):
    """Memory: bytes of the activations autograd keeps for backward (counted by a saved-tensors
    hook, which checkpointed stages bypass) drop; outputs, gradients and BN statistics do not change."""
    # small images: recomputation does not depend on the size, the test's cost does
    size = 96 if name == "inception_resnet_v1" else 48
    torch.manual_seed(0)
    plain = create_backbone(name, image_size=size)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing = True

    calls = []
    original = backbone_module.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs.get("use_reentrant"))
        return original(*args, **kwargs)

    monkeypatch.setattr(backbone_module, "checkpoint", counting)
    x = images(name, size=size)
    outputs, saved = [], []
    for model in (plain, checkpointed):
        kept = [0]

        def pack(tensor: torch.Tensor, kept: list[int] = kept) -> torch.Tensor:
            kept[0] += tensor.numel() * tensor.element_size()
            return tensor

        torch.manual_seed(1)  # same dropout masks
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(x)
        out.square().sum().backward()
        outputs.append(out)
        saved.append(kept[0])
    assert calls and all(reentrant is False for reentrant in calls)
    assert saved[1] < 0.5 * saved[0], saved  # the stages' activations are no longer kept
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=0)
    for (key, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        if a.requires_grad:
            # Recomputation runs the same kernels on the same inputs in one thread (autouse fixture): the
            # gradients are bit-identical (measured, every backbone), so any difference is a bug.
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=key)
    # recomputation in backward must not count the batch twice in BatchNorm statistics
    for (key, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=key)


# --- the arcface_torch IResNet layout, derived from its documented architecture -------------------
# stem: conv1 3->64 (3x3), bn1, prelu; four stages of IBasicBlocks with widths 64, 128, 256, 512;
# a block: bn1(C_in), conv1 C_in->C (3x3), bn2(C), prelu(C), conv2 C->C (3x3, stride), bn3(C), and
# in the first block of every stage (stride 2) downsample.0 conv C_in->C (1x1) + downsample.1 BN;
# head: bn2(512), dropout (no parameters), fc 512*7*7 -> E (112 input halved four times), features BN1d(E).
IRESNET_BLOCKS = {
    "iresnet18": [2, 2, 2, 2],
    "iresnet34": [3, 4, 6, 3],
    "iresnet50": [3, 4, 14, 3],
    "iresnet100": [3, 13, 30, 3],
}


def batchnorm_keys(prefix: str, channels: int) -> dict[str, tuple[int, ...]]:
    shapes = {"weight": (channels,), "bias": (channels,), "running_mean": (channels,), "running_var": (channels,)}
    keys = {f"{prefix}.{name}": shape for name, shape in shapes.items()}
    keys[f"{prefix}.num_batches_tracked"] = ()
    return keys


def arcface_torch_iresnet_layout(blocks: list[int], embedding_size: int = 512) -> dict[str, tuple[int, ...]]:
    keys = {"conv1.weight": (64, 3, 3, 3), **batchnorm_keys("bn1", 64), "prelu.weight": (64,)}
    in_channels = 64
    for stage, (count, width) in enumerate(zip(blocks, [64, 128, 256, 512]), start=1):
        for index in range(count):
            p = f"layer{stage}.{index}"
            block_in = in_channels if index == 0 else width
            keys.update(batchnorm_keys(f"{p}.bn1", block_in))
            keys[f"{p}.conv1.weight"] = (width, block_in, 3, 3)
            keys.update(batchnorm_keys(f"{p}.bn2", width))
            keys[f"{p}.prelu.weight"] = (width,)
            keys[f"{p}.conv2.weight"] = (width, width, 3, 3)
            keys.update(batchnorm_keys(f"{p}.bn3", width))
            if index == 0:
                keys[f"{p}.downsample.0.weight"] = (width, block_in, 1, 1)
                keys.update(batchnorm_keys(f"{p}.downsample.1", width))
        in_channels = width
    keys.update(batchnorm_keys("bn2", 512))
    keys["fc.weight"] = (embedding_size, 512 * 7 * 7)
    keys["fc.bias"] = (embedding_size,)
    keys.update(batchnorm_keys("features", embedding_size))
    return keys


@pytest.mark.parametrize("name", sorted(IRESNET_BLOCKS))
def test_iresnet_state_dict_matches_arcface_torch(name: str):
    model = create_backbone(name)
    found = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert found == arcface_torch_iresnet_layout(IRESNET_BLOCKS[name])
    # arcface_torch freezes the scale of the embedding BatchNorm at 1
    assert not model.features.weight.requires_grad


def test_mobilefacenet_has_the_arcface_torch_layout():
    shapes = {key: tuple(value.shape) for key, value in create_backbone("mobilefacenet").state_dict().items()}
    expected = {
        "layers.0.layers.0.weight": (128, 3, 3, 3),  # stem conv, width 64 * scale 2
        "layers.1.layers.0.weight": (128, 2, 3, 3),  # blocks[0] == 1: a 3x3 conv with groups=64
        "layers.2.layers.0.layers.0.weight": (128, 128, 1, 1),  # DepthWise expand to groups=128
        "layers.2.layers.1.layers.0.weight": (128, 1, 3, 3),  # depthwise
        "layers.2.layers.2.layers.0.weight": (128, 128, 1, 1),  # linear project
        "layers.4.layers.0.layers.0.weight": (256, 128, 1, 1),  # 128 -> 256 with groups=256
        "layers.6.layers.0.layers.0.weight": (512, 256, 1, 1),  # groups=512
        "conv_sep.layers.0.weight": (512, 256, 1, 1),
        "features.layers.0.layers.0.weight": (512, 1, 7, 7),  # GDC over the 7x7 map
        "features.layers.2.weight": (512, 512),
        "features.layers.3.running_var": (512,),
    }
    assert {key: shapes.get(key) for key in expected} == expected
    # Residual stages hold blocks (4, 6, 2) of DepthWise, each 3 ConvBlock/LinearBlock layers
    for stage, count in ((3, 4), (5, 6), (7, 2)):
        indices = {int(k.split(".")[3]) for k in shapes if k.startswith(f"layers.{stage}.layers.")}
        assert indices == set(range(count))
    assert not any(key.startswith("layers.8") for key in shapes)


def test_inception_matches_facenet_pytorch_up_to_normalisation():
    from facenet_pytorch import InceptionResnetV1

    torch.manual_seed(0)
    ours = create_backbone("inception_resnet_v1", image_size=160).eval()
    reference = InceptionResnetV1(pretrained=None, classify=False).eval()
    reference.load_state_dict(ours.state_dict(), strict=True)
    x = images("inception_resnet_v1")
    with torch.no_grad():
        torch.testing.assert_close(F.normalize(ours(x), dim=1), reference(x), rtol=1e-5, atol=1e-6)


def test_inception_loads_a_published_style_file_with_its_classifier(tmp_path):
    source = create_backbone("inception_resnet_v1", image_size=160)
    state = source.state_dict()
    # facenet-pytorch's published files also hold the pretraining classifier (VGGFace2: 8631)
    state["logits.weight"] = torch.zeros(8631, 512)
    state["logits.bias"] = torch.zeros(8631)
    torch.save(state, tmp_path / "vggface2.pt")
    expected = {key: value.clone() for key, value in source.state_dict().items()}
    for parameter in source.parameters():
        parameter.data.zero_()
    source.load_weights(tmp_path / "vggface2.pt")
    for key, value in expected.items():
        torch.testing.assert_close(source.state_dict()[key], value, rtol=0, atol=0)


@pytest.mark.parametrize("name", each_backbone(HEAVY))
def test_weights_round_trip(name: str, tmp_path):
    torch.manual_seed(0)
    source = create_backbone(name, image_size=image_size(name))
    torch.save(source.state_dict(), tmp_path / "backbone.pth")
    torch.manual_seed(1)
    loaded = create_backbone(name, image_size=image_size(name), weights=tmp_path / "backbone.pth")
    for key, value in source.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0, msg=key)


def test_mismatched_weights_name_the_keys(tmp_path):
    state = create_backbone("mobilefacenet").state_dict()
    del state["conv_sep.layers.1.running_mean"]
    state["classifier.weight"] = torch.zeros(3)
    state["features.layers.2.weight"] = torch.zeros(128, 512)
    torch.save(state, tmp_path / "bad.pth")
    with pytest.raises(WeightsError) as error:
        create_backbone("mobilefacenet", weights=tmp_path / "bad.pth")
    message = str(error.value)
    assert "missing keys (1): conv_sep.layers.1.running_mean" in message
    assert "unexpected keys (1): classifier.weight" in message
    assert "features.layers.2.weight [128, 512] in file vs [512, 512] in model" in message


def test_unusable_weight_files_are_clear_errors(tmp_path):
    with pytest.raises(WeightsError, match="does not exist"):
        create_backbone("mobilefacenet", weights=tmp_path / "missing.pth")
    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    with pytest.raises(WeightsError, match="not a state dict"):
        create_backbone("mobilefacenet", weights=tmp_path / "list.pth")
    torch.save({"epoch": 3}, tmp_path / "checkpoint.pth")
    with pytest.raises(WeightsError, match="'epoch' is a int"):
        create_backbone("mobilefacenet", weights=tmp_path / "checkpoint.pth")
    (tmp_path / "garbage.pth").write_bytes(b"not a torch file")
    with pytest.raises(WeightsError, match="cannot be read"):
        create_backbone("mobilefacenet", weights=tmp_path / "garbage.pth")


def test_other_image_sizes_resize_the_head():
    model = create_backbone("iresnet18", image_size=96, embedding_size=64)
    assert model.fc.in_features == 512 * 6 * 6
    assert model(torch.zeros(2, 3, 96, 96)).shape == (2, 64)


@pytest.mark.parametrize("name", ["iresnet18", "mobilefacenet"])
def test_embedding_is_float32_under_autocast(name: str):
    # small images: bfloat16 convolutions are slow on most CPUs
    model = create_backbone(name, image_size=32).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images(name, size=32))
    assert out.dtype == torch.float32 and out.shape == (2, 512)
