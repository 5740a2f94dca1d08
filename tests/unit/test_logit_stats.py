"""Sampling's row statistics (`kernels/logit_stats.py`): the max, its first index and the log of the
softmax's sum, against torch's `log_softmax` and `argmax`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.kernels import decode_products, logit_stats  # noqa: E402

needs_kernel = pytest.mark.skipif(decode_products.load() is None,
                                  reason=f"decode kernel unavailable: {decode_products.unavailable()}")


@needs_kernel
@pytest.mark.parametrize("v", [1, 7, 8, 9, 300, 49152])
def test_stats_give_log_softmax_and_argmax(v):
    g = torch.Generator().manual_seed(v)
    x = torch.randn(5, v, generator=g) * 6
    x[1] -= 200.0  # far from zero: the max is what keeps exp in range
    m, idx, ls = logit_stats.stats(x)
    assert torch.equal(idx, x.argmax(-1)) and torch.equal(m, x.amax(-1))
    cols = torch.randint(0, v, (5, 3), generator=g)
    got = logit_stats.logprobs(x, (m, idx, ls), cols)
    want = torch.log_softmax(x.double(), -1).gather(-1, cols).float()
    assert (got - want).abs().max() <= 2e-6 * max(1.0, float(want.abs().max()))
    # the torch form (where the kernel does not run) agrees with it
    _, tidx, tls = logit_stats.stats(x, kernel=False)
    assert torch.equal(tidx, idx) and (tls - ls).abs().max() < 1e-5


@needs_kernel
def test_ties_take_the_first_index_and_masked_entries_count_for_nothing():
    x = torch.zeros(4, 40)
    x[0, [3, 17, 33]] = 5.0  # in different lanes and steps
    x[1, [9, 1]] = 5.0
    x[2, [38, 39]] = 5.0  # in the tail past the last full step of 8
    x[3, :] = -float("inf")
    x[3, [30, 31]] = 1.0
    m, idx, ls = logit_stats.stats(x)
    assert idx.tolist() == [3, 1, 38, 30] == x.argmax(-1).tolist()
    want = torch.log_softmax(x, -1)
    got = logit_stats.logprobs(x, (m, idx, ls), idx[:, None])[:, 0]
    assert torch.allclose(got, want.gather(-1, idx[:, None])[:, 0], atol=1e-6)
    assert abs(float(got[3]) - float(torch.tensor(0.5).log())) < 1e-6  # -inf logits: probability 0


def test_rows_torch_must_handle_fall_back_to_it():
    x = torch.randn(3, 50)
    x[1, 4] = float("nan")
    m, idx, ls = logit_stats.stats(x)
    tm, tidx, _ = logit_stats.stats(x, kernel=False)
    assert torch.equal(idx, tidx) and torch.equal(m.isnan(), tm.isnan()) and bool(ls[1].isnan())
    y = torch.full((2, 20), -float("inf"))
    assert logit_stats.stats(y)[2].isnan().all()  # as log_softmax: no finite logit, no distribution


@needs_kernel
def test_a_rows_statistics_do_not_depend_on_the_other_rows():
    x = torch.randn(32, 4097) * 3
    whole = logit_stats.stats(x)
    for r in (0, 13, 31):
        alone = logit_stats.stats(x[r:r + 1].clone())
        assert all(torch.equal(a[0], w[r]) for a, w in zip(alone, whole))


@needs_kernel
@pytest.mark.parametrize("v", [13, 40, 3000])
def test_draws_follow_the_softmax_and_never_pick_zero_mass(v):
    g = torch.Generator().manual_seed(v)
    row = torch.randn(v, generator=g) * (1.5 if v < 100 else 4)
    row[[2, 9]] = -float("inf")  # masked: probability 0
    x = row.repeat(20000, 1)
    st = logit_stats.stats(x)
    u = 1.0 - torch.rand(20000, generator=g)  # in (0, 1]
    got = logit_stats.draw(x, st, u)
    p = torch.softmax(row.double(), -1)
    counts = torch.bincount(got, minlength=v).double() / 20000
    assert counts[[2, 9]].sum() == 0 and (counts - p).abs().max() < 0.015
    # the walk is the inverse of the running sum: the torch form lands on the same entries
    ref = logit_stats.draw(x, st, u, kernel=False)
    assert (ref == got).double().mean() > 0.999
    # the ends: u = 1 takes the last entry with mass, a u near 0 the first
    ends = logit_stats.draw(x[:2], tuple(t[:2] for t in st), torch.tensor([1.0, 1e-12]))
    assert ends.tolist() == [v - 1 if v - 1 not in (2, 9) else v - 2, 0]
