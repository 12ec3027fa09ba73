"""Minimal standalone repros of compiler defects bridge's emitted graphs avoid (docs/onnx-mlir.md)."""


def print_compile(label: str, model, **options) -> None:
    """``bridge.compile(model, **options)``, printed after ``label``: "compiles", or the compiler's error
    (whitespace folded, its first 200 characters)."""
    import bridge

    try:
        bridge.compile(model, **options)
        print(f"{label}: compiles")
    except bridge.CompileError as exc:
        print(f"{label}: {' '.join(str(exc).split())[:200]}")
