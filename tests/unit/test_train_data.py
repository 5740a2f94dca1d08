"""Data mixes: filters, deduplication, held-out split, packing with document boundaries,
deterministic and resumable sampling, and bad input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from opencomposer.train.data import DataError, MixConfig, PackedSampler, SourceConfig, build  # noqa: E402

CODE = "def f{i}(x):\n    '''Function number {i}.'''\n    total = x * {i} + {j}\n    return total  # {words}\n"


@pytest.fixture(scope="module")
def tok():
    import inspect
    import json as json_mod

    from opencomposer.tokenizer.bpe import train_bpe

    return train_bpe([inspect.getsource(json_mod)] * 2, vocab_size=600)


def make_repo(root, n=12):
    root.mkdir(parents=True)
    for i in range(n):
        words = " ".join(f"w{i}_{k}" for k in range(40))
        (root / f"m{i:02d}.py").write_text(CODE.format(i=i, j=i * 7, words=words) * 3)
    (root / "copy.py").write_text((root / "m03.py").read_text())                       # exact duplicate
    (root / "near.py").write_text((root / "m04.py").read_text().replace("total = x", "total  = x", 1))
    (root / "blob.py").write_bytes(b"\x00\x01binary" * 20)                                  # binary
    (root / "tiny.py").write_text("x=1\n")                                                  # under min_bytes
    return root


def test_build_filters_dedups_and_splits(tmp_path, tok):
    repo = make_repo(tmp_path / "repo")
    mix = MixConfig(sources=(SourceConfig(name="code", path=str(repo), weight=1.0),), heldout_fraction=0.25)
    rep = build(mix, tok, tmp_path / "ds")
    sk = rep.skipped["code"]
    assert sk == {"exact_duplicate": 1, "near_duplicate": 1, "binary": 1, "size": 1}
    assert rep.documents["code"] == 12
    t = rep.tokens["code"]
    assert t["train"] > 0 and t["heldout"] > 0
    paths = (tmp_path / "ds" / "heldout" / "code.paths").read_text().split()
    assert paths and not set(paths) & set((tmp_path / "ds" / "train" / "code.paths").read_text().split())


def test_bad_mixes_are_refused(tmp_path, tok):
    repo = make_repo(tmp_path / "repo")
    two = (SourceConfig(name="a", path=str(repo), weight=0.7), SourceConfig(name="b", path=str(repo), weight=0.7))
    with pytest.raises(DataError, match="add up to 1.4"):
        build(MixConfig(sources=two), tok, tmp_path / "ds")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.py").write_bytes(b"\x00" * 500)
    with pytest.raises(DataError, match="no usable documents"):
        build(MixConfig(sources=(SourceConfig(name="b", path=str(tmp_path / "bin")),)), tok, tmp_path / "ds2")
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious.txt").write_text("do not delete")
    with pytest.raises(DataError, match="refusing to overwrite"):
        build(MixConfig(sources=(SourceConfig(name="c", path=str(repo)),)), tok, tmp_path / "keep")
    assert (tmp_path / "keep" / "precious.txt").exists()
    with pytest.raises(DataError, match="not a folder"):
        build(MixConfig(sources=(SourceConfig(name="d", path=str(tmp_path / "nope")),)), tok, tmp_path / "ds3")


def test_packing_is_deterministic_resumable_and_marks_documents(tmp_path, tok):
    repo = make_repo(tmp_path / "repo")
    build(MixConfig(sources=(SourceConfig(name="code", path=str(repo)),), heldout_fraction=0.0), tok, tmp_path / "ds")
    a = PackedSampler(tmp_path / "ds", seq_len=64, seed=3)
    b = PackedSampler(tmp_path / "ds", seq_len=64, seed=3)
    first = [a.batch(2) for _ in range(3)]
    assert all(torch.equal(x[0], y[0]) for x, y in zip(first, [b.batch(2) for _ in range(3)]))
    state = a.state()
    nxt = a.batch(2)
    c = PackedSampler(tmp_path / "ds", seq_len=64, seed=3)
    c.load_state(state)
    assert torch.equal(c.batch(2)[0], nxt[0])
    # segments change exactly after each end-of-text token
    ids, seg = nxt
    eot = tok.token_id("<|endoftext|>")
    for row_ids, row_seg in zip(ids.tolist(), seg.tolist()):
        for t in range(1, len(row_ids)):
            assert (row_seg[t] != row_seg[t - 1]) == (row_ids[t - 1] == eot)
    # consecutive windows continue the stream: the next window starts where this one ended
    s = PackedSampler(tmp_path / "ds", seq_len=64, seed=3)
    w1, _, _ = s.next_sequence()
    w2, _, _ = s.next_sequence()
    assert w1[-1] == w2[0]
    bad = dict(state)
    bad["cursor"] = {"code": 10**9}
    with pytest.raises(DataError, match="past the end"):
        c.load_state(bad)


def test_weights_steer_the_mix(tmp_path, tok):
    r1, r2 = make_repo(tmp_path / "r1"), make_repo(tmp_path / "r2", n=14)
    (r2 / "extra.py").write_text("class Extra:\n    pass\n" * 20)
    mix = MixConfig(sources=(SourceConfig(name="a", path=str(r1), weight=0.9),
                             SourceConfig(name="b", path=str(r2), weight=0.1)), heldout_fraction=0.0,
                    near_dup_threshold=0.0)
    build(mix, tok, tmp_path / "ds")
    s = PackedSampler(tmp_path / "ds", seq_len=32, seed=0)
    names = [s.next_sequence()[2] for _ in range(400)]
    assert 0.84 < names.count("a") / 400 < 0.96


def test_packed_documents_do_not_see_each_other():
    """With segments, the second document's logits equal those of that document alone."""
    from opencomposer.model.deepseek import DeepseekModel, preset
    from opencomposer.model.llama import PRESETS, LlamaModel

    for model in (LlamaModel(PRESETS["tiny"]).eval(), DeepseekModel(preset("tiny-moe")).eval()):
        d1, d2 = torch.randint(0, 512, (1, 7)), torch.randint(0, 512, (1, 9))
        packed = torch.cat([d1, d2], 1)
        seg = torch.tensor([[0] * 7 + [1] * 9])
        with torch.no_grad():
            out = model.run(packed, segments=seg).logits
            alone = model(d2)
        assert torch.allclose(out[:, 7:], alone, atol=1e-5)
        assert torch.allclose(out[:, :7], model(d1), atol=1e-5)
