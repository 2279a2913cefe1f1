"""Buckets as stored: canonical typed JSON text, the tuple back, and the distance of the nearest-bucket fallback."""

import math

import pytest
from helpers import builtin_ops

from tiered_ops import buckets


@pytest.mark.parametrize("bucket", [(1024, 4096, True), (64, 0, False, "tanh"), (8, None), ((64, 256), 3, "x|y"), ()])
def test_encode_then_decode_gives_the_tuple_back_with_its_types(bucket):
    text = buckets.encode(bucket)
    back = buckets.decode(text)
    assert back == bucket
    assert [type(v) for v in back] == [type(v) for v in bucket]  # True stays a bool, never 1


def test_the_encoding_is_canonical_json_and_tells_a_flag_from_a_number():
    assert buckets.encode((1024, 4096, True)) == "[1024,4096,true]"
    assert buckets.encode((64, 1)) != buckets.encode((64, True))
    assert buckets.encode([2, (3, 4)]) == buckets.encode((2, [3, 4]))  # nested tuples and lists alike


@pytest.mark.parametrize("bad, what", [((1, object()), "part\\[1\\] is a object"), ((math.nan,), "finite"),
                                       ("1|2", "expected a tuple")])
def test_a_value_a_bucket_cannot_hold_is_an_error_naming_it(bad, what):
    with pytest.raises(ValueError, match=what):
        buckets.encode(bad)


@pytest.mark.parametrize("text", ["1|2", "{\"a\": 1}", None])
def test_decoding_text_that_is_not_an_encoded_bucket_is_an_error(text):
    with pytest.raises(ValueError, match="bucket: expected"):
        buckets.decode(text)


def test_every_ops_default_buckets_round_trip():
    for spec in builtin_ops():
        for p in spec.default_problems("cuda") + spec.edge_problems():
            b = spec.bucket(p)
            assert buckets.decode(buckets.encode(b)) == b, (spec.name, p)


def test_the_distance_sums_log2_ratios_of_the_sizes():
    assert buckets.distance((1024, 4096, True), (256, 4096, True)) == pytest.approx(2.0)
    assert buckets.distance((1024, 512, True), (4096, 4096, True)) == pytest.approx(2.0 + 3.0)
    assert buckets.distance("[1024,4096,true]", (2048, 4096, True)) == pytest.approx(1.0)  # text or tuple
    assert buckets.distance((0, 8), (1, 8)) == 0.0  # sizes below 1 count as 1


@pytest.mark.parametrize("a, b", [((64, True), (64, False)), ((64, True), (64, 1)), ((64, "tanh"), (64, "none")),
                                  ((64, 8), (64, 8, True)), ((64, None), (64, 0))])
def test_buckets_that_differ_in_a_flag_a_name_or_length_are_infinitely_far_apart(a, b):
    assert buckets.distance(a, b) == math.inf


def test_a_legacy_bucket_reads_as_typed_values():
    assert buckets.from_legacy("1024|4096|True") == (1024, 4096, True)
    assert buckets.from_legacy("64|0|False|tanh") == (64, 0, False, "tanh")
    assert buckets.from_legacy("-1|None") == (-1, None)


def test_flags_apart_counts_named_variants_and_keeps_bools_and_structure_infinitely_far():
    assert buckets.flags_apart((512, 4096, "sum", False), (512, 4096, "mean", False)) == (1.0, 0.0)
    assert buckets.flags_apart("[512,4096,\"sum\",false]", (2048, 4096, "mean", False)) == (1.0, pytest.approx(2.0))
    assert buckets.flags_apart((64, 0, False, "tanh"), (64, 0, False, "tanh")) == (0.0, 0.0)
    assert buckets.flags_apart(((1, "a"), 8), ((1, "b"), 16)) == (1.0, pytest.approx(1.0))  # nested parts too
    for a, b in [((64, True), (64, False)),  # a bool says which path runs: never read from the other
                 ((64, "sum"), (64, 3)), ((64, None), (64, "x")), ((64, "sum"), (64, "sum", 1)),
                 (((1, True), 8), ((1, False), 8))]:
        assert buckets.flags_apart(a, b) == (math.inf, math.inf), (a, b)
