"""The decode-products kernel (`kernels/decode_products.py`): x @ cat(ws).T for 1-8 rows (9-32 on the
AMX form where it runs), equal to a float64 reference within float32 rounding, the same bits for a
row whatever the batch (within 1-8 rows and, on the AMX form, within 9-32), and None wherever it does
not apply (so the caller's oneDNN path runs)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.kernels import decode_products as dp  # noqa: E402


@pytest.fixture(scope="module", params=["wide", "avx2"])
def kernel(request):
    """Each test runs on both forms of the kernel: 16 lanes (where the CPU has AVX-512F) and 8."""
    if dp.load() is None:
        pytest.skip(dp.unavailable() or "kernel unavailable")
    before = dp.set_wide()
    if request.param == "wide" and not dp.set_wide(True):
        dp.set_wide(before)
        pytest.skip("this CPU has no AVX-512F: the 16-lane form does not run")
    if request.param == "avx2":
        dp.set_wide(False)
    yield dp
    dp.set_wide(before)


def test_the_two_forms_agree_within_float32_rounding(kernel):
    before = kernel.set_wide()
    try:
        if not kernel.set_wide(True):
            pytest.skip("this CPU has no AVX-512F")
        torch.manual_seed(1)
        ws, x = [torch.randn(96, 579)], torch.randn(8, 579)
        wide = kernel.products(x, ws)
        kernel.set_wide(False)
        narrow = kernel.products(x, ws)
        assert not kernel.set_wide() and (wide - narrow).abs().max() < 1e-3
        assert not torch.equal(wide, narrow)  # a different order of summation: the switch did switch
    finally:
        kernel.set_wide(before)  # the fixture's form for the tests after this one


def test_each_param_runs_the_form_it_names(kernel, request):
    assert kernel.set_wide() == (request.node.callspec.params["kernel"] == "wide")


def _ref(x, ws):
    return (x.double().reshape(-1, x.shape[-1]) @ torch.cat(ws).double().T).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_products_equal_the_reference_over_several_weights(kernel, rows):
    torch.manual_seed(rows)
    k = 579  # not a multiple of 8: the tail is summed too
    ws = [torch.randn(n, k) for n in (37, 5, 130)]  # row counts that are not multiples of the unroll
    x = torch.randn(rows, k)
    y = kernel.products(x, ws)
    assert y.shape == (rows, 172)
    assert (y.double() - _ref(x, ws)).abs().max() < 2e-4
    # a view with strided rows and a leading batch dimension
    big = torch.randn(rows, 2 * k)
    xs = big[:, :k].unsqueeze(0)
    assert (kernel.products(xs, ws).double() - _ref(xs, ws)).abs().max() < 2e-4


def test_a_row_gets_the_same_bits_whatever_else_is_in_the_batch(kernel):
    torch.manual_seed(0)
    ws = [torch.randn(200, 576)]
    x = torch.randn(8, 576)
    full = kernel.products(x, ws)
    for b in range(1, 8):
        assert torch.equal(kernel.products(x[:b], ws), full[:b])
    assert torch.equal(kernel.products(x[5:6], ws)[0], full[5])


def test_long_rows_taken_in_chunks_keep_a_rows_bits(kernel):
    """Past 32 KB of x (K = 1,541 at 6-8 rows) the 8-lane form takes k in chunks: the same bits as
    without the chunks and as the row alone (fewer rows are not chunked), near the reference."""
    torch.manual_seed(3)
    k = 1541  # 3 chunks at 8 rows, and a tail past the last multiple of 8
    ws = [torch.randn(61, k), torch.randn(30, k + 4)[:, :k]]  # more rows than a tile of 24; a strided weight
    x = torch.randn(8, k + 3)[:, :k]
    before = kernel.set_chunked()
    try:
        assert kernel.set_chunked(True)
        full = kernel.products(x, ws)
        assert (full.double() - _ref(x, ws)).abs().max() < 5e-4
        for b in (1, 5, 6, 7):
            assert torch.equal(kernel.products(x[:b], ws), full[:b])
        assert torch.equal(kernel.products(x[6:7], ws)[0], full[6])
        assert not kernel.set_chunked(False)
        assert torch.equal(kernel.products(x, ws), full)
    finally:
        kernel.set_chunked(before)


@pytest.fixture
def no_amx(kernel):
    """The 16- and 8-lane forms past 8 rows: the AMX form off for the test (where it runs at all)."""
    before = kernel.set_amx()
    kernel.set_amx(False)
    yield kernel
    kernel.set_amx(before)


@pytest.mark.parametrize("rows", [9, 16, 27])
def test_past_8_rows_the_op_takes_groups_of_4_with_the_same_bits(no_amx, rows):
    """Without the AMX form `products` declines more than 8 rows; the fused decode layer calls the op
    with up to 32."""
    torch.manual_seed(rows)
    ws = [torch.randn(301, 579), torch.randn(44, 579)]  # not multiples of the 3 weight rows a block takes
    x = torch.randn(rows, 579)
    y = torch.ops.opencomposer_decode.products(x, ws)
    assert (y.double() - _ref(x, ws)).abs().max() < 2e-4
    for r in (0, rows - 1, rows // 2):
        assert torch.equal(torch.ops.opencomposer_decode.products(x[r:r + 1], ws)[0], y[r])


@pytest.fixture
def amx():
    if dp.load() is None:
        pytest.skip(dp.unavailable() or "kernel unavailable")
    before = dp.set_amx()
    if not dp.set_amx(True):
        pytest.skip("no AMX form here: the CPU lacks AMX-BF16 or AVX-512 BF16, Linux refused the tiles, "
                    "or the compiler is older than g++ 11")
    yield dp
    dp.set_amx(before)


@pytest.mark.parametrize("k,ns", [(579, (301, 44)), (64, (301, 44)), (7, (301, 44)), (40, (20, 17))])
def test_the_amx_form_equals_the_reference_past_8_rows_with_a_rows_bits_in_any_batch_of_9_to_32(amx, k, ns):
    """Tails in k (579 = 18 steps of 32 + 3; 7) and in the weight rows (345 = 21 blocks of 16 + 9: at
    17-32 rows, which take two blocks a step, the last step's second block partly past the end; 37 =
    two blocks and 5 rows: its second block wholly past the end), a block that spans two weights (row
    301; row 20), strided rows of x: within float32 rounding of float64, and one row's bits the same
    in batches of 9, 17 and 32 rows, at the front, the back and the middle."""
    torch.manual_seed(k)
    ws = [torch.randn(n, k) for n in ns]
    big = torch.randn(32, 2 * k)
    x = big[:, :k]
    y = amx.products(x, ws)
    assert y is not None and y.shape == (32, sum(ns))
    assert (y.double() - _ref(x, ws)).abs().max() < 2e-4 * max(1.0, k / 579)
    for lo, hi in ((0, 9), (23, 32), (5, 22), (0, 17)):
        assert torch.equal(amx.products(x[lo:hi].contiguous(), ws), y[lo:hi]), (lo, hi)
    assert amx.products(torch.randn(33, k), ws) is None  # more than 32: oneDNN's batch


def test_the_amx_switch_switches(amx):
    """Off, 9-32 rows run the 16- or 8-lane form (a row's bits as in a batch of 1-8); on, other bits
    within float32 rounding of them."""
    torch.manual_seed(2)
    ws, x = [torch.randn(96, 579)], torch.randn(12, 579)
    on = torch.ops.opencomposer_decode.products(x, ws)
    amx.set_amx(False)
    off = torch.ops.opencomposer_decode.products(x, ws)
    assert torch.equal(off[3], torch.ops.opencomposer_decode.products(x[3:4], ws)[0])
    assert not torch.equal(on, off) and (on - off).abs().max() < 2e-4
    assert amx.products(x, ws) is None  # `products` takes at most 8 rows without it
    amx.set_amx(True)
    assert torch.equal(torch.ops.opencomposer_decode.products(x, ws), on)


def test_the_environment_turns_the_amx_form_off():
    """OPENCOMPOSER_DECODE_AMX=off: a process that builds (here: loads the built) kernel starts with
    it off, and 9-row products stay with the caller."""
    import os
    import subprocess
    import sys

    if dp.load() is None or not dp.set_amx():
        pytest.skip("no AMX form here to turn off")
    code = ("import torch; from opencomposer.kernels import decode_products as dp; assert dp.load() is not None; "
            "print(dp.set_amx(), dp.products(torch.randn(9, 16), [torch.randn(4, 16)]) is None)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OPENCOMPOSER_DECODE_AMX": "off"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"]


def test_it_declines_what_it_does_not_do(kernel):
    w = torch.randn(16, 32)
    # more than 8 rows (32 on the AMX form): oneDNN's batch
    assert (kernel.products(torch.randn(9, 32), [w]) is None) == (not kernel.set_amx())
    assert kernel.products(torch.randn(33, 32), [w]) is None
    assert kernel.products(torch.randn(2, 32, dtype=torch.float64), [w.double()]) is None
    assert kernel.products(torch.randn(2, 32), [w.t().contiguous().t()]) is None  # columns not contiguous
    before = kernel.set_enabled(False)
    try:
        assert kernel.products(torch.randn(2, 32), [w]) is None
    finally:
        kernel.set_enabled(before)
    assert kernel.products(torch.randn(2, 32), [w]) is not None


def test_where_it_cannot_be_built_products_stay_with_the_caller(monkeypatch):
    """No AVX2 (or no compiler): load() says why, products() declines, and the caller's oneDNN runs."""
    monkeypatch.setattr(dp, "_state", {"op": None, "tried": False, "why": None, "enabled": None, "amx": False})
    monkeypatch.setattr(dp, "_cpu_has_avx2", lambda: False)
    assert dp.load() is None and "AVX2" in dp.unavailable()
    assert dp.products(torch.randn(2, 32), [torch.randn(16, 32)]) is None
    from opencomposer.model import linear as lin
    from opencomposer.model.llama import PRESETS, LlamaModel

    model = LlamaModel(PRESETS["tiny"]).eval()
    assert lin.prepare_inference(model, decode=True)["decode"] == 0
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 512, (1, 3)))).all()
