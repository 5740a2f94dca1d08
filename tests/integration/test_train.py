"""Continued pretraining, SFT and base-model evals end to end on tiny real models with a tokenizer
trained here: resume equality, a measured perplexity drop, assistant-only SFT loss, MTP
self-distillation, schedules."""

from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")

from opencomposer.core.metrics import read_jsonl  # noqa: E402
from opencomposer.model.deepseek import DeepseekModel, preset  # noqa: E402
from opencomposer.model.hf import save_model  # noqa: E402
from opencomposer.model.llama import LlamaConfig, LlamaModel  # noqa: E402
from opencomposer.train import base_evals, pretrain, sft  # noqa: E402
from opencomposer.train.data import MixConfig, SourceConfig  # noqa: E402
from opencomposer.train.trainer import OptimConfig, PhaseConfig, TrainError, lr_at  # noqa: E402

MIX = MixConfig(sources=(SourceConfig(name="stdlib", path="stdlib", include=("json/*.py", "email/*.py", "csv.py"),
                                      weight=1.0),), heldout_fraction=0.1)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    import inspect
    import json as json_mod
    import textwrap

    from opencomposer.tokenizer.bpe import train_bpe

    tok = train_bpe([inspect.getsource(json_mod), inspect.getsource(textwrap)] * 2, vocab_size=800)
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=1024))
    folder = tmp_path_factory.mktemp("m") / "tiny"
    save_model(model, folder)
    tok.save(folder / "tokenizer.json")
    return folder


def test_schedules():
    p = PhaseConfig(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, p) == pytest.approx(0.1) and lr_at(9, p) == pytest.approx(1.0)
    assert lr_at(99, p) == pytest.approx(0.1, abs=1e-3)
    w = PhaseConfig(steps=100, warmup=0, lr=1.0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, w) == 1.0 and lr_at(79, w) == 1.0 and lr_at(99, w) == pytest.approx(0.0)
    with pytest.raises(TrainError, match="unknown schedule"):
        lr_at(0, PhaseConfig(schedule="linear"))


def _cfg(folder, run_dir, steps=(4, 2), **kw):
    phases = (PhaseConfig(name="bulk", steps=steps[0], seq_len=64, lr=3e-3, warmup=1),
              PhaseConfig(name="long", steps=steps[1], seq_len=128, lr=1e-3, warmup=0, schedule="constant",
                          rope_theta=40000.0))
    return pretrain.PretrainConfig(model=str(folder), mix=MIX, phases=phases, run_dir=run_dir,
                                   optim=OptimConfig(batch_size=2, ckpt_every=3, grad_accum=2), **kw)


def test_resume_reproduces_the_uninterrupted_run(tiny_folder, tmp_path):
    full = pretrain.run(_cfg(tiny_folder, tmp_path / "full"))
    losses = [r["loss"] for r in read_jsonl(tmp_path / "full" / "metrics.jsonl") if "loss" in r]
    assert full["steps"] == 6 and len(losses) == 6
    assert json.loads((tmp_path / "full" / "model" / "config.json").read_text())["rope_theta"] == 40000.0
    # an interrupted run: the same recipe stopped at its step-3 checkpoint, then restarted
    part = tmp_path / "part"
    pretrain.run(_cfg(tiny_folder, part, max_steps=3))
    cut = _cfg(tiny_folder, part)
    pretrain.run(cut)  # resumes from step 3 in the same run folder
    resumed = [r["loss"] for r in read_jsonl(part / "metrics.jsonl") if "loss" in r]
    assert resumed[3:] == losses[3:]  # bit-identical, not approximately equal


def test_short_cpt_lowers_heldout_codebase_perplexity(tiny_folder, tmp_path):
    from opencomposer.model.hf import load_model
    from opencomposer.tokenizer.bpe import Tokenizer

    ev = base_evals.BaseEvalConfig(repo="stdlib:tomllib", window=128, stride=64, max_tokens=2048)
    tok = Tokenizer.load(tiny_folder)
    before = base_evals.codebase_perplexity(load_model(tiny_folder), tok, ev)["perplexity"]
    cfg = pretrain.PretrainConfig(model=str(tiny_folder), mix=MIX, run_dir=tmp_path / "cpt",
                                  phases=(PhaseConfig(steps=40, seq_len=128, lr=3e-3, warmup=4),),
                                  optim=OptimConfig(batch_size=4, ckpt_every=100))
    summary = pretrain.run(cfg)
    after = base_evals.codebase_perplexity(load_model(summary["model"]), tok, ev)["perplexity"]
    assert after < 0.5 * before, (before, after)
    assert summary["heldout"][1]["heldout_loss"] < summary["heldout"][0]["heldout_loss"]


def test_rolling_window_scores_every_token_once(tiny_folder):
    from opencomposer.model.hf import load_model
    from opencomposer.model.loss import token_logprobs

    model = load_model(tiny_folder).eval()
    ids = torch.randint(0, 700, (300,)).tolist()
    nll, n = base_evals.rolling_nll(model, ids, window=1024, stride=512)
    with torch.no_grad():
        h = model.run(torch.tensor([ids]), logits=False).hidden
        ref = -float(token_logprobs(h[:, :-1], model.lm_head.weight, torch.tensor([ids[1:]])).sum())
    assert n == 299 and abs(nll - ref) < 1e-2
    _, n2 = base_evals.rolling_nll(model, ids, window=100, stride=40)
    assert n2 == 299


def test_state_tracking_scores_perfect_and_broken_reconstructions(tiny_folder):
    _, files = base_evals.repo_files("stdlib:json", ("*.py",))
    (case,) = base_evals.make_state_cases(files, 1, 3, 20, seed=1)
    assert len(case.diffs) == 3 and case.final != case.original
    assert base_evals.similarity(case.final, case.final) == 1.0
    broken = case.final.replace("\n", "\n#", 2)
    assert 0.5 < base_evals.similarity(broken, case.final) < 1.0
    assert base_evals.similarity(case.original, case.final) < 1.0
    from opencomposer.model.hf import load_model
    from opencomposer.tokenizer.bpe import Tokenizer

    res = base_evals.state_tracking(load_model(tiny_folder), Tokenizer.load(tiny_folder),
                                    base_evals.BaseEvalConfig(repo="stdlib:json", state_cases=2, state_lines=12))
    assert res["cases"] == 2 and 0.0 <= res["mean_similarity"] < 1.0  # a random tiny model is not exact


def test_sft_trains_only_assistant_tokens(tiny_folder, tmp_path):
    from opencomposer.model.loss import IGNORE
    from opencomposer.tokenizer.bpe import Tokenizer
    from opencomposer.tokenizer.chat import ChatRenderer

    renderer = ChatRenderer(Tokenizer.load(tiny_folder))
    msgs = [{"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "Reading.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"a\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
            {"role": "assistant", "content": "Done."}]
    ex = sft.encode(renderer, msgs, [], 4096)
    seq = renderer.encode(msgs)
    assert [t for t, m in zip(seq.ids, seq.loss_mask) if m] == [x for x in ex.labels if x != IGNORE]
    assert sum(x != IGNORE for x in ex.labels) < len(ex.ids) / 2
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps({"messages": msgs}) for _ in range(6)))
    summary = sft.run(sft.SFTConfig(model=str(tiny_folder), data=(str(data), "tests/data/golden_trajectory.json"),
                                    phases=(PhaseConfig(name="sft", steps=12, seq_len=512, lr=3e-3, warmup=1),),
                                    optim=OptimConfig(batch_size=2, ckpt_every=100), out_dir=tmp_path))
    assert summary["examples"] >= 6 and summary["loss_after"] < summary["loss_before"]
    with pytest.raises(TrainError, match="does not exist"):
        sft.conversations(("nope.jsonl",), [])


def test_mtp_self_distillation_pulls_the_mtp_head_to_the_main_head(tmp_path):
    from opencomposer.tokenizer.bpe import train_bpe
    from opencomposer.train.trainer import Trainer, mtp_distill_loss

    tok = train_bpe(["def f(x):\n    return x\n" * 50], vocab_size=300)
    ids = torch.randint(0, tok.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    labels = ids[:, 1:]
    kls = {}
    for weight in (1.0, 0.0):  # with and without distillation; the main head learns the same data
        torch.manual_seed(0)
        model = DeepseekModel(preset("tiny-moe", vocab_size=tok.vocab_size))
        phase = PhaseConfig(steps=15, seq_len=32, lr=1e-2, warmup=0, schedule="constant", mtp_weight=weight)
        hist = Trainer(model, OptimConfig(ckpt_every=1000), (phase,), tmp_path / str(weight)).run(
            lambda pi, ph: (ids, None, labels), lambda: {})
        assert ("mtp_kl" in hist[-1]) == (weight > 0)  # the control (0) trains the main head only
        with torch.no_grad():
            kls[weight] = mtp_distill_loss(model, ids, None, labels, 1.0)[1]
    assert kls[1.0] < 0.5 * kls[0.0], kls
    with pytest.raises(TrainError, match="MTP heads"):
        Trainer(LlamaModel(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1)), OptimConfig(),
                (PhaseConfig(mtp_weight=1.0),), tmp_path / "x")


def test_fsdp2_two_processes_match_one(tiny_folder, tmp_path):
    """The same recipe under torchrun with 2 CPU processes (gloo, FSDP2) follows the single-process
    loss curve; its checkpoint resumes in one process."""
    import os
    import subprocess
    import sys

    one = pretrain.run(_cfg(tiny_folder, tmp_path / "one"))
    base = [r["loss"] for r in read_jsonl(tmp_path / "one" / "metrics.jsonl") if "loss" in r]
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'''model = "{tiny_folder}"
run_dir = "{tmp_path / 'two'}"
[mix]
heldout_fraction = 0.1
[[mix.sources]]
name = "stdlib"
path = "stdlib"
include = ["json/*.py", "email/*.py", "csv.py"]
weight = 1.0
[optim]
batch_size = 2
grad_accum = 2
ckpt_every = 3
[[phases]]
name = "bulk"
steps = 4
seq_len = 64
lr = 3e-3
warmup = 1
[[phases]]
name = "long"
steps = 2
seq_len = 128
lr = 1e-3
warmup = 0
schedule = "constant"
rope_theta = 40000.0
''')
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous (--master_port=0 hung here)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
                        "-m", "opencomposer.cli", "pretrain", "-c", str(recipe)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    two = [r["loss"] for r in read_jsonl(tmp_path / "two" / "metrics.jsonl") if "loss" in r]
    assert len(two) == len(base) == 6
    assert max(abs(a - b) for a, b in zip(two, base)) < 1e-4, (two, base)
    # the distributed checkpoint is an ordinary one: the model folder loads in one process
    from opencomposer.model.hf import load_model

    ids = torch.randint(0, 700, (1, 12))
    with torch.no_grad():
        a = load_model(tmp_path / "two" / "model")(ids)
        b = load_model(tmp_path / "one" / "model")(ids)
    assert (a - b).abs().max() < 1e-3
    assert (tmp_path / "two" / "checkpoints").is_dir() and one["steps"] == 6


def test_cpt_vs_rl_study_first_part(tiny_folder, tmp_path):
    from opencomposer.train import study

    data = tmp_path / "sft.jsonl"
    msgs = [{"role": "user", "content": "add two numbers"}, {"role": "assistant", "content": "def add(a, b):\n"
                                                                                          "    return a + b\n"}]
    data.write_text("\n".join(json.dumps({"messages": msgs}) for _ in range(4)))
    cfg = study.StudyConfig(
        pretrain=pretrain.PretrainConfig(model=str(tiny_folder), mix=MIX, eval_batches=2,
                                         phases=(PhaseConfig(steps=1, seq_len=64, lr=3e-3, warmup=1),),
                                         optim=OptimConfig(batch_size=2, ckpt_every=1000)),
        sft=sft.SFTConfig(data=(str(data),), phases=(PhaseConfig(name="sft", steps=2, seq_len=256, lr=1e-3,
                                                                 warmup=0),),
                          optim=OptimConfig(batch_size=2, ckpt_every=1000)),
        levels=(2, 8), out_dir=tmp_path)
    res = study.run(cfg)
    rows = res["rows"]
    assert [r["cpt_steps"] for r in rows] == [2, 8] and rows[1]["cpt_flops"] == 4 * rows[0]["cpt_flops"]
    assert rows[1]["cpt_heldout_loss"] < rows[0]["cpt_heldout_loss"]  # more CPT, lower loss: measured
    assert all(r["sft_loss"] > 0 and r["rl_reward"] is None for r in rows)
    from pathlib import Path

    assert Path(res["folder"], "study.svg").read_text().count("<circle") == 2


def test_bf16_autocast_trains(tmp_path):
    from opencomposer.train.trainer import Trainer

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    hist = Trainer(model, OptimConfig(bf16=True, ckpt_every=1000),
                   (PhaseConfig(steps=8, seq_len=16, lr=1e-2, warmup=0, schedule="constant"),), tmp_path).run(
        lambda pi, ph: (ids, None, ids[:, 1:]), lambda: {})
    assert all(math.isfinite(h["loss"]) for h in hist) and hist[-1]["loss"] < hist[0]["loss"]
    assert next(model.parameters()).dtype == torch.float32  # autocast: weights stay float32


def test_pretrain_picks_the_moe_backend(tiny_folder, tmp_path):
    """`moe_backend` in the recipe puts a MoE model's experts on the low-precision path (it is ours,
    not in the Hugging Face config); a dense model or an unknown backend is refused up front."""
    from opencomposer.tokenizer.bpe import Tokenizer

    tok = Tokenizer.load(tiny_folder / "tokenizer.json")
    torch.manual_seed(0)
    folder = tmp_path / "moe"
    save_model(DeepseekModel(preset("tiny-moe", vocab_size=tok.vocab_size, num_nextn_predict_layers=0)), folder)
    tok.save(folder / "tokenizer.json")
    model, _, _ = pretrain.load_base(str(folder), tmp_path, "nvfp4")
    assert model.config.moe_backend == "nvfp4"
    assert {m.backend for m in model.modules() if hasattr(m, "backend")} == {"nvfp4"}
    phases = (PhaseConfig(steps=3, seq_len=64, lr=3e-3, warmup=0),)
    res = pretrain.run(pretrain.PretrainConfig(model=str(folder), moe_backend="fp8-block", mix=MIX, phases=phases,
                                               run_dir=tmp_path / "run", optim=OptimConfig(batch_size=2)))
    assert res["steps"] == 3
    assert all(math.isfinite(r["loss"]) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r)
    with pytest.raises(TrainError, match="needs a mixture-of-experts model"):
        pretrain.load_base(str(tiny_folder), tmp_path, "nvfp4")
    with pytest.raises(TrainError, match="not registered"):
        pretrain.load_base(str(folder), tmp_path, "int3")
