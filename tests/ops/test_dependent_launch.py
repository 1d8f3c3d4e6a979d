"""Programmatic dependent launch (ops/triton/dependent_launch.py): the contract every kernel that takes it
keeps, when it is on, and that a chain of such kernels gives the bits of ordinary launches."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from atom_core.ops.triton import dependent_launch

TRITON_DIR = pathlib.Path(dependent_launch.__file__).parent


def _jit_functions():
    for path in sorted(TRITON_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith("triton.jit") for d in node.decorator_list):
                yield path.name, node


def _takes_pdl(node: ast.FunctionDef) -> bool:
    return any(a.arg == "PDL" for a in node.args.args)


def test_every_kernel_that_takes_pdl_waits_for_its_inputs_before_anything_else():
    kernels = [(name, node) for name, node in _jit_functions() if _takes_pdl(node) and node.name != "wait_for_inputs"]
    assert len(kernels) >= 16, "the decode-step kernels no longer take PDL"
    for name, node in kernels:
        body = node.body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):  # the docstring
            body = body[1:]
        assert ast.unparse(body[0]) == "wait_for_inputs(PDL)", f"{name}:{node.name} reads or writes before the wait"


def test_every_launch_with_launch_kwargs_targets_a_kernel_that_takes_pdl():
    """A kernel launched with PDL but without the wait could read its inputs before they are written."""
    takes = {node.name for _, node in _jit_functions() if _takes_pdl(node)}

    def is_launch_kwargs(value) -> bool:
        return isinstance(value, ast.Call) and ast.unparse(value.func) == "launch_kwargs"

    launched = []
    for path in sorted(TRITON_DIR.glob("*.py")):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            # names bound to launch_kwargs(...) in this function, passed on as **name
            bound = {t.id for n in ast.walk(function) if isinstance(n, ast.Assign) and is_launch_kwargs(n.value)
                     for t in n.targets if isinstance(t, ast.Name)}
            for node in ast.walk(function):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                        and any(is_launch_kwargs(k.value) or (isinstance(k.value, ast.Name) and k.value.id in bound)
                                for k in node.keywords if k.arg is None)):
                    launched.append((path.name, ast.unparse(node.func.value)))
    assert len(launched) >= 17
    for name, kernel in launched:
        assert kernel in takes, f"{name} launches {kernel} with PDL, but {kernel} does not wait for its inputs"


def test_launch_kwargs_are_off_for_cpu_tensors():
    assert dependent_launch.launch_kwargs(torch.zeros(1), 1) == {"PDL": False, "launch_pdl": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_launch_kwargs_are_on_up_to_max_rows_tokens_on_sm90():
    x = torch.zeros(1, device="cuda")
    on = torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)
    assert all(dependent_launch.launch_kwargs(x, rows)["launch_pdl"] is on
               for rows in range(1, dependent_launch.MAX_ROWS + 1))
    assert not dependent_launch.launch_kwargs(x, dependent_launch.MAX_ROWS + 1)["launch_pdl"]


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an NVIDIA sm90+ GPU")
def test_on_sm90_a_graph_of_dependent_launches_gives_the_bits_of_ordinary_launches(monkeypatch):
    """An FP8 decode layer's chain at one token (RMSNorm + quantization, GEMV, SiLU-and-mul + quantization,
    GEMV, residual RMSNorm), 8 layers of distinct weights in one CUDA graph, launched with PDL and without."""
    from atom_core import ops
    from atom_core.ops.reference.quant import per_block_quant

    assert dependent_launch.launch_kwargs(torch.zeros(1, device="cuda"), 1)["launch_pdl"]
    torch.manual_seed(0)
    hidden, inter = 1024, 2048
    layers = []
    for _ in range(8):
        gate_up, gate_up_scale = per_block_quant((torch.randn(2 * inter, hidden, device="cuda") * hidden ** -0.5)
                                                 .to(torch.bfloat16))
        down, down_scale = per_block_quant((torch.randn(hidden, inter, device="cuda") * inter ** -0.5)
                                           .to(torch.bfloat16))
        layers.append((torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5, gate_up, gate_up_scale, down,
                       down_scale))
    x0 = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)

    def forward(x):
        residual = torch.zeros_like(x)
        for norm_w, gate_up, gate_up_scale, down, down_scale in layers:
            a, a_scale, residual = ops.rms_norm_quant(x, norm_w, 1e-6, residual=residual, backend="triton")
            h = ops.scaled_mm_block(a, a_scale, gate_up, gate_up_scale, out_dtype=torch.bfloat16, backend="triton")
            a, a_scale = ops.silu_and_mul_quant(h, backend="triton")
            x = ops.scaled_mm_block(a, a_scale, down, down_scale, out_dtype=torch.bfloat16, backend="triton")
        return ops.rms_norm(x, layers[0][0], 1e-6, residual=residual, backend="triton")[0]

    def replayed():
        x = x0.clone()
        forward(x)  # compile and warm outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = forward(x)
        graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    with_pdl = replayed()
    monkeypatch.setattr(dependent_launch, "_supported", lambda device_index: False)
    assert not dependent_launch.launch_kwargs(x0, 1)["launch_pdl"]
    without = replayed()
    assert with_pdl.abs().max() > 0
    assert torch.equal(with_pdl, without)
