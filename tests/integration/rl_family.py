"""A tiny task family the RL tests learn on: real stdlib bug-fix tasks (colorsys, built by the task
builders, graded by colorsys' own tests), a tiny real model taught by SFT on two behaviours for each
task — apply the fix with `search_replace` then stop, or stop at once — calibrated so that the fix
is sampled 30-50% of the time at the tests' temperature (TEMPERATURE, which the RL tests sample at).
RL in the real harness must raise that; with learning rate 0 it must not. The model is trained here
in seconds; nothing is scripted at sampling time."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from opencomposer.evals.runner import oracle_calls
from opencomposer.harness import prompt
from opencomposer.harness.agent import Agent
from opencomposer.harness.policy import ScriptedPolicy
from opencomposer.model.hf import save_model
from opencomposer.model.llama import LlamaConfig, LlamaModel
from opencomposer.rl.loop import RLConfig, agent_config
from opencomposer.sandbox.local import Workspace
from opencomposer.tasks.builders.deletion import BuildConfig
from opencomposer.tasks.default import DefaultBenchmarkConfig, build_default
from opencomposer.tasks.format import load_dataset
from opencomposer.tokenizer.bpe import train_bpe
from opencomposer.tokenizer.chat import ChatRenderer

TOOLS = ("search_replace",)
log = logging.getLogger(__name__)


def episode(task, turns, cfg) -> tuple[list[dict], list[dict]]:
    with Workspace(task.repo, task.sandbox_config()) as ws, ws.sandbox() as sb:
        traj = Agent(ScriptedPolicy(turns), sb, agent_config(cfg)).run(task.prompt)
    return traj.segments[0].messages, traj.extra["tools"]


TEMPERATURE = 0.7  # the RL tests sample at it; the family is calibrated at it
BRANCH = (0.3, 0.5)  # the fix's probability at the branch token, at TEMPERATURE
REST = 0.5  # the most log-probability the fix may lose after its branch token, at TEMPERATURE


def sft_step(model, opt, seq, weight: float, skip: int | None = None) -> None:
    """One step on `seq`'s assistant tokens; `skip` leaves out the prediction at that position."""
    ids = torch.tensor([seq.ids])
    mask = torch.tensor([seq.loss_mask[1:]], dtype=torch.float32)
    if skip is not None:
        mask[0, skip] = 0.0
    lp = torch.log_softmax(model(ids[:, :-1]).float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -weight * (lp * mask).sum() / 50.0  # summed, not averaged: the first-token choice counts the same in both
    opt.zero_grad()
    loss.backward()
    opt.step()


def teacher_logprobs(model, seq) -> torch.Tensor:
    """Log-probabilities at TEMPERATURE of each next token of `seq` (position k predicts ids[k+1])."""
    ids = torch.tensor([seq.ids])
    with torch.no_grad():
        logits = model(ids[:, :-1]).float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]


def calibrate(model, opt, good, bad, max_steps: int = 200) -> float:
    """More SFT steps until the fix is sampled at the branch token with a probability within BRANCH
    and the rest of the fix is still followed token by token; returns the probability. The 1:2
    mixture alone lands anywhere from a few percent to a third depending on the machine's float
    rounding (CI once measured a start of 0/16): a start that never passes gives RL nothing to learn
    from. Steps on stopping alone can unlearn the fix after its branch (CI once saw log-prob -7.5), so
    a step on the fix without its branch token repairs it whenever it slips. A family that cannot
    meet both fails here, not in the RL test."""
    i = next(k for k, (a, b) in enumerate(zip(good.ids, bad.ids)) if a != b)
    mask = torch.tensor(good.loss_mask[1:], dtype=torch.bool)
    start = None
    for step in range(max_steps):
        lp = teacher_logprobs(model, good)
        p, rest = lp[i - 1].exp().item(), lp[mask].sum().item() - lp[i - 1].item()
        start = p if start is None else start
        if rest < -REST:
            sft_step(model, opt, good, 1.0, skip=i - 1)
        elif p < BRANCH[0]:
            sft_step(model, opt, good, 1.0)
        elif p > BRANCH[1]:
            sft_step(model, opt, bad, 1.0)
        else:
            break
    else:
        raise RuntimeError(f"the family did not calibrate: fix probability {p:.3f} (want {BRANCH}), "
                           f"the rest of the fix at log-prob {rest:.2f} (want >= {-REST})")
    log.info("family: fix probability %.3f -> %.3f in %d steps; the rest of the fix at log-prob %.3f",
             start, p, step, rest)
    return p


def build_family(root: Path, n_tasks: int = 1, seed: int = 0, sft_steps: int = 300) -> tuple[Path, Path]:
    """(tasks folder, model folder) under `root`."""
    built = root / "built"
    build_default(built, DefaultBenchmarkConfig(sources=("colorsys",), build=BuildConfig(max_single=4, max_multi=0)))
    tasks_dir = root / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    tasks = [t for t in load_dataset(built) if t.spec.category == "bug_fix"][:n_tasks]
    for t in tasks:
        shutil.copytree(t.root, tasks_dir / t.id, symlinks=True)
    tasks = load_dataset(tasks_dir)
    cfg = RLConfig(model=root, tasks=tasks_dir, tools=TOOLS)
    convs, tools = [], None
    for t in tasks:
        fix = [{"tool_calls": oracle_calls(t)}, {"content": "Done."}]
        good, tools = episode(t, fix, cfg)
        bad, _ = episode(t, [{"content": "Done."}], cfg)
        convs += [(good, 1.0), (bad, 2.0)]  # stopping at once weighs double: the start passes about a third of the time
    texts = [json.dumps(c) for c, _ in convs] + [json.dumps(tools), prompt.SYSTEM]
    tok = train_bpe(texts * 10, vocab_size=3000)
    torch.manual_seed(seed)
    model = LlamaModel(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=4096, tie_word_embeddings=True))
    r = ChatRenderer(tok)
    seqs = [(r.encode(c, tools), w) for c, w in convs]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: a second thread only contends on a busy 2-core machine
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(sft_steps):
        for s, w in seqs:
            sft_step(model, opt, s, w)
    for (good, _), (bad, _) in zip(seqs[::2], seqs[1::2]):
        calibrate(model, opt, good, bad)
    torch.set_num_threads(threads)
    folder = root / "model"
    save_model(model.eval(), folder)
    tok.save(folder / "tokenizer.json")
    return tasks_dir, folder
