"""The Triton tier on a machine without a GPU works, or says why not, whatever imported triton first.

Each case runs in a fresh process without a visible GPU and without TRITON_INTERPRET, so that the import order is
the one under test (this process has imported triton and tiered_ops already).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# After the first imports: the Triton tier of softmax (tl.max, tl.sum inside the kernels) and of layer_norm (the
# weight/bias gradient kernel of triton_src/common.py), forward and backward, against torch on a small CPU tensor.
CHECK = """
import torch
import tiered_ops

cpu = torch.device("cpu")
softmax = tiered_ops.get_op("softmax").impls["triton"]
why = softmax.why_not(cpu)
if why:
    print("UNAVAILABLE:", why)
    raise SystemExit(0)
x = torch.randn(5, 37, requires_grad=True)
dy = torch.randn(5, 37)
y = softmax.fn(x, -1)
(dx,) = torch.autograd.grad(y, x, dy)
ref = torch.softmax(x, -1)
(ref_dx,) = torch.autograd.grad(ref, x, dy)
torch.testing.assert_close(y, ref)
torch.testing.assert_close(dx, ref_dx)
layer_norm = tiered_ops.get_op("layer_norm").impls["triton"]
w = torch.randn(37, requires_grad=True)
out = layer_norm.fn(x, (37,), w, None)
(dw,) = torch.autograd.grad(out, w, dy)
ref_out = torch.nn.functional.layer_norm(x, (37,), w)
(ref_dw,) = torch.autograd.grad(ref_out, w, dy)
torch.testing.assert_close(out, ref_out)
torch.testing.assert_close(dw, ref_dw)
print("MATCHES")
"""


def run_fresh(first: str, tmp_path: Path, interpret_first: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", TIERED_OPS_DB=str(tmp_path / "s.sqlite"),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p))
    if interpret_first:
        env["TRITON_INTERPRET"] = "1"
    code = textwrap.dedent(first) + CHECK
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def outcome(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Cannot call @triton.jit'd" not in r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln == "MATCHES" or ln.startswith("UNAVAILABLE:")]
    return line


@pytest.fixture(scope="module")
def supported_order(tmp_path_factory) -> str:
    """The outcome with the interpreter on before anything imports triton: MATCHES, or why this torch/triton cannot
    run the Triton tier on the CPU at all (torch < 2.13 does not launch interpreted kernels)."""
    return outcome(run_fresh("", tmp_path_factory.mktemp("control"), interpret_first=True))


FIRSTS = [
    pytest.param("import triton\nimport triton.language as tl\n", id="triton"),
    # torch's test internals need expecttest: the [test] extra installs it, so this runs wherever the suite does
    pytest.param("import torch.testing._internal.common_methods_invocations\n", id="common_methods_invocations"),
]


@pytest.mark.parametrize("first", FIRSTS)
def test_triton_tier_works_when_triton_was_imported_first(first, supported_order, tmp_path):
    # Whatever imported triton first, the tier does what it does when the interpreter is on from the start: here
    # (torch 2.13, triton 3.9) the kernels run and match torch; on a torch that cannot launch interpreted kernels, the
    # tier is unavailable with that reason in both orders.
    assert outcome(run_fresh(first, tmp_path)) == supported_order


def test_triton_tier_says_why_when_the_interpreter_cannot_be_brought_up(supported_order, tmp_path):
    # A triton whose functions cannot be made again for the interpreter: the tier is unavailable with the reason,
    # and a call says so instead of failing inside a kernel.
    if supported_order != "MATCHES":
        pytest.skip(f"the Triton tier does not run on this CPU in any order: {supported_order}")
    first = """
    import triton
    import triton.runtime.interpreter as interp

    class Refusing(interp.InterpretedFunction):  # triton's own library functions cannot be made for the interpreter
        def __init__(self, fn, **kwargs):
            if fn.__module__.startswith("triton."):
                raise TypeError("refused")
            super().__init__(fn, **kwargs)

    interp.InterpretedFunction = Refusing
    import torch
    import tiered_ops
    fn = tiered_ops.get_op("softmax").impls["triton"].fn
    try:
        fn(torch.randn(2, 3), -1)
    except RuntimeError as e:
        print("CALL:", e)
    """
    r = run_fresh(first, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "UNAVAILABLE: the Triton interpreter could not be set up (TypeError: refused); where triton was imported " \
           "first, set TRITON_INTERPRET=1 before anything imports triton" in r.stdout, r.stdout + r.stderr
    assert "CALL: tiered_ops::softmax_triton is unavailable: the Triton interpreter could not be set up" in r.stdout
