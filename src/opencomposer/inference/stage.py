"""The speedrun's inference stage: the embedded default model served by our engine behind the
OpenAI-compatible server, exercised with the official `openai` client.

It measures time to first token (streaming) and batched decode throughput (n = 8 samples of one
prompt: prefix sharing), checks train/serve numerics (the served log-probabilities against a
training-mode forward over the same tokens), and swaps in a new weight version through the
authenticated admin endpoint in the middle of a generation (tokens after the swap carry it).
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir

PROMPT = "Write a Python function that checks whether a string is a palindrome."


@dataclass(frozen=True, kw_only=True, slots=True)
class InferenceStageConfig:
    enabled: bool = True
    folder: Path | None = None
    """The model folder (default: the model stage's import)."""
    samples: int = 8
    max_tokens: int = 40
    temperature: float = 0.7


def run(cfg: InferenceStageConfig, run_dir: RunDir, metrics: MetricsWriter) -> dict:
    import openai
    import torch

    from opencomposer.inference.server import ServeConfig, Server, load_served
    from opencomposer.inference.weights import checksum
    from opencomposer.model.hf import save_model
    from opencomposer.model.interop import import_default
    from opencomposer.model.loss import token_logprobs

    folder = cfg.folder or run_dir.stage("model") / "smollm2-135m-instruct"
    if not (folder / "config.json").exists():
        import_default(folder)
    token = secrets.token_hex(8)
    engine, tok = load_served(folder, slots=max(8, cfg.samples), max_len=1024)
    msgs = [{"role": "user", "content": PROMPT}]
    with Server(engine, tok, folder.name, ServeConfig(port=0, admin_token=token)) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
        t0 = time.perf_counter()
        stream = client.chat.completions.create(model=srv.name, messages=msgs, max_tokens=8, stream=True,
                                                temperature=0)
        ttft = None
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        r = client.chat.completions.create(model=srv.name, messages=msgs, n=cfg.samples, seed=0, logprobs=True,
                                           max_tokens=cfg.max_tokens, temperature=cfg.temperature)
        batch_s = time.perf_counter() - t1
        ext = r.choices[0].model_extra["opencomposer"]
        ids = ext["prompt_token_ids"] + ext["token_ids"]
        model = engine.model
        with torch.no_grad():
            h = model.run(torch.tensor([ids]), logits=False).hidden
            n = len(ext["prompt_token_ids"])
            lp = token_logprobs(h[:, n - 1:-1], model.lm_head.weight, torch.tensor([ext["token_ids"]]),
                                cfg.temperature)[0]
        drift = float((lp - torch.tensor(ext["logprobs"])).abs().max())

        # in-flight weight update: the same weights re-published as version 1 mid-generation
        upd = save_model(model, run_dir.stage("inference") / "weights-v1")
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(r=client.chat.completions.create(
            model=srv.name, messages=msgs, max_tokens=48, temperature=0)))
        worker.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(len(s.tokens) >= 4 for s in list(engine._running.values())):
            time.sleep(0.01)
        req = urllib.request.Request(srv.url.removesuffix("/v1") + "/admin/weights", method="POST",
                                     data=json.dumps({"path": str(upd), "version": 1,
                                                      "checksum": checksum(upd)}).encode(),
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            swap = json.loads(resp.read())
        worker.join(300)
        versions = result["r"].choices[0].model_extra["opencomposer"]["policy_versions"]
    shutil.rmtree(upd, ignore_errors=True)  # a copy of the model, written only to be swapped in (514 MB)
    completion_tokens = r.usage.completion_tokens
    summary = {"folder": str(folder), "prompt": PROMPT, "answer": r.choices[0].message.content,
               "ttft_ms": (ttft or 0) * 1e3, "samples": cfg.samples, "completion_tokens": completion_tokens,
               "batch_seconds": batch_s, "tokens_per_second": completion_tokens / batch_s,
               "max_logprob_drift": drift, "swap_seconds": swap["swap_seconds"],
               "versions_before_after": [versions.count(0), versions.count(1)],
               "version_switch_ok": versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1,
               "distinct_samples": len({c.message.content for c in r.choices})}
    run_dir.write_json("inference/summary.json", summary)
    metrics.log(stage="inference", ttft_ms=summary["ttft_ms"], tokens_per_second=summary["tokens_per_second"],
                max_logprob_drift=drift)
    return summary
