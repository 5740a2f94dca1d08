"""The OpenAI-compatible server, tested with the official `openai` client over real HTTP, on tiny
real models (random weights) with a BPE tokenizer trained here; one scripted fake model
(`ScriptedToolCallerFake`) makes tool calls happen deterministically."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from opencomposer.inference.engine import Engine, EngineConfig  # noqa: E402
from opencomposer.inference.server import Server, ServeConfig, load_served  # noqa: E402
from opencomposer.inference.weights import checksum  # noqa: E402
from opencomposer.model.cache import KVCache  # noqa: E402
from opencomposer.model.deepseek import DeepseekModel, preset  # noqa: E402
from opencomposer.model.hf import save_model  # noqa: E402
from opencomposer.model.layers import ForwardOut  # noqa: E402
from opencomposer.model.llama import LlamaConfig, LlamaModel  # noqa: E402
from opencomposer.model.loss import token_logprobs  # noqa: E402
from opencomposer.tokenizer.bpe import train_bpe  # noqa: E402
from opencomposer.tokenizer.chat import ChatRenderer  # noqa: E402

ADMIN = "s3cret"


@pytest.fixture(scope="module")
def tokenizer():
    import inspect
    import json as json_mod

    return train_bpe([inspect.getsource(json_mod), inspect.getsource(threading)] * 2, vocab_size=700)


def _folder(root: Path, model, tok) -> Path:
    save_model(model, root)
    tok.save(root / "tokenizer.json")
    return root


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512))
    folder = _folder(tmp_path_factory.mktemp("llama") / "tiny-llama", model, tokenizer)
    engine, tok = load_served(folder, slots=8)
    with Server(engine, tok, "tiny-llama", ServeConfig(port=0, admin_token=ADMIN, default_max_tokens=16)) as srv:
        yield srv, folder


@pytest.fixture
def client(llama_server):
    return openai.OpenAI(base_url=llama_server[0].url, api_key="x", max_retries=0, timeout=60)


MSG = [{"role": "user", "content": "def add(a, b):"}]


def recompute(srv: Server, prompt, tokens, temperature=1.0):
    model = srv.engine.model
    with torch.no_grad():
        h = model.run(torch.tensor([prompt + tokens]), logits=False).hidden
        return token_logprobs(h[:, len(prompt) - 1:-1], model.lm_head.weight, torch.tensor([tokens]), temperature)[0]


def test_models_health_and_metrics(llama_server, client):
    srv, _ = llama_server
    assert [m.id for m in client.models.list().data] == ["tiny-llama"]
    health = json.loads(urllib.request.urlopen(srv.url.removesuffix("/v1") + "/health", timeout=10).read())
    assert health["status"] == "ok"
    before = srv.engine.stats["generated_tokens"]
    r = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=3)
    text = urllib.request.urlopen(srv.url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    assert "# TYPE opencomposer_generated_tokens_total counter" in text
    # (a random model may stop early: compare with what this request reports, not with max_tokens)
    assert float(text.split("\nopencomposer_generated_tokens_total ")[1].split()[0]) >= \
        before + r.usage.completion_tokens >= 1



def test_prefix_cache_hits_are_reported_as_openai_does(llama_server, client):
    """A follow-up turn (the conversation so far + a new message) reuses the cached KV: the official
    client reads usage.prompt_tokens_details.cached_tokens, and /metrics shows the hit rate."""
    srv, _ = llama_server
    first = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=4, temperature=0.0)
    ids = first.choices[0].model_extra["opencomposer"]["token_ids"]  # the harness sends its turns back as sampled
    follow = MSG + [{"role": "assistant", "content": first.choices[0].message.content or "",
                     "opencomposer": {"token_ids": ids}}, {"role": "user", "content": "and subtract?"}]
    again = client.chat.completions.create(model="tiny-llama", messages=follow, max_tokens=4, temperature=0.0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    # everything the first request computed: its prompt and its completion but the last token
    assert cached == first.usage.prompt_tokens + len(ids) - 1 < again.usage.prompt_tokens
    assert again.choices[0].model_extra["opencomposer"]["cached_tokens"] == cached
    text = urllib.request.urlopen(srv.url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    rate = float(text.split("\nopencomposer_prefix_cache_hit_rate ")[1].split()[0])
    assert 0 < rate < 1 and "opencomposer_prefix_cache_evictions_total" in text

def test_chat_returns_tokens_logprobs_and_versions(llama_server, client, tokenizer):
    srv, _ = llama_server
    r = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=12, temperature=0.8,
                                       logprobs=True, top_logprobs=3, seed=7)
    ch = r.choices[0]
    ext = ch.model_extra["opencomposer"]
    prompt = ChatRenderer(tokenizer).encode(MSG, add_generation_prompt=True).ids
    assert ext["prompt_token_ids"] == prompt and r.usage.prompt_tokens == len(prompt)
    assert len(ext["token_ids"]) == r.usage.completion_tokens == len(ch.logprobs.content)
    assert [t.logprob for t in ch.logprobs.content] == ext["logprobs"]
    assert all(len(t.top_logprobs) == 3 for t in ch.logprobs.content)
    assert ext["policy_versions"] == [srv.engine.version] * len(ext["token_ids"])
    # train/serve numerics: the served logprobs are what a training forward computes
    assert (recompute(srv, prompt, ext["token_ids"], 0.8) - torch.tensor(ext["logprobs"])).abs().max() < 1e-4
    if ch.finish_reason == "length":
        assert len(ext["token_ids"]) == 12


def test_n_seeds_and_streaming(client):
    a = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=10, n=3, seed=1)
    b = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=10, n=3, seed=1)
    assert len(a.choices) == 3 and [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    full = client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=14, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=14, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    assert finals[0].choices[0].model_extra["opencomposer"]["token_ids"] == \
        full.choices[0].model_extra["opencomposer"]["token_ids"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_endpoint(client, llama_server, tokenizer):
    r = client.completions.create(model="tiny-llama", prompt="import json\n", max_tokens=6, logprobs=2, seed=0)
    ch = r.choices[0]
    ext = ch.model_extra["opencomposer"]
    assert ext["prompt_token_ids"] == tokenizer.encode("import json\n")
    assert ch.logprobs.token_logprobs == ext["logprobs"] and len(ch.logprobs.top_logprobs[0]) == 2
    ids = client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert ids.choices[0].model_extra["opencomposer"]["prompt_token_ids"] == [5, 6, 7]


def test_bad_requests_get_clear_errors(client, llama_server):
    srv, _ = llama_server
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=MSG)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
        client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x " * 2000}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny-llama", messages=MSG, temperature=-1)
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]"):
        client.chat.completions.create(model="tiny-llama", messages=MSG, tools=[{"type": "function"}])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="tiny-llama", messages=MSG, tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-llama", messages=[])
    req = urllib.request.Request(srv.url + "/chat/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and "not JSON" in json.loads(e.value.read())["error"]["message"]
    # still serving
    assert client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=2).choices


def test_client_disconnect_mid_stream_frees_the_slot(llama_server, monkeypatch):
    srv, _ = llama_server
    # a random model may sample end-of-turn early and finish before the disconnect is noticed
    monkeypatch.setattr(srv.tokenizer, "eos_id", None)
    monkeypatch.setattr(srv.engine, "eos_ids", ())
    host, port = srv.address
    aborted = srv.engine.stats["aborted"]
    body = json.dumps({"model": "tiny-llama", "messages": MSG, "max_tokens": 400, "stream": True,
                       "temperature": 1.0}).encode()
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got, deadline = b"", time.monotonic() + 30
    while b"data:" not in got and time.monotonic() < deadline:
        got += s.recv(4096)
    assert b"data:" in got
    s.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (srv.engine.stats["aborted"] == aborted or srv.engine._running):
        time.sleep(0.05)
    assert srv.engine.stats["aborted"] == aborted + 1 and not srv.engine._running


def test_many_clients_at_once_get_their_own_answers(llama_server, tokenizer):
    srv, _ = llama_server
    renderer = ChatRenderer(tokenizer)
    out, errors = {}, []

    def one(i):
        try:
            c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=120)
            msgs = [{"role": "user", "content": f"request number {i}: " + "x" * i}]
            r = c.chat.completions.create(model="tiny-llama", messages=msgs, max_tokens=8, seed=i)
            out[i] = (renderer.encode(msgs, add_generation_prompt=True).ids, r.choices[0].model_extra["opencomposer"])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors and len(out) == 16
    for prompt, ext in out.values():
        assert ext["prompt_token_ids"] == prompt
        assert (recompute(srv, prompt, ext["token_ids"]) - torch.tensor(ext["logprobs"])).abs().max() < 1e-4


def _admin(srv, body: dict, token: str | None = ADMIN, what: str = "weights"):
    req = urllib.request.Request(srv.url.removesuffix("/v1") + f"/admin/{what}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_in_flight_weight_update_through_the_admin_endpoint(llama_server, tmp_path, client):
    srv, folder = llama_server
    engine = srv.engine
    v0 = engine.version
    model = engine.model
    new = LlamaModel(model.config)
    new.load_state_dict({k: v + 0.01 for k, v in model.state_dict().items()})
    upd = save_model(new, tmp_path / "v1")
    bad = LlamaModel(LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    save_model(bad, tmp_path / "bad")
    assert _admin(srv, {"path": str(upd), "version": v0 + 1}, token=None)[0] == 401
    assert _admin(srv, {"path": str(upd), "version": v0 + 1}, token="wrong")[0] == 401
    code, err = _admin(srv, {"path": str(tmp_path / "bad"), "version": v0 + 1})
    assert code == 400 and "has shape" in err["error"]["message"] and engine.version == v0
    code, err = _admin(srv, {"path": str(upd), "version": v0 + 1, "checksum": "0" * 64})
    assert code == 400 and "checksum" in err["error"]["message"] and engine.version == v0

    result = {}
    t = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
        model="tiny-llama", messages=MSG, max_tokens=120, temperature=1.0, seed=3)))
    t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(len(s.tokens) >= 3 for s in list(engine._running.values())):
        time.sleep(0.005)
    code, ok = _admin(srv, {"path": str(upd), "version": v0 + 1, "checksum": checksum(upd)})
    t.join(120)
    assert code == 200 and ok["version"] == v0 + 1 and ok["swap_seconds"] is not None
    versions = result["r"].choices[0].model_extra["opencomposer"]["policy_versions"]
    assert versions == sorted(versions) and versions[0] == v0
    if result["r"].choices[0].finish_reason == "length":  # the sequence ran past the swap
        assert versions[-1] == v0 + 1
    assert client.models.list().data[0].model_extra["policy_version"] == v0 + 1


def test_admin_threads_reach_the_engine_at_its_next_step(llama_server, client):
    """What an RL driver uses to lend its trainer's cores to the replica (`RLConfig.lend_threads`)."""
    srv, _ = llama_server
    health = srv.url.removesuffix("/v1") + "/health"
    before = json.loads(urllib.request.urlopen(health, timeout=10).read())["threads"]
    want = 2 if before != 2 else 1
    assert _admin(srv, {"threads": want}, token=None, what="threads")[0] == 401
    for bad in ({"threads": 0}, {"threads": "2"}, {"threads": True}, {"threads": 10_000}, {}):
        code, err = _admin(srv, bad, what="threads")
        assert code == 400 and "threads" in err["error"]["message"]
    try:
        code, ok = _admin(srv, {"threads": want}, what="threads")
        assert code == 200 and ok["threads"] == want
        client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=2, temperature=0)  # a step
        assert json.loads(urllib.request.urlopen(health, timeout=10).read())["threads"] == want == srv.engine.threads
    finally:
        srv.engine.set_threads(before)
        client.chat.completions.create(model="tiny-llama", messages=MSG, max_tokens=2, temperature=0)
    assert srv.engine.threads == before


def test_moe_server_returns_routed_experts_that_replay(tmp_path, tokenizer):
    torch.manual_seed(0)
    model = DeepseekModel(preset("tiny-moe", vocab_size=tokenizer.vocab_size))
    folder = _folder(tmp_path / "tiny-moe", model, tokenizer)
    engine, tok = load_served(folder, slots=4)
    with Server(engine, tok, "tiny-moe", ServeConfig(port=0)) as srv:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="tiny-moe", messages=MSG, max_tokens=6, seed=0)
        ext = r.choices[0].model_extra["opencomposer"]
    ids = ext["prompt_token_ids"] + ext["token_ids"]
    experts = torch.tensor(ext["routed_experts"])
    assert experts.shape == (len(ids) - 1, model.config.num_moe_layers, model.config.num_experts_per_tok)
    replay = torch.cat([experts, torch.full((1, *experts.shape[1:]), -1)])[None]
    m = engine.model
    with torch.no_grad():
        out = m.run(torch.tensor([ids]), replay=replay, logits=False)
        n = len(ext["prompt_token_ids"])
        lp = token_logprobs(out.hidden[:, n - 1:-1], m.lm_head.weight, torch.tensor([ext["token_ids"]]))[0]
    assert (lp - torch.tensor(ext["logprobs"])).abs().max() < 1e-4


class ScriptedToolCallerFake(torch.nn.Module):
    """A FAKE language model for one test: whatever the prompt, it writes a fixed text (a tool call)
    token by token with certainty. It lets the real engine, server, renderer and client be tested on
    tool calls, which random tiny models never produce."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.script = script
        self.config = LlamaConfig(vocab_size=vocab, max_position_embeddings=1024)
        self.lm_head = torch.nn.Linear(1, vocab, bias=False)
        self._prompt_len: dict[int, int] = {}

    def new_cache(self, slots, max_len=None):
        return KVCache(1, slots, max_len or 1024)

    def run(self, ids, *, cache=None, rows=None, **_):
        rows = cache.rows_tensor(rows)
        b, t = ids.shape
        logits = torch.full((b, t, self.config.vocab_size), -30.0)
        for i, r in enumerate(rows.tolist()):
            if t > 1:
                self._prompt_len[r] = t
            k = int(cache.lengths[r]) + t - self._prompt_len[r]  # tokens generated after this step
            logits[i, -1, self.script[min(k, len(self.script) - 1)]] = 30.0
        cache.advance(rows, t)
        return ForwardOut(logits=logits, hidden=torch.zeros(b, t, 1))

    def hf_target(self, name, state=None):
        return None


def test_tool_calls_through_server_and_the_harness_policy(tokenizer):
    from opencomposer.harness.openai_policy import OpenAIPolicy

    text = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>'
    fake = ScriptedToolCallerFake(tokenizer.encode(text), tokenizer.vocab_size)
    engine = Engine(fake, config=EngineConfig(slots=2, max_len=1024), eos_ids=(tokenizer.eos_id,),
                    decode=tokenizer.decode)
    tools = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                               "parameters": {"type": "object", "properties": {"path": {
                                                   "type": "string"}}}}}]
    with Server(engine, tokenizer, "fake", ServeConfig(port=0)) as srv:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="fake", messages=MSG, tools=tools)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content.strip() == "Let me look."
        call = ch.message.tool_calls[0]
        assert call.function.name == "read_file" and json.loads(call.function.arguments) == {"path": "a.py"}
        chunks = list(c.chat.completions.create(model="fake", messages=MSG, tools=tools, stream=True))
        streamed = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
        assert streamed.strip() == "Let me look." and "<tool_call>" not in streamed
        deltas = [tc for x in chunks if x.choices for tc in (x.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "read_file"
        # the harness's client, unchanged, against our server
        comp = OpenAIPolicy(base_url=srv.url, model="fake").complete(MSG, tools)
        assert comp.tool_calls[0].name == "read_file" and comp.token_ids[-1] == tokenizer.eos_id
        assert comp.policy_versions == [0] * len(comp.token_ids) and len(comp.logprobs) == len(comp.token_ids)


def _serve_process(cmd: list[str], ready: Path):
    """`opencomposer serve` started as its own process, returned once its ready file exists."""
    import os
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    deadline = time.monotonic() + 240
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.stderr.read().decode()[-2000:])
        time.sleep(0.1)
    return proc


def test_serve_follows_a_weight_store_as_its_own_process(tmp_path, tokenizer):
    """`opencomposer serve --weights STORE` (an RL replica): a process that serves the store's
    newest version, follows new ones in flight, and reports a corrupt one in /health and
    /metrics while it keeps serving the last good weights."""
    import sys

    from opencomposer.inference.weight_store import WeightStore, WeightStoreConfig, _name

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512))
    store = WeightStore(WeightStoreConfig(url=str(tmp_path / "store"), full_every=10))

    def publish(version):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        return store.publish(model.to_hf_state(), version)

    publish(0)
    folder = _folder(tmp_path / "m", model, tokenizer)  # the replica starts from version 0's weights
    publish(1)
    ready = tmp_path / "ready.json"
    proc = _serve_process([sys.executable, "-m", "opencomposer.cli", "serve", "--model", str(folder), "--port", "0",
                           "--weights", str(tmp_path / "store"), f"--ready_file={json.dumps(str(ready))}"], ready)
    try:
        base = json.loads(ready.read_text())["url"].removesuffix("/v1")

        def health():
            with urllib.request.urlopen(base + "/health", timeout=10) as r:
                return json.loads(r.read())

        assert health()["policy_version"] == 1  # the store's newest before the first request
        publish(2)
        m = publish(3)
        blob = tmp_path / "store" / _name(3) / "tensors.zst"  # v3 arrives corrupt
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        assert m["kind"] == "delta"
        deadline = time.monotonic() + 60
        while health().get("weights", {}).get("rejected", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        h = health()
        assert h["policy_version"] == 2 and h["weights"]["rejected"] == 1  # v2 applied, v3 refused
        assert "checksum" in h["weights"]["refusals"][0]["error"] or "corrupt" in h["weights"]["refusals"][0]["error"]
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            assert "opencomposer_weights_rejected_total 1" in r.read().decode()
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=4, temperature=0.0)
        assert r.choices[0].model_extra["opencomposer"]["policy_versions"] == [2] * len(
            r.choices[0].model_extra["opencomposer"]["token_ids"])  # still serving the last good one
    finally:
        proc.terminate()
        proc.wait(30)


HANGING_STOP = """
import sys, threading
from opencomposer.inference.engine import Engine
Engine.stop = lambda self, timeout=10.0: threading.Event().wait()  # the fault: a stop that never returns
from opencomposer.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("hang", [False, True])
def test_serve_ends_within_its_shutdown_deadline(llama_server, tmp_path, hang):
    """SIGTERM (what an RL replica gets when its driver dies) ends `opencomposer serve`: cleanly
    (exit 0) when its stop works, and with exit 1 and a one-line reason once
    `shutdown_timeout_s` has passed when its stop hangs (a fault injected into Engine.stop)."""
    import os
    import signal
    import sys

    ready = tmp_path / "ready.json"
    args = ["serve", "--model", str(llama_server[1]), "--port", "0", f"--ready_file={json.dumps(str(ready))}",
            "--shutdown_timeout_s=3"]
    cmd = [sys.executable, "-c", HANGING_STOP, *args] if hang else [sys.executable, "-m", "opencomposer.cli", *args]
    proc = _serve_process(cmd, ready)
    try:
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(60)
        err = proc.stderr.read().decode()
        assert rc == (1 if hang else 0), err[-2000:]
        assert ("did not finish within 3 s" in err) == hang, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


SIGTERM_ON_A_THREAD = """
import json, signal, sys, threading, time
from pathlib import Path
ready = Path(json.loads(next(a for a in sys.argv if a.startswith("--ready_file="))[len("--ready_file="):]))
def late_signal():  # once it serves, SIGTERM lands on this thread, not the main one
    while not ready.exists():
        time.sleep(0.05)
    time.sleep(0.5)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
threading.Thread(target=late_signal, daemon=True).start()
from opencomposer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_ends_on_a_sigterm_that_another_thread_receives(llama_server, tmp_path):
    """The kernel may hand a process's SIGTERM to any of its threads. CPython runs the handler
    in the main thread only, so a main thread blocked in an untimed wait never ran it: a replica
    outlived its SIGKILLed driver (PR_SET_PDEATHSIG sent the SIGTERM) in a loaded test run."""
    import sys

    ready = tmp_path / "ready.json"
    proc = _serve_process([sys.executable, "-c", SIGTERM_ON_A_THREAD, "serve", "--model", str(llama_server[1]),
                           "--port", "0", f"--ready_file={json.dumps(str(ready))}", "--shutdown_timeout_s=20"], ready)
    try:
        rc = proc.wait(120)  # the stop itself takes a second or two; the deadline is for a busy machine
        assert rc == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


LAUNCHER = """
import os, subprocess, sys, time
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "OPENCOMPOSER_PARENT_PID": str(os.getpid())})
print(child.pid, flush=True)
time.sleep(3600)
"""


def test_serve_ends_when_the_process_that_started_it_dies(llama_server, tmp_path):
    """`OPENCOMPOSER_PARENT_PID` (set by the RL driver for its replica): a server whose parent is
    SIGKILLed stops on its own, with no signal sent to it (the launcher here sets no
    PR_SET_PDEATHSIG)."""
    import os
    import signal
    import subprocess
    import sys

    ready = tmp_path / "ready.json"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "opencomposer.cli", "serve",
                                 "--model", str(llama_server[1]), "--port", "0",
                                 f"--ready_file={json.dumps(str(ready))}"],
                                stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")})
    server = int(launcher.stdout.readline())
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        launcher.kill()
        launcher.wait(30)
        deadline = time.monotonic() + 60
        while Path(f"/proc/{server}").exists() and Path(f"/proc/{server}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the server outlived the process that started it"
            time.sleep(0.2)
    finally:
        if Path(f"/proc/{server}").exists():
            os.kill(server, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_a_stopped_server_lets_go_of_its_engine(llama_server):
    """FastAPI caches every app's endpoint functions module-wide; they must not keep a stopped
    server's engine (model, KV cache, prefix cache) alive: the speedrun's driver grew by a served
    model per agent eval that way."""
    import gc
    import weakref

    folder = llama_server[1]
    engine, tok = load_served(folder, slots=2)
    alive = weakref.ref(engine)
    srv = Server(engine, tok, "tiny-llama", ServeConfig(port=0, default_max_tokens=4)).start()
    try:
        c = openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60)
        assert c.chat.completions.create(model="tiny-llama", messages=MSG).choices
    finally:
        srv.stop()
    del srv, engine, c
    gc.collect()
    assert alive() is None
