"""The Triton kernels are built inside functions (Triton is imported only where it runs), so a
kernel finds `tl` through its closure, and Python puts a name in a closure only where the body
uses it, not where only an annotation (`GATHER: tl.constexpr`) names it. Triton resolves the
annotations when it compiles, on the GPU: a helper whose body stopped using `tl` fails there with
"NameError: tl is not defined". Checked here from the sources, without Triton or a GPU."""

import ast
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "fp8plug" / "backends" / "native"
SOURCES = sorted(p for p in NATIVE.glob("*.py") if "triton.jit" in p.read_text())


def is_jit(node: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("triton.jit") or ast.unparse(d) == "jit" for d in node.decorator_list)


def nested_kernels(tree: ast.Module):
    """The @triton.jit functions defined inside other functions."""
    for outer in ast.walk(tree):
        if isinstance(outer, ast.FunctionDef):
            for node in ast.walk(outer):
                if node is not outer and isinstance(node, ast.FunctionDef) and is_jit(node):
                    yield node


def names_in(nodes) -> set:
    return {n.id for node in nodes for n in ast.walk(node) if isinstance(n, ast.Name)}


def test_there_are_kernel_sources_to_check():
    assert {p.name for p in SOURCES} >= {"transposed_cast.py", "tile_cast.py", "fused_cast.py", "fused_norm.py"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_every_name_a_kernels_annotations_use_is_in_its_closure(path):
    tree = ast.parse(path.read_text())
    module_names = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                    if isinstance(t, ast.Name)}
    module_names |= {a.asname or a.name.split(".")[0] for node in tree.body
                     if isinstance(node, (ast.Import, ast.ImportFrom)) for a in node.names}
    kernels = list(nested_kernels(tree))
    assert kernels
    for kernel in kernels:
        annotated = names_in(a.annotation for a in kernel.args.args + kernel.args.kwonlyargs if a.annotation)
        used = names_in(kernel.body)
        missing = annotated - used - module_names
        assert not missing, (f"{path.name}: {kernel.name}'s annotations name {sorted(missing)}, which its body "
                             "does not use: Triton will not find them when it compiles the kernel")
