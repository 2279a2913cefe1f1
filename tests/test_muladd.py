import pytest
import torch
from helpers import DTYPES, IMPLS, assert_like_truth, assert_matches, device_for, gpu, impls_of, rel, truth64

import tiered_ops
from tiered_ops.ops.muladd import _problem as P
from tiered_ops.tiers import cuda_ext

PROBLEMS = [
    P((1,)),  # one element: the scalar tail only
    P((1823, 781)),  # a tail after every block size
    P((3, 1, 5)),  # size-1 dim
    P((100003,)),  # several blocks plus a tail
    P((64, 256)),  # exact multiple of every block size: no tail
]
# muladd has no CUDA kernel (none defended a territory: docs/territories.md): its tiers of IMPLS, and eager's addcmul
TIERS = impls_of("muladd", IMPLS)


@pytest.mark.parametrize("problem", PROBLEMS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("impl", TIERS + ["eager_addcmul"])
def test_matches_float64(impl, dtype, problem):
    assert_matches("muladd", impl, problem, dtype)


def test_compile_tier():
    assert_matches("muladd", "compile", P((1823, 781)), torch.float32)


@pytest.mark.parametrize("impl", TIERS)
def test_non_contiguous_and_misaligned(impl):
    dev = device_for(impl)
    fn = tiered_ops.get_op("muladd").impls[impl].fn
    a, b = torch.randn(50, 70, device=dev).t(), torch.randn(70, 50, device=dev)
    c = torch.randn(70 * 50 + 1, device=dev)[1:].view(70, 50)  # storage offset: not 16-byte aligned
    assert rel(fn(a, b, c), truth64("muladd", a, b, c)) < 1e-6


@pytest.mark.parametrize("impl", TIERS + ["eager_addcmul"])
def test_special_values_match_the_math(impl):
    # IEEE 754: inf * 0 and inf - inf are NaN, NaN stays NaN, inf * finite + finite keeps its sign
    dev = device_for(impl)
    fn = tiered_ops.get_op("muladd").impls[impl].fn
    inf, nan = float("inf"), float("nan")
    cases = [(inf, 0.0, 1.0, nan), (0.0, -inf, 1.0, nan), (inf, 1.0, -inf, nan), (nan, 0.0, 1.0, nan),
             (2.0, 3.0, nan, nan), (-inf, 2.0, 1.0, -inf), (2.0, 3.0, inf, inf), (-2.0, inf, -inf, -inf)]
    n = 40  # beyond one vector of any CPU path and the scalar tail
    a, b, c = (torch.randn(n, device=dev) for _ in range(3))
    for k, (av, bv, cv, _) in enumerate(cases):
        a[3 * k], b[3 * k], c[3 * k] = av, bv, cv
    want = truth64("muladd", a, b, c)
    assert all(w == v or w != w and v != v for w, v in zip(want[::3].tolist(), [e[3] for e in cases]))
    assert_like_truth(fn(a, b, c), want, 1e-6, f"muladd/{impl} special values")


@gpu
def test_cpu_tensor_to_gpu_tier_is_rejected():
    fn = tiered_ops.get_op("muladd").impls["triton"].fn
    x = torch.randn(8)
    with pytest.raises((ValueError, RuntimeError), match="a must be a CUDA tensor"):
        fn(x, x, x)


BROADCASTS = [
    ((4, 1), (1, 5), (4, 5)),  # every operand broadcast along another dim
    ((), (3, 7), (7,)),  # a 0-d operand and a row vector
    ((64, 256), (256,), (256,)),  # a scale and a shift per column
    ((2, 1, 33), (2, 5, 1), (1,)),  # 3-D, a size-1 dim on each side
]


@pytest.mark.parametrize("shapes", BROADCASTS, ids=str)
@pytest.mark.parametrize("impl", TIERS + ["eager_addcmul"])
def test_broadcasts_like_the_expression(impl, shapes):
    """Every tier broadcasts like a * b + c; gradients come back at each operand's own shape (summed)."""
    dev = device_for(impl)
    fn = tiered_ops.get_op("muladd").impls[impl].fn
    a, b, c = (torch.randn(s, device=dev, requires_grad=True)
               for s in shapes)
    out = fn(a, b, c)
    ref = a.detach().double() * b.detach().double() + c.detach().double()
    assert tuple(out.shape) == tuple(ref.shape) and rel(out, ref) < 1e-6
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (a, b, c), g)
    a64, b64, c64 = (t.detach().double().requires_grad_() for t in (a, b, c))
    refs = torch.autograd.grad(a64 * b64 + c64, (a64, b64, c64), g.double())
    # a broadcast operand's gradient is a sum, which may cancel to near 0: its error is bounded by the sum of the
    # terms' magnitudes (the same gradients of |a| |b| + |c| for |g|), not by the result
    m64 = [t.detach().abs().requires_grad_() for t in (a64, b64, c64)]
    scale = torch.autograd.grad(m64[0] * m64[1] + m64[2], m64, g.double().abs())
    for name, got, want, s in zip("abc", grads, refs, scale):
        assert got.shape == want.shape, name
        assert (got.double() - want).norm() <= 1e-5 * s.norm(), (name, rel(got, want))


def test_public_op_broadcasts_and_keys_its_fast_path_on_every_shape(private_store):
    """tiered_ops.muladd takes broadcast operands (a call with another b shape after this one, which its fast path must
    not serve: muladd's BAD_INPUTS, tests/test_bad_input.py)."""
    a, b, c = torch.randn(6, 5), torch.randn(5), torch.randn(6, 1)
    torch.testing.assert_close(tiered_ops.muladd(a, b, c), a * b + c)  # its bad calls: muladd's BAD_INPUTS


def test_three_tiers_and_no_cuda_kernel():
    """muladd runs at eager (and eager's torch.addcmul), compile and triton: no CUDA sources, so no CUDA
    implementation (the extension registers no muladd op: tests/test_cuda_registration.py)."""
    ours = sorted(i.name for i in tiered_ops.get_op("muladd").impls.values() if i.tier.label != "peer")
    assert ours == ["compile", "eager", "eager_addcmul", "triton"]
    assert not [p.name for p in cuda_ext.sources() if p.stem == "muladd"]
    assert [p.name for p in cuda_ext.sources() if p.stem == "gelu"] == ["gelu.cu", "gelu.cpp"]  # an op that has one


def test_broadcast_problem_round_trips():
    spec = tiered_ops.get_op("muladd")
    p = P((4, 5), "4x1,1x5,4x5")
    inp = spec.make_inputs(p, torch.float32, torch.device("cpu"), 0)
    assert [tuple(t.shape) for t in inp.args] == [(4, 1), (1, 5), (4, 5)]
    assert spec.problem_of(*inp.args) == p and spec.bucket(p) != spec.bucket(P((4, 5)))
    assert P((4, 5), "4x5,4x5,4x5") == P((4, 5))  # one shape: no operands parameter
    with pytest.raises(ValueError, match="broadcast to"):
        P((4, 6), "4x1,1x5,4x5")
