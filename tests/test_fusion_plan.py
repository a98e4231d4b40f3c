"""Bucket planning is pure: properties over random tensor lists (hypothesis)."""

from hypothesis import given
from hypothesis import strategies as st

from engine.fusion import plan_buckets

SPECS = st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([("float32", 4), ("int64", 8), ("float16", 2)]),
                           st.sampled_from(["cpu", "cuda:0"])), max_size=60)


@given(SPECS, st.integers(1, 40000), st.one_of(st.none(), st.integers(1, 40000)))
def test_every_nonempty_tensor_in_exactly_one_bucket_under_the_cap(raw, cap, direct):
    specs = [(n, dt, size, dev) for n, (dt, size), dev in raw]
    buckets = plan_buckets(specs, cap, direct)
    placed = [i for b in buckets for i in b.indices]
    assert sorted(placed) == [i for i, s in enumerate(specs) if s[0]]
    for b in buckets:
        assert {(specs[i][1], specs[i][3]) for i in b.indices} == {(b.dtype, b.device)}  # one dtype, one device
        assert list(b.indices) == sorted(b.indices)  # order kept inside a bucket
        assert b.count == sum(specs[i][0] for i in b.indices)
        nbytes = b.count * specs[b.indices[0]][2]
        assert nbytes <= cap or len(b.indices) == 1  # only a lone tensor may exceed the cap
        if direct is not None and len(b.indices) > 1:  # tensors of direct_bytes or more travel alone
            assert all(specs[i][0] * specs[i][2] < direct for i in b.indices)
    firsts = [b.indices[0] for b in buckets]
    assert firsts == sorted(firsts)  # buckets travel in the caller's order


def test_examples():
    specs = [(10, "float32", 4, "cpu"), (0, "float32", 4, "cpu"), (5, "int64", 8, "cpu"),
             (100, "float32", 4, "cpu"), (3, "float32", 4, "cpu")]
    got = [(b.dtype, b.indices) for b in plan_buckets(specs, 100)]
    # tensor 3 (400 B) is over the cap: it travels alone and closes the open float32 bucket
    assert got == [("float32", (0,)), ("int64", (2,)), ("float32", (3,)), ("float32", (4,))]
    assert [b.indices for b in plan_buckets(specs, 1 << 20)] == [(0, 3, 4), (2,)]
    assert plan_buckets([], 10) == []
    assert [b.indices for b in plan_buckets(specs, 1 << 20, direct_bytes=41)] == [(0,), (2,), (3,), (4,)]
    assert [b.indices for b in plan_buckets(specs, 1 << 20, direct_bytes=401)] == [(0, 3, 4), (2,)]
