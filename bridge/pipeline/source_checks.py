"""Signs that an ONNX model was exported for inference, so that its training graph would train a
different model than the torch module it came from (docs/from_pytorch.md).

What the exporters do:

- ``torch.onnx.export`` defaults (dynamo exporter, ``optimize=True``) fold BatchNorm into the
  preceding Conv, whose fused bias is named ``<conv weight>_bias``; the TorchScript exporter's
  defaults (``dynamo=False``: eval mode, constant folding) give both ``onnx::Conv_<N>``.
- both rename weights they transpose or fold (``onnx::MatMul_<N>``, ``val_<N>``);
- the dynamo optimizer folds values computed from weights alone into constants named after the
  op (position and token-type lookups ``embedding_<N>``, layer scales ``view_<N>``, a class
  token ``expand``): those weights are gone.

None of these appears in an export made with the settings that keep everything
(``bridge.export_for_training``, ``do_constant_folding=False``, ``optimize=False``).
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import onnx

from ..errors import BridgeError, BridgeWarning

EXPORTER_NAME = re.compile(r"^(onnx::\w+?_\d+|_?val_\d+)$")
# the dynamo optimizer names a folded value after the FX node it replaces: the op, then _<N>
FOLDED = re.compile(r"^(embedding|view|expand|reshape|unsqueeze|permute|transpose|t|select|slice|index)(_\d+)?$")
KEEP_ALL = ("export the module with bridge.export_for_training(module, example_inputs, path), i.e. "
            "torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False) "
            "or torch.onnx.export(..., dynamo=True, optimize=False), or pass the module itself to to_training_onnx")
SHOWN = 3  # names quoted per finding


class InferenceExportWarning(BridgeWarning):
    """The ONNX model was exported for inference: part of the torch model would not be trained."""


class InferenceExportError(BridgeError):
    """``strict=True``: the ONNX model shows signs of an inference-optimized export."""


@dataclass(frozen=True)
class Finding:
    """One sign of an inference-optimized export: what was lost, and the values that show it."""

    lost: str
    names: list[str]

    def __str__(self) -> str:
        more = f" and {len(self.names) - SHOWN} more" if len(self.names) > SHOWN else ""
        return f"{self.lost} ({', '.join(self.names[:SHOWN])}{more})"


def find_inference_export(model: onnx.ModelProto) -> list[Finding]:
    """The signs of an inference-optimized export in ``model`` (empty for a training-ready export)."""
    weights = {init.name: init for init in model.graph.initializer if _is_weight(init)}
    folded_convs = _batchnorm_folded(model, weights)
    folded_convs += [name for name in _batchnorm_fused_by_rewriter(model) if name not in folded_convs]
    findings = []
    if folded_convs:
        findings.append(Finding(f"BatchNorm folded into {len(folded_convs)} Conv node(s): its scale, shift and "
                                "running statistics would not be trained or updated", folded_convs))
    in_convs = {name for node in model.graph.node if node.op_type == "Conv" for name in node.input[1:3]}
    renamed = [name for name in weights if EXPORTER_NAME.match(name) and not (folded_convs and name in in_convs)]
    if renamed:
        findings.append(Finding(f"{len(renamed)} weight(s) renamed by the exporter: trained, but not under "
                                "their torch names (grad_*, checkpoints)", renamed))
    folded = [name for name in weights if FOLDED.match(name)]
    if folded:
        findings.append(Finding("lookups and views of weights folded into constants: the weights they read "
                                "(embedding rows, layer scales, class tokens) would not be trained", folded))
    return findings


def check_export(model: onnx.ModelProto, strict: bool = False) -> None:
    """Warn (``InferenceExportWarning``) or, with ``strict``, raise (``InferenceExportError``) when
    ``model`` shows signs of an inference-optimized export."""
    findings = find_inference_export(model)
    if not findings:
        return
    message = ("the ONNX model looks exported for inference: " + "; ".join(map(str, findings))
               + f". To train what torch trains, {KEEP_ALL} (docs/from_pytorch.md)")
    if strict:
        raise InferenceExportError(message)
    warnings.warn(message, InferenceExportWarning, stacklevel=3)


def _is_weight(init: onnx.TensorProto) -> bool:
    """A floating-point initializer with more than one element (exporters also name scalars)."""
    floating = init.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                  onnx.TensorProto.BFLOAT16)
    size = 1
    for dim in init.dims:
        size *= dim
    return floating and size > 1


def _batchnorm_folded(model: onnx.ModelProto, weights: dict) -> list[str]:
    """Conv nodes that carry a BatchNorm folded in by an exporter: a fused bias named
    ``<weight>_bias`` (dynamo optimizer) or a weight and bias named ``onnx::Conv_<N>`` (TorchScript
    exporter, eval mode with constant folding)."""
    folded = []
    for node in model.graph.node:
        if node.op_type != "Conv" or len(node.input) < 3 or node.input[2] not in weights:
            continue
        weight, bias = node.input[1], node.input[2]
        if bias == f"{weight}_bias" or (EXPORTER_NAME.match(weight) and EXPORTER_NAME.match(bias)):
            folded.append(node.name or weight)
    return folded


REWRITER_RULE = "pkg.onnxscript.rewriter.rule_name"


def _batchnorm_fused_by_rewriter(model: onnx.ModelProto) -> list[str]:
    """Nodes whose metadata says the exporter's optimizer fused a BatchNorm into them (torch.onnx's default
    export records each onnxscript rewrite rule it applied, such as ``FuseBatchNormIntoConv``)."""
    return [node.name or node.output[0] for node in model.graph.node
            for prop in node.metadata_props if prop.key == REWRITER_RULE and "FuseBatchNorm" in prop.value]
