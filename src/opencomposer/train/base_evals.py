"""Base-model evals (report §2): how base checkpoints are compared — never on agent benchmarks.

- **Codebase perplexity**: the files of a held-out repository concatenated in alphabetical order
  (each after a `# file: <path>` line), scored with a rolling window: every token is predicted
  once, with up to `window - stride` tokens of preceding context.
- **State tracking** (LoCoDiff-style): the model sees a file and a chain of unified diffs and must
  write the final file; scored by character similarity to the truth (1.0 = exact). Cases are
  built from real files with seeded line edits, so the answer is known exactly.

`opencomposer eval base --model DIR [--repo PATH]` runs both and writes JSON.
"""

from __future__ import annotations

import difflib
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class BaseEvalConfig:
    repo: str = "stdlib:tomllib"
    """A folder, or stdlib:<package> (a package this Python ships; held out of the default mix)."""
    include: tuple[str, ...] = ("**/*.py",)
    window: int = 512
    stride: int = 256
    max_tokens: int = 8192
    state_cases: int = 4
    state_diffs: int = 3
    state_lines: int = 24
    seed: int = 0


def repo_files(spec: str, include: tuple[str, ...]) -> tuple[Path, list[Path]]:
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"]) / spec.split(":", 1)[1] if spec.startswith("stdlib:") else Path(spec)
    if not root.is_dir():
        raise FileNotFoundError(f"held-out repository {root} is not a folder")
    files = sorted({p for pat in include for p in root.glob(pat) if p.is_file() and "__pycache__" not in p.parts})
    if not files:
        raise FileNotFoundError(f"{root}: no files match {include}")
    return root, files


def concatenated(root: Path, files: list[Path]) -> str:
    parts = []
    for p in files:
        try:
            parts.append(f"# file: {p.relative_to(root).as_posix()}\n{p.read_text()}\n")
        except (UnicodeDecodeError, OSError):
            continue
    return "".join(parts)


@torch.no_grad()
def rolling_nll(model, ids: list[int], window: int, stride: int) -> tuple[float, int]:
    """(total negative log-likelihood, tokens scored) with a strided rolling window."""
    from opencomposer.model.loss import token_logprobs

    was = model.training
    model.eval()
    total, scored, prev_end = 0.0, 0, 0
    for start in range(0, max(1, len(ids) - 1), stride):
        end = min(start + window, len(ids))
        chunk = torch.tensor([ids[start:end]])
        h = model.run(chunk, logits=False).hidden
        lp = token_logprobs(h[:, :-1], model.lm_head.weight, chunk[:, 1:])[0]
        new = end - max(prev_end, start + 1)  # targets at positions not scored by an earlier window
        if new > 0:
            total -= float(lp[-new:].sum())
            scored += new
        prev_end = end
        if end == len(ids):
            break
    model.train(was)
    return total, scored


def codebase_perplexity(model, tokenizer, cfg: BaseEvalConfig) -> dict:
    root, files = repo_files(cfg.repo, cfg.include)
    ids = tokenizer.encode(concatenated(root, files))[: cfg.max_tokens]
    nll, n = rolling_nll(model, ids, cfg.window, cfg.stride)
    return {"repo": str(root), "files": len(files), "tokens": n, "nll": nll / n, "perplexity": math.exp(nll / n)}


# -- state tracking ----------------------------------------------------------------------------------

@dataclass
class StateCase:
    path: str
    original: str
    diffs: list[str]
    final: str


def make_state_cases(files: list[Path], n: int, n_diffs: int, lines: int, seed: int) -> list[StateCase]:
    """Real file openings, each edited `n_diffs` times (delete, insert or change a line)."""
    rng = random.Random(seed)
    pool = [p for p in files if len(p.read_text(errors="replace").splitlines()) >= lines]
    if not pool:
        raise FileNotFoundError("no file is long enough for state-tracking cases")
    cases = []
    for i in range(n):
        path = pool[i % len(pool)]
        text = path.read_text(errors="replace").splitlines()
        start = rng.randrange(0, max(1, len(text) - lines))
        cur = text[start:start + lines]
        original, diffs = "\n".join(cur) + "\n", []
        for _ in range(n_diffs):
            new = list(cur)
            op, at = rng.choice(("delete", "insert", "change")), rng.randrange(len(new))
            if op == "delete" and len(new) > 2:
                del new[at]
            elif op == "insert":
                new.insert(at, rng.choice(text).rstrip() or "pass")
            else:
                new[at] = new[at].rstrip() + f"  # edited {rng.randrange(1000)}"
            diffs.append("".join(difflib.unified_diff([x + "\n" for x in cur], [x + "\n" for x in new],
                                                      fromfile="a/" + path.name, tofile="b/" + path.name)))
            cur = new
        cases.append(StateCase(path.name, original, diffs, "\n".join(cur) + "\n"))
    return cases


def state_prompt(case: StateCase) -> str:
    parts = [f"Apply the diffs to {case.path} in order and write the final file.\n\nOriginal {case.path}:\n```\n"
             f"{case.original}```\n"]
    parts += [f"\nDiff {i + 1}:\n```diff\n{d}```\n" for i, d in enumerate(case.diffs)]
    parts.append(f"\nFinal {case.path}:\n```\n")
    return "".join(parts)


def similarity(predicted: str, truth: str) -> float:
    """Character similarity in [0, 1] (difflib's ratio, which is 1.0 only for equal strings)."""
    return difflib.SequenceMatcher(None, predicted, truth, autojunk=False).ratio()


def greedy_until(model, prompt: list[int], max_new: int, stop_text: str, decode) -> str:
    """Greedy decoding until `stop_text` appears (checked every 8 tokens)."""
    from opencomposer.model.stage import greedy

    out = greedy(model, prompt, max_new, until=lambda toks: len(toks) % 8 == 0 and stop_text in decode(toks))
    return decode(out).split(stop_text, 1)[0]


def state_tracking(model, tokenizer, cfg: BaseEvalConfig) -> dict:
    _, files = repo_files(cfg.repo, cfg.include)
    cases = make_state_cases(files, cfg.state_cases, cfg.state_diffs, cfg.state_lines, cfg.seed)
    was = model.training
    model.eval()
    scores = []
    for c in cases:
        prompt = tokenizer.encode(state_prompt(c))
        text = greedy_until(model, prompt, len(tokenizer.encode(c.final)) + 16, "```", tokenizer.decode)
        scores.append(similarity(text, c.final))
    model.train(was)
    return {"cases": len(cases), "diffs_per_case": cfg.state_diffs, "mean_similarity": sum(scores) / len(scores),
            "exact": sum(x == 1.0 for x in scores), "scores": scores}


def run(model, tokenizer, cfg: BaseEvalConfig) -> dict:
    return {"codebase_perplexity": codebase_perplexity(model, tokenizer, cfg),
            "state_tracking": state_tracking(model, tokenizer, cfg)}
