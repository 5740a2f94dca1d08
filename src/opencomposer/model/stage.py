"""The speedrun's model stage: the embedded default base model, end to end in our own code.

Imports SmolLM2-135M-Instruct from its GGUF into a Hugging Face folder, loads it with our Llama
implementation, renders a coding request with our chat renderer and tokenizer, and decodes an
answer greedily with the KV cache. (The batched engine and server come with the inference stage.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir

PROMPT = "Write a Python function that returns the sum of a list."


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelStageConfig:
    enabled: bool = True
    folder: Path | None = None
    """Where the imported model lives (default: <run>/model/smollm2-135m-instruct)."""
    max_new_tokens: int = 48


def greedy(model, ids: list[int], max_new_tokens: int, stop: set[int] = frozenset(), until=None) -> list[int]:
    """Greedy decoding with the model's KV cache, batch 1: stops before a token in `stop`, or
    after the token for which `until(tokens so far)` is true."""
    import torch

    with torch.no_grad():
        cache = model.new_cache(1, len(ids) + max_new_tokens + 1)
        logits = model.run(torch.tensor([ids]), cache=cache, logits="last").logits
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(logits[0, -1].argmax())
            if nxt in stop:
                break
            out.append(nxt)
            if until is not None and until(out):
                break
            logits = model.run(torch.tensor([[nxt]]), cache=cache, logits="last").logits
    return out


def run(cfg: ModelStageConfig, run_dir: RunDir, metrics: MetricsWriter) -> dict:
    import torch

    from opencomposer.model.hf import load_model
    from opencomposer.model.interop import import_default
    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.tokenizer.chat import ChatRenderer

    folder = cfg.folder or run_dir.stage("model") / "smollm2-135m-instruct"
    t0 = time.perf_counter()
    if not (folder / "config.json").exists():  # a folder of your own model is used as it is
        import_default(folder)
    import_s = time.perf_counter() - t0
    torch.manual_seed(0)
    model = load_model(folder).eval()
    tok = Tokenizer.load(folder)
    renderer = ChatRenderer(tok)
    seq = renderer.encode([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    t1 = time.perf_counter()
    out = greedy(model, seq.ids, cfg.max_new_tokens, {tok.eos_id})
    gen_s = time.perf_counter() - t1
    answer = tok.decode(out)
    summary = {"folder": str(folder), "parameters": model.num_parameters(), "import_seconds": import_s,
               "prompt": PROMPT, "prompt_tokens": len(seq.ids), "answer": answer, "new_tokens": len(out),
               "tokens_per_second": len(out) / gen_s if gen_s else None,
               "writes_code": "def " in answer and "return" in answer}
    run_dir.write_json("model/summary.json", summary)
    metrics.log(stage="model", parameters=summary["parameters"], tokens_per_second=summary["tokens_per_second"])
    return summary
