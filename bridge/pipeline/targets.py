"""Target forms: the runtime-specific forms of the training graph, one table for every target.

The conversion's canonical graph (target ``plain``) has only the forms that correctness and onnx-mlir/IREE
acceptance need (no ConvTranspose with a computed weight, no MaxPool Indices, reductions with
``keepdims=1``, ...). A target adds the forms measured faster on its runtime; each form is exact (the
same values as the plain one, up to float32 summation order) and named in ``FORMS`` with why.

How they apply: most forms are chosen while tracing (the conv lowerings, the importer's Relu/MaxPool
order) or emitting (``affine``), so the "pass" is a setting those stages read: ``using(target)`` makes
a target current (a context variable, around tracing and export), ``enabled(form)`` asks it. One form,
``scalar_ranks``, is a post-pass on the exported ONNX graph (bridge/pipeline/broadcast.py). Outside a
conversion the current target is ``DEFAULT_TARGET``.

The conv rules below (``conv_*_form``) pick, per shape, the onnxruntime form (docs/lowerings/conv_pool.md
has the measurements behind them), or ``dense_conv_as_matmul``'s MatMul forms for every ungrouped Conv.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence

from ..errors import InvalidOptionError

FORMS: dict[str, str] = {  # form -> why a target uses it
    "conv_forward_gemm": "a Conv with a tiny output plane as one MatMul over the batch: onnxruntime's Conv runs "
                         "one GEMM per sample, each reading the whole weight",
    "conv_backward_gemm": "a Conv's input and weight gradients by im2col/col2im MatMuls where the shape rules "
                          "find them faster than the Conv forms in onnxruntime",
    "constant_matmul_moves": "zero insertion, interleave and kernel flip of an innermost axis as MatMuls with "
                             "constant 0/1 matrices: onnxruntime moves such axes element by element "
                             "(an infinity then makes its row NaN)",
    "affine_as_batch_norm": "x * scale + bias per channel as an inference BatchNormalization: one pass in "
                            "onnxruntime instead of a Mul and an Add, bit for bit",
    "scalar_ranks": "a one-element operand given the rank of the tensor it broadcasts against: onnxruntime's "
                    "CPU broadcaster otherwise calls its kernel once per element",
    "relu_after_maxpool": "MaxPool(Relu(x)) run as Relu(MaxPool(x)): the Relu and its backward mask on the "
                          "pooled tensor (same values and gradients)",
    "dense_conv_as_matmul": "every ungrouped Conv's forward, input gradient and weight gradient as im2col/col2im "
                            "MatMuls: onnx-mlir lowers a Conv to scalar loops, many times slower than its "
                            "tiled MatMul (tests/repros/onnx_mlir_conv_speed.py), and IREE's direct Conv "
                            "codegen does twice to three times the MatMuls' work; grouped Convs stay Convs",
    "conv_forward_rows": "an ungrouped Conv's forward im2col product with the output positions as rows, "
                         "columns [N*O, Cin*K] @ weight^T [Cin*K, Cout], where N*O is not small: onnx-mlir's and "
                         "IREE's tiled MatMuls run the weight-rows product [Cout, Cin*K] @ [Cin*K, N*O] (few rows, "
                         "many columns) several times slower",
    "conv_columns_in_parts": "an ungrouped Conv's im2col columns, where larger than both its input and its output, "
                             "made and multiplied a part at a time, each no larger than the larger of the two: the "
                             "forward's per range of output positions (one Gather each), the input gradient's per "
                             "kernel offset, the weight gradient's per group of kernel offsets: onnx-mlir allocates "
                             "every value and frees it after its last reader, in graph order, so whole columns (K "
                             "times the input) would set the step's peak",
    "long_inner_gemm": "a 2-D float product with a long inner dimension and not few result columns as a Gemm, its "
                       "operands as they are (conv_forward_rows: the weight read transposed, transB): onnx-mlir's Gemm "
                       "runs such a product several times faster than its MatMul, and slower where either is short",
    "explicit_transposes": "a 2-D float product reading an operand transposed, with an inner dimension and result "
                           "columns not short, reads the Transpose's output instead: always the first operand (a "
                           "Linear's weight gradient g^T @ x), the second where the inner dimension is not long (then "
                           "a MatMul): onnx-mlir's Gemm with transA, or with transB at such an inner dimension, runs "
                           "slower than the Transpose and the plain product together",
    "recompute_from_kept": "a forward value the backward reads, recomputed by arithmetic and casts right before "
                           "that read from values the step keeps alive anyway (bridge/pipeline/remat.py): onnx-mlir "
                           "and bridge's onnxruntime sessions allocate each value when it is computed and free it "
                           "after its last reader, so the forward's copy no longer lives through the backward (a "
                           "transformer's GELU and LayerNorm intermediates)",
    "tanh_as_exp": "a float32 Tanh as 1 - 2 / (exp(2x) + 1), and as its Taylor polynomial where |x| < 0.55 (within "
                   "2 float32 rounding units of tanh): onnx-mlir calls the C library element by element for both, and "
                   "the C library's expf is several times faster than its tanhf",
}

TARGETS: dict[str, frozenset[str]] = {  # target -> the forms it uses
    "plain": frozenset(),
    "onnxruntime": frozenset(FORMS) - {"dense_conv_as_matmul", "conv_forward_rows", "conv_columns_in_parts",
                                       "long_inner_gemm", "tanh_as_exp", "explicit_transposes"},  # its rules pick per shape
    "iree": frozenset({"dense_conv_as_matmul", "conv_forward_rows"}),
    "onnx-mlir": frozenset({"dense_conv_as_matmul", "conv_forward_rows", "conv_columns_in_parts", "long_inner_gemm",
                            "tanh_as_exp", "explicit_transposes", "relu_after_maxpool", "recompute_from_kept"}),
}

DEFAULT_TARGET = "onnxruntime"  # what bridge.to_training_onnx and bridge convert emit unless told otherwise

_CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("bridge_target", default=DEFAULT_TARGET)


def check_target(target: str) -> str:
    """``target`` if it names a target, else ``InvalidOptionError`` listing them."""
    if not isinstance(target, str) or target not in TARGETS:
        raise InvalidOptionError(f"target={target!r} is not a target; choose one of {sorted(TARGETS)} "
                                 f"(default {DEFAULT_TARGET!r})")
    return target


@contextlib.contextmanager
def using(target: str) -> Iterator[None]:
    """Within it, ``target`` is the current target (``enabled`` answers for it)."""
    token = _CURRENT.set(check_target(target))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> str:
    return _CURRENT.get()


def enabled(form: str) -> bool:
    """Whether the current target uses ``form`` (a key of ``FORMS``)."""
    if form not in FORMS:
        raise KeyError(f"unknown target form {form!r}; forms: {sorted(FORMS)}")
    return form in TARGETS[_CURRENT.get()]


# -- the onnxruntime conv rules (applied while the current target enables the conv forms) ----------------------

def select_is_cheap(out_channels: int, sizes: Sequence[int]) -> bool:
    """A selection-matrix MatMul (``lowering.conv.scatter_matrix``) costs ``L / Cout`` of the MatMul it feeds
    (or is fed by): worth it while the input plane is small against the channels."""
    return math.prod(sizes) * 8 <= out_channels


def conv_forward_form(groups: int, kernel: Sequence[int], outputs: Sequence[int]) -> str:
    """``conv`` (an ONNX Conv) or ``gemm`` (one MatMul over the batch's columns) for a Conv's forward:
    ``gemm`` where the output plane is tiny (``O <= 4``) and ``conv_forward_gemm`` is enabled, or the Conv is
    ungrouped and ``dense_conv_as_matmul`` is enabled."""
    if groups == 1 and enabled("dense_conv_as_matmul"):
        return "gemm"
    tiny = groups == 1 and math.prod(kernel) > 1 and math.prod(outputs) <= 4
    return "gemm" if tiny and enabled("conv_forward_gemm") else "conv"


ROWS_AT_LEAST = 64  # conv_forward_rows: fewer output positions (N*O) than this keep the weight rows
LONG_INNER = 256  # long_inner_gemm: the inner dimension from which a product is a Gemm ...
GEMM_COLUMNS = 64  # ... if its result has this many columns at least


def product_is_gemm(inner: object, columns: object) -> bool:
    """Whether a 2-D float product of inner dimension ``inner`` and ``columns`` result columns is a Gemm under
    ``long_inner_gemm``; a symbolic size (not an int) keeps the MatMul."""
    return (isinstance(inner, int) and isinstance(columns, int) and inner >= LONG_INNER and columns >= GEMM_COLUMNS
            and enabled("long_inner_gemm"))


TRANSPOSED_INNER = 128  # explicit_transposes: the shortest inner dimension at which a transposed operand is run


def runs_transposes(inner: object, columns: object) -> bool:
    """Whether a 2-D float product of inner dimension ``inner`` and ``columns`` result columns reads a transposed
    operand from its Transpose under ``explicit_transposes``: ``TRANSPOSED_INNER`` inner and ``GEMM_COLUMNS``
    result columns at least; a symbolic size keeps ``transA``/``transB``."""
    return (isinstance(inner, int) and isinstance(columns, int) and inner >= TRANSPOSED_INNER
            and columns >= GEMM_COLUMNS and enabled("explicit_transposes"))


def conv_forward_product(positions: int, inner: int, out_channels: int) -> str:
    """How a ``gemm`` Conv forward multiplies ``N*O`` (``positions``) columns of ``Cin*K`` (``inner``) by the
    weight: ``weight_rows`` (``weight [Cout, Cin*K] @ columns [Cin*K, N*O]``), ``rows_matmul`` (``columns
    [N*O, Cin*K] @`` the weight transposed once) or ``rows_gemm`` (the same as a Gemm with ``transB``)."""
    if not enabled("conv_forward_rows") or positions < ROWS_AT_LEAST:
        return "weight_rows"
    return "rows_gemm" if product_is_gemm(inner, out_channels) else "rows_matmul"


def column_parts(in_channels: int, out_channels: int, kernel: Sequence[int], outputs: Sequence[int],
                 sizes: Sequence[int]) -> int:
    """Into how many parts ``conv_columns_in_parts`` cuts an ungrouped Conv's im2col columns (``Cin*K`` values per
    output position; ``sizes``: the input's spatial sizes): the fewest parts of which none is larger than the larger
    of the Conv's input and output, which every form holds anyway; 1 without that form."""
    if not enabled("conv_columns_in_parts"):
        return 1
    positions = math.prod(outputs)
    held = max(in_channels * math.prod(sizes), out_channels * positions)
    return -(-in_channels * math.prod(kernel) * positions // held)


def _backward_form_before_shapes(groups: int) -> str | None:
    """The form of a Conv's input or weight gradient that no shape changes: ``gemm`` for an ungrouped Conv under
    ``dense_conv_as_matmul``, ``conv`` for a grouped one or without ``conv_backward_gemm``; None: the shape decides."""
    if groups == 1 and enabled("dense_conv_as_matmul"):
        return "gemm"
    if groups != 1 or not enabled("conv_backward_gemm"):
        return "conv"
    return None


def conv_input_grad_form(in_channels: int, out_channels: int, groups: int, kernel: Sequence[int],
                         outputs: Sequence[int], stride: Sequence[int], sizes: Sequence[int]) -> str:
    """``conv``, ``gemm``, ``gemm_offsets`` or ``gemm_select`` for a Conv's input gradient (lowering/conv.py).

    ``conv`` flips and transposes the whole weight and, strided, convolves a zero-inserted gradient;
    ``gemm`` pays a per-offset scatter of input size. ``gemm`` wins once the weight dominates
    (``Cout >= 16 * O``) or the Conv is strided; ``gemm_select`` does its scatter as one MatMul
    while the input plane is small (``select_is_cheap``). ``dense_conv_as_matmul``: ``gemm`` (groups 1), or
    ``gemm_offsets`` (one product per kernel offset, each about the input's size) where ``column_parts`` cuts the
    columns."""
    if (form := _backward_form_before_shapes(groups)) is not None:
        if form == "gemm" and column_parts(in_channels, out_channels, kernel, outputs, sizes) > 1:
            return "gemm_offsets"
        return form
    if out_channels >= 16 * math.prod(outputs) or max(stride) > 1:
        return "gemm_select" if select_is_cheap(out_channels, sizes) else "gemm"
    return "conv"


OFFSET_COLUMNS_BELOW = 256  # conv weight gradient: a gather product with fewer columns (K*Cin) is split per offset


def conv_weight_grad_form(in_channels: int, out_channels: int, groups: int, kernel: Sequence[int],
                          outputs: Sequence[int], stride: Sequence[int], sizes: Sequence[int],
                          forward_product: str | None = None) -> str:
    """``conv``, ``gather``, ``gather_offsets``, ``gather_parts``, ``gemm`` or ``gemm_channel_first`` for a Conv's
    weight gradient (lowering/conv.py).

    ``conv``'s inner dimension is the batch, the im2col forms' ``N * O``. Few input channels (an RGB
    stem): ``gemm_channel_first`` at stride 1, else ``conv``. A 1x1 kernel: ``gemm`` (its one window is a
    strided slice). Else ``gather``: the columns by one Gather of whole channel rows, one MatMul; where the
    product is narrow (``K*Cin`` below ``OFFSET_COLUMNS_BELOW``, the columns many times the weight gradient)
    ``gather_offsets``: a Gather and a MatMul per kernel offset, so that a ``K``-th of the columns is alive at a
    time. Grouped Convs keep ``conv``. ``dense_conv_as_matmul``: ``gemm`` (groups 1), but ``gather`` where
    ``forward_product`` (this Conv's own forward, ``conv_forward_product``; None for a transposed Conv) reads the
    channels-last columns ``[N*O, Cin*K]`` and the kernel has several offsets: ``gemm`` would build those very
    columns, which common subexpression elimination (bridge's, onnx-mlir's, IREE's) merges with the forward's and
    keeps alive until the backward at ``K`` times the input's size; ``gather``'s die in the backward. And
    ``gather_parts`` where ``column_parts`` cuts the columns: a part per group of kernel offsets (the forward's
    parts are ranges of output positions: no part is the forward's)."""
    if (form := _backward_form_before_shapes(groups)) is not None:
        if form == "gemm" and math.prod(kernel) > 1:
            if column_parts(in_channels, out_channels, kernel, outputs, sizes) > 1:
                return "gather_parts"
            if forward_product in ("rows_gemm", "rows_matmul"):
                return "gather"
        return form
    if math.prod(kernel) == 1:
        return "gemm"
    if in_channels < 16:
        return "gemm_channel_first" if all(s == 1 for s in stride) else "conv"
    return "gather_offsets" if math.prod(kernel) * in_channels < OFFSET_COLUMNS_BELOW else "gather"
