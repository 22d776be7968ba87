"""The RetinaFace network alone, on one thread: onnxruntime as prepare runs it, against the other ways
to run the same model on a CPU, on the inputs prepare gives it.

- ``onnxruntime``: prepare's runtime and settings (:class:`facepipe.detection.retinaface.OnnxRetinaFace`).
- ``openvino``: the same ONNX model compiled by OpenVINO for its CPU plugin, one thread, f32 (run only
  when ``openvino`` is importable: it is not a facepipe dependency).
- ``int8``: the model quantized by onnxruntime (static, per-channel weights, calibrated on photos of the
  folder not timed), run by onnxruntime: a different model, so its outputs' distance from float is
  printed beside the time.

Each input is a photo of ``RAW`` decoded and scaled as prepare scales it for detection. CPU time per
run, medians of the interleaved runs; max |difference| of each output (boxes, scores, landmarks: the
network's raw regressions) against onnxruntime's float model.

    python benchmarks/detector_network.py RAW [--photos 20] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from facepipe.config import PrepareParams
from facepipe.data.decode import load_image_reduced
from facepipe.data.scan import scan_raw
from facepipe.detection.base import downscale
from facepipe.detection.retinaface import _BUCKET, OnnxRetinaFace, RetinaFaceDetector, onnx_model
from facepipe.errors import FacepipeError

Run = Callable[[np.ndarray], Sequence[np.ndarray]]


def network_inputs(raw: Path, paths: list[str], detector: RetinaFaceDetector, params: PrepareParams) -> list[np.ndarray]:
    """[1, 3, H, W] inputs as prepare makes them: the reduced decode, the bilinear downscale, the
    padding to the network's bucket (32 px)."""
    inputs = []
    for path in paths:
        decoded = load_image_reduced((raw / path).read_bytes(), max_pixels=params.max_pixels, longest=params.detect_size)
        small, _ = downscale(decoded.image, detector.input_side(decoded.image.shape, reduction=decoded.reduction), bilinear_to_half=True)
        h, w = small.shape[:2]
        inputs.append(detector._input([small], (_BUCKET * -(-h // _BUCKET), _BUCKET * -(-w // _BUCKET))))
    return inputs


def openvino_runner(model: bytes) -> Run:
    import openvino as ov

    core = ov.Core()
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "m.onnx").write_bytes(model)
        source = core.read_model(str(Path(folder) / "m.onnx"))
    compiled: dict[tuple[int, ...], object] = {}
    settings = {"INFERENCE_NUM_THREADS": 1, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}

    def run(batch: np.ndarray) -> list[np.ndarray]:
        if batch.shape not in compiled:  # compiled once per input shape, outside the timed run
            model = source.clone()
            model.reshape({model.inputs[0].get_any_name(): list(batch.shape)})
            compiled[batch.shape] = core.compile_model(model, "CPU", settings).create_infer_request()
        request = compiled[batch.shape]
        request.infer({0: batch})
        return [request.get_output_tensor(i).data.copy() for i in range(3)]

    return run


def int8_model(model: bytes, calibration: list[np.ndarray]) -> bytes:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.left = iter(calibration)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.left, None)
            return None if batch is None else {"input": batch}

    with tempfile.TemporaryDirectory() as folder:
        source, target = Path(folder) / "f32.onnx", Path(folder) / "int8.onnx"
        (Path(folder) / "raw.onnx").write_bytes(model)
        quant_pre_process(str(Path(folder) / "raw.onnx"), str(source))  # shapes inferred, graph folded
        # the model's opset predates per-axis DequantizeLinear: quantized operators, not QDQ pairs
        quantize_static(str(source), str(target), Reader(), quant_format=QuantFormat.QOperator, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)  # fmt: skip
        return target.read_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path)
    parser.add_argument("--photos", type=int, default=20)
    parser.add_argument("--calibration", type=int, default=16, help="photos after the timed ones, for int8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    try:
        paths = [item.path for item in scan_raw(args.raw) if item.reason is None]
    except FacepipeError as error:
        parser.exit(2, f"detector_network.py: {error}\n")
    if len(paths) < args.photos + args.calibration or args.photos < 1:
        parser.exit(2, f"detector_network.py: {args.raw} has {len(paths)} photos; {args.photos} timed + {args.calibration} to calibrate int8 needed\n")
    params = PrepareParams(detector="retinaface")
    detector = RetinaFaceDetector(detect_size=params.detect_size, min_face_size=params.min_face_size, threads=1, device="cpu")
    timed = network_inputs(args.raw, paths[: args.photos], detector, params)
    model = onnx_model()
    runners: dict[str, Run] = {"onnxruntime": OnnxRetinaFace(model, threads=1)}
    if importlib.util.find_spec("openvino") is not None:
        runners["openvino"] = openvino_runner(model)
    else:
        print("openvino: not installed, not run")
    if args.calibration:
        calibration = network_inputs(args.raw, paths[args.photos : args.photos + args.calibration], detector, params)
        runners["int8"] = OnnxRetinaFace(int8_model(model, calibration), threads=1)
    for run in runners.values():  # first-call costs (shape-specific compilation, allocations)
        run(timed[0])
    spent: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for batch in timed:
            for name, run in runners.items():
                started = time.process_time()
                run(batch)
                spent[name].append(time.process_time() - started)
    outputs = {name: [run(batch) for batch in timed] for name, run in runners.items()}  # each run once
    shapes = sorted({batch.shape[2:] for batch in timed})
    print(f"{len(timed)} photos of {args.raw}, inputs {', '.join(f'{h}x{w}' for h, w in shapes)}; {args.repeats} interleaved repeats, one thread\n")
    print("| runtime | ms CPU per photo (median) | vs onnxruntime | max abs diff: boxes, scores, landmarks |\n|---|---:|---:|---|")
    base = statistics.median(spent["onnxruntime"])
    for name in runners:
        pairs = list(zip(outputs[name], outputs["onnxruntime"]))
        diffs = [max(float(np.abs(mine[k] - theirs[k]).max()) for mine, theirs in pairs) for k in range(3)]
        median = statistics.median(spent[name])
        print(f"| {name} | {1000 * median:.2f} | {base / median:.2f}x | {', '.join(f'{d:.2g}' for d in diffs)} |")


if __name__ == "__main__":
    main()
