"""The ``bridge`` command line: ``bridge convert``, ``bridge verify``, ``bridge check``, ... (``bridge --help``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings

from .errors import BridgeError, InvalidOptionError
from .pipeline.targets import DEFAULT_TARGET, TARGETS
from .tools.compile import BACKENDS
from .tools.target_check import TARGETS as CHECK_TARGETS


def _json_option(text: str | None, flag: str) -> dict | None:
    """A ``--*-options`` value: a JSON object, or a one-line error naming the flag."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidOptionError(f"{flag}: not valid JSON ({exc}): {text}") from exc
    if not isinstance(value, dict):
        raise InvalidOptionError(f"{flag}: give a JSON object such as '{{\"lr\": 0.01}}', got {text}")
    return value


def _training_options(args: argparse.Namespace) -> dict:
    """The loss, optimizer and batch options that ``convert`` and ``verify`` share."""
    return {"loss": args.loss, "optim": args.optim, "batch_size": args.batch_size, "batch_norm": args.batch_norm,
            "loss_options": _json_option(args.loss_options, "--loss-options"),
            "optim_options": _json_option(args.optim_options, "--optim-options")}


def _add_batch_norm(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-norm", choices=["train", "frozen"],
                        help="train (the default) or frozen: BatchNorm normalizes with its running statistics, "
                             "which stay fixed, as torch's BatchNorm in eval() (fine-tuning; docs/finetuning.md)")


def _number(text: str, item: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise InvalidOptionError(f"--constant-input: '{text}' in '{item}' is not a number; give NAME=VALUE "
                                     "such as flag=1 or scale=0.5,2") from None


def _constant_inputs(items: list[str] | None) -> dict[str, int | float | list] | None:
    """``--constant-input flag=1 --constant-input bias=0.5,2`` -> ``{"flag": 1, "bias": [0.5, 2]}``."""
    if not items:
        return None
    values = {}
    for item in items:
        name, _, text = item.partition("=")
        if not name or not text:
            raise InvalidOptionError(f"--constant-input: give NAME=VALUE such as flag=1 (a comma list for a "
                                     f"vector), got '{item}'")
        parts = [_number(p.strip(), item) for p in text.split(",")]
        values[name] = parts if "," in text else parts[0]
    return values


def _input_shapes(items: list[str] | None) -> dict[str, list[int]] | None:
    """``--input-shapes input_ids=2x12 mask=2x12`` -> ``{"input_ids": [2, 12], "mask": [2, 12]}``."""
    if not items:
        return None
    shapes = {}
    for item in items:
        name, _, dims = item.rpartition("=")
        try:
            shapes[name] = [int(d) for d in dims.split("x")] if dims else []
        except ValueError:
            name = ""
        if not name:
            raise InvalidOptionError(f"--input-shapes: give NAME=DIMxDIM... such as input_ids=2x12, got '{item}'")
    return shapes


def _dynamic_dims(args: argparse.Namespace) -> bool | dict | None:
    """``--dynamic`` (every symbolic dim of the model) or ``--dynamic-dims`` (a JSON object of
    input -> {axis: dim name} or [axes]) as ``to_training_onnx``'s ``dynamic_dims``."""
    if args.dynamic_dims is None:
        return True if args.dynamic else None
    if args.dynamic:
        raise InvalidOptionError("give --dynamic or --dynamic-dims, not both")
    spec = _json_option(args.dynamic_dims, "--dynamic-dims")
    try:
        return {name: axes if isinstance(axes, list) else {int(axis): dim for axis, dim in axes.items()}
                for name, axes in spec.items()}
    except (AttributeError, ValueError) as exc:
        raise InvalidOptionError("--dynamic-dims: give a JSON object of input -> {axis: dim name} such as "
                                 f"'{{\"input_ids\": {{\"0\": \"batch\", \"1\": \"seq\"}}}}', got {args.dynamic_dims}") from exc


def _convert(args: argparse.Namespace) -> int:
    from .api import to_training_onnx
    from .atomic import check_output_path
    from .errors import BridgeWarning
    from .pipeline import progress
    from .training.training_model import state_file

    state_path = args.state or str(state_file(args.output))
    for path, flag in ((args.output, "-o"), (state_path, "--state")):
        check_output_path(path, flag)
        if os.path.abspath(path) == os.path.abspath(args.model):
            raise InvalidOptionError(f"{flag} {path} is the input model: writing there would replace the source; "
                                     "give another file name")
    with warnings.catch_warnings(record=True) as caught, progress.report(sys.stderr):
        warnings.simplefilter("default")
        tm = to_training_onnx(
            args.model,
            **_training_options(args),
            clip_grad_norm=args.clip_grad_norm,
            output=args.model_output,
            trainable=args.trainable,
            frozen=args.frozen,
            strict=args.strict,
            dynamic_dims=_dynamic_dims(args),
            input_shapes=_input_shapes(args.input_shapes),
            constant_inputs=_constant_inputs(args.constant_input),
            target=args.target,
            lora=_json_option(args.lora, "--lora"),
            precision=args.precision,
            grad_scaler_options=_json_option(args.grad_scaler_options, "--grad-scaler-options"),
            memory=args.memory,
        )
    for warning in caught:
        if issubclass(warning.category, BridgeWarning):
            print(f"bridge: warning: {warning.message}", file=sys.stderr)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    tm.save(args.output, state_path=state_path)
    print(f"wrote {args.output} ({len(tm.model.graph.node)} nodes, {len(tm.weights)} trainable weights) and {state_path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from .tools.verify import verify

    report = verify(
        args.model,
        **_training_options(args),
        steps=args.steps,
        seed=args.seed,
        tolerance_factor=args.tolerance_factor,
    )
    print(report)
    return 0 if report.passed else 1


def _compile(args: argparse.Namespace) -> int:
    from .tools.compile import compile as compile_model

    def progress(line: str) -> None:
        print(f"bridge compile: {line}", file=sys.stderr, flush=True)

    compiled = compile_model(args.model, backend=args.backend, output=args.output, target_cpu=args.target_cpu,
                             progress=progress, gradients=not args.no_gradients, timeout=args.timeout,
                             pieces=_pieces_option(args.pieces))
    from .training.runtime_onnx_mlir import is_pieces_archive

    pieces = ", a zip of the pieces' .so files" if is_pieces_archive(compiled.module) else ""
    print(f"wrote {args.output} ({len(compiled.module)} bytes{pieces}, compiled in {compiled.seconds:.1f} s)")
    return 0


def _pieces_option(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise InvalidOptionError(f"--pieces {text!r} is not valid; give a number of pieces >= 1, or auto") from None


def _mlir(args: argparse.Namespace) -> int:
    from .atomic import write_text
    from .tools.compile import to_mlir

    write_text(args.output, to_mlir(args.model), "-o")
    print(f"wrote {args.output}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from . import ir
    from .atomic import write_text
    from .tools.show import summary, to_html

    graph = ir.load(args.model)
    print(summary(graph), end="")
    if args.html:
        write_text(args.html, to_html(graph), "--html")
        print(f"\nwrote {args.html}")
    return 0


def _check(args: argparse.Namespace) -> int:
    from .tools.target_check import check, iree_installed, onnx_mlir_missing

    compiling = not args.no_compile
    if compiling and args.target == "iree" and not iree_installed():
        print("IREE is not installed (pip install 'bridge[iree]'): known patterns checked, no compile run",
              file=sys.stderr)
    missing = onnx_mlir_missing() if compiling and args.target == "onnx-mlir" else None
    if missing:
        print(f"op table only: onnx-mlir not found (ONNX_MLIR_HOME or PATH), no compile run: {missing}", file=sys.stderr)

    def progress(line: str) -> None:
        print(f"bridge check: {line}", file=sys.stderr, flush=True)

    violations = check(args.model, target=args.target, compile=compiling, progress=progress)
    for violation in violations:
        print(violation)
    print(f"{args.model}: {len(violations)} violation(s) for {args.target}")
    return 1 if violations else 0


def _train(args: argparse.Namespace) -> int:
    """Train in this process, in ``--nproc`` local processes, or as one rank of a torchrun job."""
    from .training.distributed import launched_by_torchrun, run_local

    if args.nproc is not None:
        if launched_by_torchrun():
            raise InvalidOptionError("--nproc starts its own processes: leave it out under torchrun "
                                     "(torchrun --nproc-per-node N -m bridge train ... starts them)")
        run_local(_train_rank, args.nproc, (args,), timeout=args.timeout)
        return 0
    return _train_rank(args)


def _train_rank(args: argparse.Namespace) -> int:
    """One training run; data-parallel (a ``DataParallelTrainer``) inside a process group, where
    only rank 0 prints and writes files."""
    import numpy as np

    from .training.distributed import DataParallelTrainer, init_from_environment
    from .training.trainer import Trainer

    options = {"schedule": args.schedule, "seed": args.seed, "accumulation_steps": args.accumulation_steps,
               "schedule_options": _json_option(args.schedule_options, "--schedule-options")}
    if init_from_environment(args.timeout):
        trainer = DataParallelTrainer(args.model, backend=args.backend, timeout=args.timeout, progress=True,
                                      **options)
    else:
        trainer = Trainer(args.model, backend=args.backend, progress=True, **options)
    leader = getattr(trainer, "rank", 0) == 0
    if args.resume:
        trainer.load_checkpoint(args.resume)
    with np.load(args.data) as saved:
        arrays = {name: saved[name] for name in saved.files}
    if "target" not in arrays:
        raise InvalidOptionError(f"{args.data} has no 'target' array (it holds {sorted(arrays)})")
    target = arrays.pop("target")
    trainer.fit((arrays, target), epochs=args.epochs, batch_size=args.batch_size)
    trainer.save_checkpoint(args.checkpoint)
    if not leader:
        return 0
    print(f"wrote {args.checkpoint} (epoch {trainer.epoch}, loss {trainer.history['loss'][-1]:.4g})")
    if args.plot:
        from .training.plot import plot_history

        print(f"wrote {plot_history({'bridge': trainer.history}, args.plot, title=args.model)}")
    return 0


def _export_inference(args: argparse.Namespace) -> int:
    from .onnx_file import read_model
    from .training.inference import from_checkpoint
    from .training.training_model import save_atomically

    model = from_checkpoint(read_model(args.source), read_model(args.train), args.checkpoint, merge=not args.unmerged)
    save_atomically(model, args.output)
    print(f"wrote {args.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bridge", description="Inference ONNX -> training-step ONNX.")
    parser.add_argument("--debug", action="store_true", help="on an error, also print its Python traceback")
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert an inference model into a training-step model")
    convert.add_argument("model", help="input .onnx file, or a saved torch.export.ExportedProgram (.pt2, "
                         "docs/from_pytorch.md)")
    convert.add_argument("-o", "--output", required=True, help="output training .onnx file")
    convert.add_argument("--loss", default="mse", help="loss name (default mse)")
    convert.add_argument("--optim", default="sgd", help="optimizer name (default sgd)")
    convert.add_argument("--loss-options", help="JSON object of torch loss keyword arguments")
    convert.add_argument("--optim-options", help="JSON object of torch.optim keyword arguments (lr, betas, ...)")
    convert.add_argument("--clip-grad-norm", type=float, metavar="MAX_NORM",
                         help="clip gradients by global L2 norm before the update (torch.nn.utils.clip_grad_norm_)")
    convert.add_argument("--model-output", help="the model output the loss applies to (default: the first)")
    convert.add_argument("--trainable", nargs="*", help="names or glob patterns of the weights to train")
    convert.add_argument("--frozen", nargs="*", help="names or glob patterns of weights not to train")
    convert.add_argument("--batch-size", type=int, help="batch size for a symbolic batch dim")
    convert.add_argument("--dynamic", action="store_true",
                         help="keep symbolic every dim the model has symbolic (batch, sequence length, ...; dim 0 "
                              "named batch), so one file trains at any size of them (docs/dynamic_batch.md)")
    convert.add_argument("--dynamic-dims", metavar="JSON",
                         help="the symbolic dims, a JSON object of input -> {axis: dim name}, e.g. "
                              "'{\"input_ids\": {\"0\": \"batch\", \"1\": \"seq\"}}'")
    convert.add_argument("--input-shapes", nargs="+", metavar="NAME=DIMS",
                         help="shapes to trace at, e.g. input_ids=2x12 (needed for symbolic dims other than the "
                              "batch that stay static; a symbolic dim is traced at 2 or more)")
    convert.add_argument("--constant-input", action="append", metavar="NAME=VALUE",
                         help="pin a graph input to a value (repeatable): flag=1, or a comma list such as "
                              "scale=0.5,2; the input becomes a constant, so an If on it and shapes from it fold")
    convert.add_argument("--lora", metavar="JSON", help="train LoRA adapters, not the weights: a JSON object such as "
                         "'{\"rank\": 8, \"alpha\": 16, \"targets\": [\"*attn*\"]}' (docs/lora.md)")
    convert.add_argument("--state", help="where to write the initial state (.npz; default next to the output)")
    convert.add_argument("--strict", action="store_true",
                         help="fail (instead of warning) on an ONNX model exported for inference (BatchNorm folded, "
                              "parameters renamed; docs/from_pytorch.md)")
    convert.add_argument("--target", default=DEFAULT_TARGET, choices=list(TARGETS),
                         help=f"the runtime whose measured forms the graph uses (default {DEFAULT_TARGET}; plain: "
                              "none, the canonical graph)")
    convert.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"],
                         help="mixed precision: compute where torch's autocast would, with GradScaler's dynamic loss "
                              "scaling (docs/finetuning.md)")
    convert.add_argument("--grad-scaler-options", help="JSON object of torch.amp.GradScaler keyword arguments "
                                                       "(init_scale, growth_factor, backoff_factor, growth_interval)")
    convert.add_argument("--memory", default="default", choices=["default", "min"],
                         help="min: the backward recomputes cheap forward values instead of keeping them "
                              "(the same results, a lower peak memory; docs/finetuning.md)")
    _add_batch_norm(convert)
    convert.set_defaults(run=_convert)

    verify = commands.add_parser("verify", help="convert and compare the first training steps with eager PyTorch "
                                 "(float64, torch.optim); exit 1 on a mismatch")
    verify.add_argument("model", help="input .onnx file")
    verify.add_argument("--loss", default="ce", help="loss name (default ce)")
    verify.add_argument("--optim", default="adam", help="optimizer name (default adam)")
    verify.add_argument("--loss-options", help="JSON object of torch loss keyword arguments")
    verify.add_argument("--optim-options", help="JSON object of torch.optim keyword arguments (lr, betas, ...)")
    verify.add_argument("--steps", type=int, default=3, help="training steps to compare (default 3)")
    verify.add_argument("--batch-size", type=int, help="batch size for a symbolic batch dim")
    _add_batch_norm(verify)
    verify.add_argument("--seed", type=int, default=0, help="seed of the random batches and Dropout noise (default 0)")
    verify.add_argument("--tolerance-factor", type=float, default=10.0, metavar="K",
                        help="a tensor passes when its error <= K x torch's own float32 error (default 10)")
    verify.set_defaults(run=_verify)

    compile_ = commands.add_parser("compile", help="compile a training .onnx for the CPU with an MLIR compiler (IREE, onnx-mlir)")
    compile_.add_argument("model", help="training .onnx file")
    compile_.add_argument("-o", "--output", required=True, help="output module (.vmfb for iree, .so for onnx-mlir; a .zip of .so files when in pieces)")
    compile_.add_argument("--backend", default="iree", choices=BACKENDS,
                          help="compiler (default iree, llvm-cpu; onnx-mlir: --EmitLib -O3, found via ONNX_MLIR_HOME or PATH)")
    compile_.add_argument("--target-cpu", help="LLVM CPU to compile for ('host' or 'native': this machine's, for "
                          "either backend; iree: default host, 'generic' is portable; onnx-mlir: its --mcpu, default "
                          "onnx-mlir's own)")
    compile_.add_argument("--no-gradients", action="store_true",
                          help="the module does not return the grad_* outputs (a training loop never reads them)")
    compile_.add_argument("--timeout", type=float, metavar="SECONDS",
                          help="onnx-mlir: stop the compile after this long (default: no limit)")
    compile_.add_argument("--pieces", default="auto", metavar="N",
                          help="onnx-mlir: compile the graph in N pieces, in parallel, run in sequence (the output is "
                               "then a zip of their .so files; docs/onnx-mlir.md); default auto: large graphs only")
    compile_.set_defaults(run=_compile)

    mlir = commands.add_parser("mlir", help="import a training .onnx into MLIR (torch-mlir ONNX form, as iree-import-onnx)")
    mlir.add_argument("model", help="training .onnx file")
    mlir.add_argument("-o", "--output", required=True, help="output .mlir file")
    mlir.set_defaults(run=_mlir)

    show = commands.add_parser("show", help="summarise a training .onnx (phases, ops, weights, roles)")
    show.add_argument("model", help="training .onnx file")
    show.add_argument("--html", help="also write a picture of the graph, coloured by phase, to this .html file")
    show.set_defaults(run=_show)

    check = commands.add_parser("check", help="list what a compiler would reject in an .onnx (exit 1 if any)")
    check.add_argument("model", help=".onnx file")
    check.add_argument("--target", default="onnx-mlir", choices=list(CHECK_TARGETS),
                       help="compiler (default onnx-mlir: its op table, then an onnx-mlir compile when onnx-mlir is found; "
                            "iree: known patterns, then an IREE compile)")
    check.add_argument("--no-compile", action="store_true",
                       help="check the op table (iree: the known patterns) only, without compiling (a large graph takes minutes)")
    check.set_defaults(run=_check)

    train = commands.add_parser("train", help="train a converted model on arrays from an .npz (docs/training.md)")
    train.add_argument("model", help="training .onnx file (its .state.npz and .eval.onnx beside it)")
    train.add_argument("--data", required=True, help=".npz with one array per data input (by name) and 'target'")
    train.add_argument("--epochs", type=int, default=1)
    train.add_argument("--batch-size", type=int, help="default: the graph's (static) or 32 (dynamic batch)")
    train.add_argument("--schedule", help="lr schedule: step, multistep, exponential, cosine, linear_warmup, onecycle")
    train.add_argument("--schedule-options", help="JSON object of the torch lr_scheduler's keyword arguments")
    train.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "iree"])
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--resume", help="checkpoint (.npz) to continue from")
    train.add_argument("--checkpoint", required=True, help="where to write the checkpoint at the end (.npz)")
    train.add_argument("--accumulation-steps", type=int, default=1, metavar="K",
                       help="one optimizer step per K batches (gradient accumulation; needs the .gradient.onnx "
                            "and .update.onnx that bridge convert writes)")
    train.add_argument("--plot", help="write the loss/accuracy curves to this .png (needs matplotlib)")
    train.add_argument("--nproc", type=int, metavar="N",
                       help="data-parallel on N local processes (gloo; --batch-size is per process); under "
                            "torchrun (torchrun --nproc-per-node N -m bridge train ...) every rank joins its job "
                            "without this flag (docs/distributed.md)")
    train.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                       help="data-parallel: a rank waits this long for the others before failing (default 300)")
    train.set_defaults(run=_train)

    export = commands.add_parser("export-inference", help="the source model with the trained weights of a checkpoint")
    export.add_argument("source", help="the inference .onnx that was converted")
    export.add_argument("--train", required=True, help="the training .onnx the checkpoint belongs to")
    export.add_argument("--checkpoint", required=True, help="checkpoint .npz (bridge train, save_checkpoint)")
    export.add_argument("-o", "--output", required=True, help="output inference .onnx")
    export.add_argument("--unmerged", action="store_true",
                        help="LoRA: keep the adapters beside the base weights instead of merging them in")
    export.set_defaults(run=_export_inference)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; an error is one line on stderr (its traceback too with ``--debug``) and exit
    status 2, an interrupt exit status 130."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # e.g. ``bridge show model.onnx | head``: the reader has gone
        _silence_stdout()
        return 0
    except KeyboardInterrupt:
        print("bridge: interrupted", file=sys.stderr)
        return 130
    except (BridgeError, OSError, MemoryError) as exc:
        if args.debug:
            traceback.print_exc()
        print(f"bridge: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    """The error message on one line (an OSError names its file)."""
    text = str(exc) if isinstance(exc, BridgeError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises no second BrokenPipeError."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
