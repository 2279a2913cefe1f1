"""tiered-ops check per CUDA kernel: each one defends a territory, or says why it stays (``kernels`` in
territories.json) with its figures computed from the evidence, or is not yet measured (no row of it); one that holds
no territory, states no reason and has rows fails, naming it, and so does one that stays as picked where nothing picks
it."""

import re

import pytest
from test_check import SMALL, SPEC, _frame, _only, _run

from tiered_ops.analysis import territories as terr
from tiered_ops.analysis.check import check, report


def test_a_kernel_with_no_territory_and_no_reason_fails_naming_it():
    findings = _run(_frame(), ())
    f = _only(findings, kernel=True)
    assert f.kind == "defends-nothing" and f.fails and "holds no territory and states no reason it stays" in f.text
    assert "FAIL softmax cuda [defends-nothing]" in report(findings)
    # its figures on the evidence: the fastest tier of each case (1.5x Triton and compile, eager 2x) is this kernel
    assert "is this kernel in 2 of 2 cases beyond the noise (its largest lead 1.50x over " in f.text
    assert report(findings).splitlines()[-1] == ("cuda: 0 kernels defend 0 cases in 0 territories; 0 territories "
                                                 "retired; 1 kernels hold none and state no reason")
    # every territory of it retired: the same
    assert _only(_run(_frame(), retired={"softmax.small": "ties Triton"}), kernel=True).kind == "defends-nothing"


@pytest.mark.parametrize("reason", ["picked", "reference", "remove"])
def test_a_kernel_with_no_territory_and_a_reason_passes_and_says_it(reason):
    why = "the decision picks it at 1x4096 and 32x4096, by little"
    findings = _run(_frame(), retired={"softmax.small": "by too little"},
                    kernels=[terr.Stay("softmax", "cuda", reason, why)])
    f = _only(findings, kernel=True)
    assert not any(x.fails for x in findings) and why in f.text and "2 of 2 cases beyond the noise" in f.text
    if reason == "remove":
        assert f.kind == "remove" and "marked for removal" in f.text
    else:
        assert f.kind == "stays" and f"stays as {reason} (" in f.text
    assert report(findings).splitlines()[-1].endswith(f"; 1 kernels stay without one ({reason} 1)")


def test_a_kernel_that_stays_as_picked_where_nothing_picks_it_fails():
    """The one reason the evidence can check: a kernel that stays because the decision picks it fails where the
    fastest tier of every case is another (here Triton at 100 us against the kernel's 149), and passes as soon as
    some case picks it beyond the noise."""
    stay = [terr.Stay("softmax", "cuda", "picked", "picked at small rows")]
    f = _only(_run(_frame(cuda_us=149.0, triton_us=100.0), (), kernels=stay), kernel=True)
    assert f.kind == "unfounded" and f.fails and "is this kernel in 0 of 2 cases beyond the noise" in f.text
    assert _only(_run(_frame(cuda_us=90.0, triton_us=100.0), (), kernels=stay), kernel=True).kind == "stays"


def test_a_kernel_without_evidence_is_not_yet_measured_and_one_that_defends_says_what():
    """A new op's kernel before a sweep measured it (no row of it in the evidence) is reported, never failed, with or
    without a held territory; a kernel that defends says which territories and how many cases."""
    f = _only(_run(_frame().query("impl != 'cuda'"), ()), kernel=True)
    assert f.kind == "unmeasured" and not f.fails
    assert f.text == "not yet measured: no row of softmax cuda in this evidence"
    assert report(_run(_frame().query("impl != 'cuda'"), ())).splitlines()[-1].endswith("; 1 kernels not yet measured")
    f = _only(check(_frame().assign(op="muladd"), [SPEC], [SMALL], {}, []), kernel=True)
    assert f.kind == "unmeasured" and "(held territories: softmax.small)" in f.text
    f = _only(_run(_frame()), kernel=True)
    assert f.kind == "kernel" and f.text == "defends 1 territory / 2 cases: softmax.small"
    f = _only(_run(_frame(cuda_us=140.0)), kernel=True)  # its territory fails (loses): the kernel's line says so
    assert f.kind == "kernel" and not f.fails and "defends none of its 1 held territories" in f.text


def test_the_kernel_entries_load_and_a_bad_one_is_named(tmp_path):
    assert terr.load_kernels() == terr.KERNELS
    terr.validate_kernels()
    bad = tmp_path / "t.json"
    for entry, error in [('{"op": "gelu", "impl": "cuda", "reason": "liked", "why": "x"}', "reason 'liked'"),
                         ('{"op": "gelu", "impl": "cuda", "reason": "picked", "why": " "}', "'why' is empty"),
                         ('{"op": "gelu", "impl": "cuda"}', "kernel entry 0 is malformed")]:
        bad.write_text('{"territories": [], "kernels": [' + entry + ']}')
        with pytest.raises(ValueError, match=error):
            terr.load_kernels(bad)
    bad.write_text('{"territories": [], "kernels": [' + ", ".join(
        ['{"op": "gelu", "impl": "cuda", "reason": "picked", "why": "x"}'] * 2) + ']}')
    with pytest.raises(ValueError, match="gelu cuda has two entries"):
        terr.load_kernels(bad)
    with pytest.raises(ValueError, match="has no CUDA implementation 'triton'"):
        terr.validate_kernels([terr.Stay("gelu", "triton", "picked", "x")])
    for k in terr.KERNELS:  # no figures typed into a reason: the check computes them from the evidence
        assert not re.search(r"\d\.\d\dx", k.why), (k.op, k.impl)
