"""The weight store: a delta chain with full snapshots, bit-exact reconstruction on a replica, and
corrupt, partial and out-of-order versions rejected while the engine keeps its last good weights."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from opencomposer.inference.engine import Engine, EngineConfig  # noqa: E402
from opencomposer.inference.weight_store import (  # noqa: E402
    WeightPuller,
    WeightStore,
    WeightStoreConfig,
    WeightStoreError,
    state_digest,
)
from opencomposer.model.llama import PRESETS, LlamaModel  # noqa: E402


def model(seed=0):
    torch.manual_seed(seed)
    return LlamaModel(PRESETS["tiny"]).eval()


def step(m: LlamaModel, scale=1e-4) -> dict:
    """A fake optimiser step: every parameter moves a little, as under Adam."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale)
    return {k: v.clone() for k, v in m.to_hf_state().items()}


@pytest.mark.parametrize("url", ["folder", "memory://oc-weights-test"])
def test_replica_follows_the_delta_chain_bit_exactly(tmp_path, url):
    url = str(tmp_path / "store") if url == "folder" else url
    trainer, served = model(), model()
    store = WeightStore(WeightStoreConfig(url=url, full_every=3))
    engine = Engine(served, config=EngineConfig(slots=1, max_len=32))
    puller = WeightPuller(WeightStore(WeightStoreConfig(url=url)), engine)
    kinds = []
    for v in range(1, 6):
        state = step(trainer)
        kinds.append(store.publish(state, v)["kind"])
        assert puller.poll() == v
        assert state_digest(served.to_hf_state()) == state_digest(state)  # bit-exact
    assert kinds == ["full", "delta", "full", "delta", "delta"]
    m = store.manifest(5)
    assert m["base"] == 4 and m["bytes"] < m["raw_bytes"]  # the XOR delta compresses
    assert engine.version == 5 and puller.applied == 5


def test_corrupt_partial_and_out_of_order_versions_are_rejected(tmp_path):
    url = str(tmp_path / "store")
    trainer, served = model(), model()
    store = WeightStore(WeightStoreConfig(url=url, full_every=4))
    engine = Engine(served, config=EngineConfig(slots=1, max_len=32))
    puller = WeightPuller(WeightStore(WeightStoreConfig(url=url)), engine)
    store.publish(step(trainer), 1)
    assert puller.poll() == 1
    good = state_digest(served.to_hf_state())

    store.publish(step(trainer), 2)  # corrupt one byte of the blob
    blob = tmp_path / "store" / "v00000002" / "tensors.zst"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="corrupt or partial"):
        puller.poll()
    assert engine.version == 1 and state_digest(served.to_hf_state()) == good  # still serving v1
    assert puller.seen == 2  # the refusal is about the store up to v2: a full snapshot after it answers it

    store.publish(step(trainer), 3)  # a delta against v2, which this replica never got
    with pytest.raises(WeightStoreError, match="no version in the store applies to version 1"):
        puller.poll()
    assert engine.version == 1 and puller.seen == 3

    # a torn upload: the blob without its manifest is not a version at all
    (tmp_path / "store" / "v00000009").mkdir()
    (tmp_path / "store" / "v00000009" / "tensors.zst").write_bytes(b"partial")
    state4 = step(trainer)
    store.publish(state4, 4)  # a full snapshot: the replica catches up
    assert puller.poll() == 4
    assert state_digest(served.to_hf_state()) == state_digest(state4)
    assert 9 not in store.versions()

    # a manifest that lies about a tensor is caught after reconstruction
    store.publish(step(trainer), 5)
    mpath = tmp_path / "store" / "v00000005" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["tensors"][0]["sha256"] = "0" * 64
    mpath.write_text(json.dumps(m))
    with pytest.raises(WeightStoreError, match="checksum after reconstruction"):
        puller.poll()
    assert engine.version == 4 and len(puller.errors) == 3
    with pytest.raises(WeightStoreError, match="not newer"):
        store.publish(step(trainer), 5)


@pytest.mark.parametrize("url", ["folder", "memory://oc-weights-prune"])
def test_old_versions_are_pruned_behind_the_full_snapshots_and_a_late_replica_catches_up(tmp_path, url):
    url = str(tmp_path / "store") if url == "folder" else url
    trainer, served = model(), model()
    store = WeightStore(WeightStoreConfig(url=url, full_every=3, retain_full=2))
    engine = Engine(served, config=EngineConfig(slots=1, max_len=32))
    puller = WeightPuller(WeightStore(WeightStoreConfig(url=url)), engine)
    store.publish(step(trainer), 1)
    assert puller.poll() == 1  # this replica then falls behind
    for v in range(2, 10):
        last = step(trainer)
        store.publish(last, v)
    # full snapshots at 1, 3, 6, 9: only the two newest and the deltas after 6 remain
    assert store.versions() == [6, 7, 8, 9]
    assert puller.poll() == 9 and state_digest(served.to_hf_state()) == state_digest(last)
    keep_all = WeightStore(WeightStoreConfig(url=url + "-all", full_every=3, retain_full=None))
    for v in range(1, 8):
        keep_all.publish(step(trainer), v)
    assert keep_all.versions() == list(range(1, 8))
