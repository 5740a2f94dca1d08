"""`opencomposer sft -c recipe.toml`: supervised fine-tuning on agent trajectories (report §2).

Examples come from harness trajectories (`trajectory.json` files: every segment is one training
conversation — the context the policy saw plus its completions, tool calls included) or from JSONL
files of `{"messages": [...], "tools": [...]}`. Each is rendered by the one chat renderer
(`tokenizer/chat.py`) with the loss on assistant tokens only; the same renderer serves rollouts
and the server, so the template cannot drift between SFT, RL and serving.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opencomposer.core.metrics import MetricsWriter
from opencomposer.core.rundir import RunDir
from opencomposer.model.loss import IGNORE
from opencomposer.train.pretrain import export, load_base
from opencomposer.train.shared_prefix import SharedPrefixBatch
from opencomposer.train.trainer import OptimConfig, PhaseConfig, Trainer, TrainError


@dataclass(frozen=True, kw_only=True, slots=True)
class SFTConfig:
    model: str = "default"
    moe_backend: str = ""
    """The expert path of a MoE model ("" keeps the model's own); as in PretrainConfig."""
    data: tuple[str, ...] = ()
    """Trajectory files, folders of them (every *.json that is a trajectory), or .jsonl files."""
    phases: tuple[PhaseConfig, ...] = (PhaseConfig(name="sft", steps=50, seq_len=1024, lr=2e-5, warmup=5),)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(batch_size=2))
    share_prefix: bool = True
    """A batch of more than one row computes the prompt its rows share once (the system prompt and
    tool schemas: `train/shared_prefix.py`); the same loss and gradients as the padded batch. Off,
    or with more than one process, batches are padded."""
    heldout_fraction: float = 0.1
    seed: int = 0
    out_dir: Path = Path("runs")
    name: str = "sft"


@dataclass
class Example:
    ids: list[int]
    labels: list[int]
    """Aligned with ids: the token itself where the loss applies, IGNORE elsewhere."""


def conversations(paths: tuple[str, ...], default_tools: list[dict]) -> list[tuple[list[dict], list[dict]]]:
    """(messages, tools) pairs from trajectories and JSONL files."""
    from opencomposer.harness.trajectory import Trajectory

    found: list[tuple[Path, bool]] = []  # (file, named explicitly)
    for p in map(Path, paths):
        if p.is_dir():
            found += [(f, False) for f in sorted(p.rglob("*.json")) + sorted(p.rglob("*.jsonl"))]
        elif p.exists():
            found.append((p, True))
        else:
            raise TrainError(f"SFT data {p} does not exist")
    convs = []
    for f, explicit in found:
        if f.suffix == ".jsonl":
            for i, line in enumerate(f.read_text().splitlines()):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    convs.append((rec["messages"], rec.get("tools") or []))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    if not explicit:
                        break  # some other JSONL found while scanning a folder (results, metrics)
                    raise TrainError(f"{f}:{i + 1}: not a {{'messages': [...]}} record ({e})") from None
        elif not f.name.endswith(".atif.json"):
            try:
                traj = Trajectory.load(f)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                if explicit:
                    raise TrainError(f"{f}: not a trajectory ({e})") from None
                continue  # other JSON found while scanning a folder (summaries, manifests)
            for seg in traj.segments:
                if any(m.get("role") == "assistant" for m in seg.messages):
                    convs.append((seg.messages, traj.extra.get("tools") or default_tools))
    if not convs:
        raise TrainError(f"no conversations with assistant turns in {list(paths)}")
    return convs


def encode(renderer, messages: list[dict], tools: list[dict], max_len: int) -> Example:
    seq = renderer.encode(messages, tools or None)
    ids = seq.ids[:max_len]
    labels = [t if m else IGNORE for t, m in zip(seq.ids, seq.loss_mask)][:max_len]
    return Example(ids, labels)


def collate(batch: list[Example], pad: int) -> tuple[torch.Tensor, None, torch.Tensor]:
    """Right-pad to the longest; padding is never a target. Padding sits after every real token, so
    the plain causal mask is exact for the real tokens (no segment mask: the fast attention path)."""
    n = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), n), pad, dtype=torch.long)
    lab = torch.full((len(batch), n), IGNORE, dtype=torch.long)
    for i, e in enumerate(batch):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        lab[i, : len(e.labels)] = torch.tensor(e.labels)
    return ids, None, lab[:, 1:]


def default_tool_schemas() -> list[dict]:
    from opencomposer.harness.tools import build_toolset

    return build_toolset().schemas()


@torch.no_grad()
def mean_loss(model, examples: list[Example], pad: int, batch_size: int, share_prefix: bool = False) -> float | None:
    """The mean cross-entropy over the examples' labelled tokens. `share_prefix`: the prompt all of
    them share is computed once (`shared_prefix.loss_sum`), as in training (docs/train.md, "SFT")."""
    from opencomposer.model.loss import cross_entropy
    from opencomposer.train import shared_prefix

    if not examples:
        return None
    was = model.training
    model.eval()
    total, count = 0.0, 0
    batch = SharedPrefixBatch.of([(e.ids, e.labels) for e in examples]) if share_prefix and len(examples) > 1 \
        else None
    if batch is not None and batch.prefix:
        total, count = shared_prefix.loss_sum(model, batch)
        model.train(was)
        return total / count if count else None
    for i in range(0, len(examples), batch_size):
        ids, seg, lab = collate(examples[i:i + batch_size], pad)
        h = model.run(ids, logits=False, segments=seg).hidden
        n = int((lab != IGNORE).sum())
        if n:
            total += float(cross_entropy(h[:, :-1], model.lm_head.weight, lab)) * n
            count += n
    model.train(was)
    return total / count if count else None


def run(cfg: SFTConfig, *, run_dir: RunDir | None = None, data_dir: Path = Path("data"), progress=None) -> dict:
    from opencomposer.tokenizer.chat import ChatRenderer

    torch.manual_seed(cfg.seed)
    model, tok, folder = load_base(cfg.model, data_dir, cfg.moe_backend)  # a bad model leaves no run folder
    run_dir = run_dir or RunDir.create(cfg.out_dir, cfg.name)
    run_dir.write_config(cfg)
    renderer = ChatRenderer(tok)
    max_len = max(p.seq_len for p in cfg.phases)
    convs = conversations(cfg.data, default_tool_schemas())
    examples = [encode(renderer, m, t, max_len) for m, t in convs]
    examples = [e for e in examples if any(x != IGNORE for x in e.labels[1:])]
    if not examples:
        raise TrainError("no example has an assistant token within the sequence length")
    rng = random.Random(cfg.seed)
    rng.shuffle(examples)
    n_held = int(len(examples) * cfg.heldout_fraction) if len(examples) > 4 else 0
    held, train = examples[:n_held], examples[n_held:]
    pad = tok.eos_id if tok.eos_id is not None else 0
    order = {"epoch": 0, "i": 0}

    perms: dict[int, list[int]] = {}

    def permutation(epoch: int) -> list[int]:  # each epoch's order, derived from (seed, epoch)
        if epoch not in perms:
            perms.clear()
            idx = list(range(len(train)))
            random.Random(cfg.seed + epoch).shuffle(idx)
            perms[epoch] = idx
        return perms[epoch]

    def batches(pi: int, phase: PhaseConfig):
        out = []
        for _ in range(cfg.optim.batch_size):
            if order["i"] >= len(train):
                order["epoch"] += 1
                order["i"] = 0
            ex = train[permutation(order["epoch"])[order["i"]]]
            order["i"] += 1
            out.append(Example(ex.ids[: phase.seq_len], ex.labels[: phase.seq_len]))
        if cfg.share_prefix and len(out) > 1 and trainer.world == 1 and not phase.mtp_weight:
            return SharedPrefixBatch.of([(e.ids, e.labels) for e in out])
        return collate(out, pad)

    with MetricsWriter(run_dir.metrics) as metrics:
        trainer = Trainer(model, cfg.optim, cfg.phases, run_dir.root / "checkpoints", metrics,
                          tokenizer_json=folder / "tokenizer.json")
        pos = trainer.resume()
        order.update(pos.get("order", {}))
        shared = cfg.share_prefix and trainer.world == 1  # as the batches
        before = mean_loss(model, held or train[:8], pad, cfg.optim.batch_size, shared)
        history = trainer.run(batches, lambda: {"order": dict(order)}, on_progress=progress)
        after = mean_loss(model, held or train[:8], pad, cfg.optim.batch_size, shared)
        metrics.log(step=trainer.step, sft_loss_before=before, sft_loss_after=after)
    out = export(model, folder, run_dir.root / "model")
    summary = {"base": str(folder), "model": str(out), "examples": len(train), "heldout_examples": len(held),
               "assistant_tokens": sum(sum(1 for x in e.labels if x != IGNORE) for e in train),
               "steps": trainer.step, "loss_before": before, "loss_after": after,
               "final_train_loss": history[-1]["loss"] if history else None}
    run_dir.write_json("summary.json", summary)
    return summary
