"""Build the wild tier: real ONNX files from exporters and packages that bridge does not use
elsewhere, and their manifest (tests/wild/manifest.json).

    python tests/wild/build.py [--cache DIR] [--venv DIR]

The exporters run in their own virtual environment (``--venv``, default /work/venvs/wild or
``$BRIDGE_WILD_VENV``), never in the project's: the script creates it with the pinned packages
and re-runs itself there. Files taken from published wheels (only what is inside the wheel) and
from the onnx/onnxruntime packages go to the cache (``--cache``, default ~/.cache/bridge-wild or
``$BRIDGE_WILD_CACHE``); the small files exported here go to tests/wild/files/, which is
committed. ``SPECS`` says how each file is trained (loss, output, input shapes, pinned inputs,
conversion options, fresh weights); the manifest adds its source, version and sha256, and keeps across rebuilds
what the tier expects of each file (``expected``: trains, refused with the error and why, a gap
that is not a real limit, or unchecked)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILES = HERE / "files"
MANIFEST = HERE / "manifest.json"
DEFAULT_VENV = Path(os.environ.get("BRIDGE_WILD_VENV", "/work/venvs/wild"))
DEFAULT_CACHE = Path(os.environ.get("BRIDGE_WILD_CACHE", Path.home() / ".cache" / "bridge-wild"))
EXPORTERS = ["onnx==1.23.2", "onnxruntime==1.32.0", "numpy", "scikit-learn==1.9.1", "skl2onnx==1.20.0",
             "spox==0.18.2", "onnxscript==0.7.2"]
WHEELS = {"silero-vad": "6.2.3", "magika": "1.0.3", "rapidocr-onnxruntime": "1.4.4", "nudenet": "3.4.2"}

# onnx's light files keep the graph, not the weights (every one 0.02): the tier draws them anew
# (tests/wild/weights.py).
LIGHT_WEIGHTS = {"reinit": "fan_in_normal", "seed": 0}
SILERO_INPUTS = {"input": [[1, 512], "normal"], "state": [[2, 1, 128], "normal"]}
# name -> how it is made (wheel member, package file, or exported here), and how it is trained.
SPECS: dict[str, dict] = {
    "silero_vad": {"wheel": "silero-vad", "member": "silero_vad/data/silero_vad.onnx", "exporter": "spox",
                   "inputs": SILERO_INPUTS, "constant_inputs": {"sr": 16000}, "output": "output"},
    "silero_vad_16k_op15": {"wheel": "silero-vad", "member": "silero_vad/data/silero_vad_16k_op15.onnx",
                            "exporter": "torch 2.3 (TorchScript)", "inputs": SILERO_INPUTS,
                            "constant_inputs": {"sr": 16000}, "output": "output"},
    "silero_vad_half": {"wheel": "silero-vad", "member": "silero_vad/data/silero_vad_half.onnx",
                        "exporter": "torch 2.3 (TorchScript)", "inputs": SILERO_INPUTS, "output": "output"},
    "silero_vad_16k_sequence": {"wheel": "silero-vad", "member": "silero_vad/data/silero_vad_16k_sequence.onnx",
                                "exporter": "torch 2.11", "inputs": {"input": [[2, 576], "normal"],
                                                                     "h": [[1, 1, 128], "normal"],
                                                                     "c": [[1, 1, 128], "normal"]},
                                "output": "speech_probs", "options": {"dynamic_batch": False}},
    "silero_vad_openvino_16k": {"wheel": "silero-vad", "member": "silero_vad/data/silero_vad_openvino_16k.onnx",
                                "exporter": "spox", "inputs": {"input": [[1, 576], "normal"],
                                                               "state": [[2, 1, 128], "normal"]}, "output": "output"},
    "silero_vad_op18_ifless": {"wheel": "silero-vad", "member": "silero_vad/data/silero_vad_op18_ifless.onnx",
                               "exporter": "torch 2.9", "inputs": SILERO_INPUTS,
                               "constant_inputs": {"sr": 16000}, "output": "output"},
    "magika_standard_v3_3": {"wheel": "magika", "member": "magika/models/standard_v3_3/model.onnx",
                             "exporter": "tf2onnx 1.16 (jax2tf)", "inputs": {"bytes": [[2, 2048], "int:0:257"]}},
    "ppocr_mobile_v2_cls": {"wheel": "rapidocr-onnxruntime",
                            "member": "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                            "exporter": "paddle2onnx", "inputs": {"x": [[1, 3, 48, 96], "normal"]}},
    "ppocrv4_det": {"wheel": "rapidocr-onnxruntime", "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                    "exporter": "paddle2onnx", "inputs": {"x": [[1, 3, 64, 64], "normal"]}},
    "ppocrv4_rec": {"wheel": "rapidocr-onnxruntime", "member": "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                    "exporter": "paddle2onnx", "inputs": {"x": [[1, 3, 48, 64], "normal"]}},
    "nudenet_320n": {"wheel": "nudenet", "member": "nudenet/320n.onnx", "exporter": "ultralytics (torch 2.3)",
                     "inputs": {"images": [[1, 3, 64, 64], "uniform"]}},
    "light_squeezenet": {"package": "onnx", "member": "backend/test/data/light/light_squeezenet.onnx",
                         "exporter": "onnx-caffe2", "inputs": {"data_0": [[1, 3, 224, 224], "normal"]},
                         # seed 0 puts two values of one max-pool window 1.1e-7 apart, which float32 swaps
                         "weights": {**LIGHT_WEIGHTS, "seed": 1}},
    "light_bvlc_alexnet": {"package": "onnx", "member": "backend/test/data/light/light_bvlc_alexnet.onnx",
                           "exporter": "onnx-caffe2", "inputs": {"data_0": [[1, 3, 224, 224], "normal"]},
                           "weights": LIGHT_WEIGHTS},
    "light_inception_v2": {"package": "onnx", "member": "backend/test/data/light/light_inception_v2.onnx",
                           "exporter": "onnx-caffe2", "inputs": {"data_0": [[1, 3, 224, 224], "normal"]},
                           "weights": LIGHT_WEIGHTS},
    "light_resnet50": {"package": "onnx", "member": "backend/test/data/light/light_resnet50.onnx",
                       "exporter": "onnx-caffe2", "inputs": {"gpu_0/data_0": [[1, 3, 224, 224], "normal"]},
                       "weights": LIGHT_WEIGHTS},
    "logreg_iris": {"package": "onnxruntime", "member": "datasets/logreg_iris.onnx", "exporter": "onnxmltools 1.2",
                    "inputs": {"float_input": [[3, 2], "normal"]}, "output": "probabilities"},
    "ort_mul_1": {"package": "onnxruntime", "member": "datasets/mul_1.onnx", "exporter": "onnxruntime test data",
                  "inputs": {"X": [[3, 2], "normal"]}},
    "skl_mlp_regressor": {"build": "skl_mlp_regressor", "exporter": "skl2onnx", "inputs": {"X": [[4, 5], "normal"]}},
    "skl_mlp_classifier": {"build": "skl_mlp_classifier", "exporter": "skl2onnx", "inputs": {"X": [[4, 5], "normal"]},
                           "output": "probabilities"},
    "skl_pca": {"build": "skl_pca", "exporter": "skl2onnx", "inputs": {"X": [[4, 6], "normal"]}},
    "skl_logistic_regression": {"build": "skl_logistic_regression", "exporter": "skl2onnx",
                                "inputs": {"X": [[4, 5], "normal"]}, "output": "probabilities"},
    "spox_attention": {"build": "spox_attention", "exporter": "spox", "inputs": {"x": [[2, 4, 8], "normal"]}},
    "spox_mlp_gelu": {"build": "spox_mlp_gelu", "exporter": "spox", "inputs": {"x": [[3, 6], "normal"]}},
    "onnxscript_cnn": {"build": "onnxscript_cnn", "exporter": "onnxscript",
                       "inputs": {"x": [[2, 3, 8, 8], "normal"]}},
    "onnxscript_gru": {"build": "onnxscript_gru", "exporter": "onnxscript", "inputs": {"x": [[5, 2, 4], "normal"]}},
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- exporters (run inside the wild venv) ---------------------------------------------------------

def _sklearn_data(features: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, features)).astype(np.float32)
    return x, x[:, 0] + 0.5 * x[:, 1] ** 2, (x[:, 0] + x[:, 1] > 0).astype(int) + (x[:, 2] > 1)


def _skl(model, features: int, options: dict | None = None):
    from skl2onnx import to_onnx

    x, _, _ = _sklearn_data(features)
    return to_onnx(model, x[:1], target_opset={"": 17, "ai.onnx.ml": 3}, options=options)


def skl_mlp_regressor():
    from sklearn.neural_network import MLPRegressor

    x, y, _ = _sklearn_data(5)
    return _skl(MLPRegressor(hidden_layer_sizes=(8, 6), max_iter=50, random_state=0).fit(x, y), 5)


def skl_mlp_classifier():
    from sklearn.neural_network import MLPClassifier

    x, _, labels = _sklearn_data(5)
    model = MLPClassifier(hidden_layer_sizes=(8,), activation="tanh", max_iter=50, random_state=0).fit(x, labels)
    return _skl(model, 5, {"zipmap": False})


def skl_pca():
    from sklearn.decomposition import PCA

    x, _, _ = _sklearn_data(6)
    return _skl(PCA(n_components=3, random_state=0).fit(x), 6)


def skl_logistic_regression():
    from sklearn.linear_model import LogisticRegression

    x, _, labels = _sklearn_data(5)
    return _skl(LogisticRegression().fit(x, labels), 5, {"zipmap": False})


def _spox_weight(rng, *shape):
    import numpy as np
    import spox.opset.ai.onnx.v17 as op

    return op.constant(value=(rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))


def spox_attention():
    """One self-attention block with a residual and LayerNormalization, weights as spox constants."""
    import numpy as np
    import spox.opset.ai.onnx.v17 as op
    from spox import Tensor, argument, build

    rng = np.random.default_rng(1)
    x = argument(Tensor(np.float32, (2, 4, 8)))
    normed = op.layer_normalization(x, _spox_weight(rng, 8), _spox_weight(rng, 8), axis=-1)[0]
    q, k, v = (op.matmul(normed, _spox_weight(rng, 8, 8)) for _ in range(3))
    scores = op.div(op.matmul(q, op.transpose(k, perm=[0, 2, 1])), op.constant(value=np.float32(np.sqrt(8))))
    attended = op.matmul(op.softmax(scores, axis=-1), v)
    y = op.add(x, op.matmul(attended, _spox_weight(rng, 8, 8)))
    return build({"x": x}, {"y": y})


def spox_mlp_gelu():
    """A two-layer MLP with tanh-approximated GELU written out (Pow, Tanh) and Gemm."""
    import numpy as np
    import spox.opset.ai.onnx.v17 as op
    from spox import Tensor, argument, build

    rng = np.random.default_rng(2)
    x = argument(Tensor(np.float32, (3, 6)))
    h = op.gemm(x, _spox_weight(rng, 6, 10), _spox_weight(rng, 10))
    c = op.constant(value=np.float32(np.sqrt(2 / np.pi)))
    inner = op.mul(c, op.add(h, op.mul(op.constant(value=np.float32(0.044715)), op.pow(h, op.constant(value=np.float32(3))))))
    gelu = op.mul(op.mul(op.constant(value=np.float32(0.5)), h), op.add(op.constant(value=np.float32(1)), op.tanh(inner)))
    y = op.gemm(gelu, _spox_weight(rng, 10, 2), _spox_weight(rng, 2), transB=0)
    return build({"x": x}, {"y": y})


def onnxscript_cnn():
    from onnxscript_models import onnxscript_cnn as make

    return make()


def onnxscript_gru():
    from onnxscript_models import onnxscript_gru as make

    return make()


def _package_file(package: str, member: str) -> Path:
    module = __import__(package)
    return Path(module.__file__).parent / member


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name.split("==")[0]: version(name.split("==")[0]) for name in EXPORTERS if name != "numpy"}


def build(cache: Path) -> None:
    """Inside the wild venv: fetch, export and write the manifest."""
    import onnx

    versions = _versions()
    (cache / "wheels").mkdir(parents=True, exist_ok=True)
    FILES.mkdir(exist_ok=True)
    manifest = {}
    for name, spec in SPECS.items():
        if "wheel" in spec:
            package, version = spec["wheel"], WHEELS[spec["wheel"]]
            wheels = list((cache / "wheels").glob(f"{package.replace('-', '_')}-{version}-*.whl"))
            if not wheels:
                subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache / "wheels"),
                                f"{package}=={version}"], check=True)
                wheels = list((cache / "wheels").glob(f"{package.replace('-', '_')}-{version}-*.whl"))
            path = cache / f"{name}.onnx"
            with zipfile.ZipFile(wheels[0]) as wheel:
                path.write_bytes(wheel.read(spec["member"]))
            source, location = f"{package} {version} wheel: {spec['member']}", "cache"
        elif "package" in spec:
            path = cache / f"{name}.onnx"
            shutil.copyfile(_package_file(spec["package"], spec["member"]), path)
            source = f"{spec['package']} {versions[spec['package']]}: {spec['member']}"
            location = "cache"
        else:
            path = FILES / f"{name}.onnx"
            model = globals()[spec["build"]]()
            model.producer_name = model.producer_name or spec["exporter"]
            onnx.save(model, path)
            source, location = f"built by tests/wild/build.py ({spec['build']})", "files"
        exporter = spec["exporter"]
        if location == "files":  # exported here: the exporter's version is the venv's
            exporter = f"{exporter} {versions[exporter]}"
        manifest[name] = {"file": path.name, "location": location, "source": source, "exporter": exporter,
                          "sha256": sha256(path), "bytes": path.stat().st_size,
                          **{k: spec[k] for k in ("inputs", "constant_inputs", "output", "options", "weights")
                             if k in spec},
                          "loss": spec.get("loss", "mse")}
        print(f"{name}: {path.stat().st_size} bytes")
    old = json.loads(MANIFEST.read_text()) if MANIFEST.exists() else {}
    for name, entry in manifest.items():  # keep what the tier measured and expects
        entry["expected"] = old.get(name, {}).get("expected", {"result": "unchecked"})
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inside:
        build(args.cache)
        return
    python = args.venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(args.venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *EXPORTERS], check=True)
    subprocess.run([str(python), __file__, "--inside", "--cache", str(args.cache)], check=True)


if __name__ == "__main__":
    main()
