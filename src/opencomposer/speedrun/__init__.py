"""`opencomposer speedrun`: the Composer recipe in miniature on the embedded default, then the report card.

The recipe (report §2–4): import the base (SmolLM2-135M-Instruct from the GGUF on PyPI) -> agent
eval of the base on the held-out split (served by our server, acting through the real harness,
graded in sandboxes) -> CPT on a code mix, with the base-model evals (codebase perplexity, state
tracking) before and after -> SFT on demonstrations of the train split -> agent eval -> the
asynchronous RL loop on the train split -> agent eval -> report card. The component checks
(isolation, fork, the harness on a planted bug, task gates and runner calibration, serving
numerics, kernels) run first, as a short "system checks" section.

Presets live in `configs/` (`--preset smoke`, `--preset default`, ...; `-c FILE` for your own).
Every stage writes into its own folder of the run, so `report.py` reads the run folder alone.
Resumable: a stage that ended is never run again; a second invocation with the same recipe finds
the newest run that was killed or had a stage fail (or `--run_dir` names one) and runs the stages
that did not end — the agent evals and RL continue from their own files, the other stages start
over. `--fresh` starts a new run folder.
"""

from __future__ import annotations

import gc
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.core import memory
from opencomposer.core.config import dump_json
from opencomposer.core.errors import UserError
from opencomposer.core.metrics import EventLog, MetricsWriter, read_jsonl
from opencomposer.core.rundir import RunDir
from opencomposer.evals import stage as evals_stage
from opencomposer.harness import stage as harness_stage
from opencomposer.inference import stage as inference_stage
from opencomposer.model import stage as model_stage
from opencomposer.rl import stage as rl_stage
from opencomposer.sandbox import stage as sandbox_stage
from opencomposer.speedrun.agent import (
    AgentControlConfig,
    AgentEvalConfig,
    AgentSettings,
    kept_for_rl,
    run_agent_eval,
    run_demonstrations,
)
from opencomposer.train import precision
from opencomposer.train import stage as train_stage

log = logging.getLogger(__name__)

CHECKS = ("sandbox", "harness", "evals", "model", "inference", "kernels")
RECIPE = ("agent_base", "cpt", "sft", "agent_sft", "rl", "agent_rl", "agent_control")
RESUMES_ITSELF = {"agent_base", "agent_sft", "agent_rl", "agent_control", "rl", "evals"}
"""Stages that continue from their own files after a kill (eval results, RL checkpoints, a
complete task build); every other unfinished stage's folder is cleared and the stage starts over."""


class SpeedrunFailed(RuntimeError, UserError):
    """One or more stages failed; the report card was written with them marked."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedrunConfig:
    out_dir: Path = Path("runs")
    """Parent folder of run folders."""
    name: str = "speedrun"
    preset: str = "default"
    """The recipe's name, for the report card (the preset file sets it)."""
    run_dir: Path | None = None
    """Continue this run folder (default: the newest unfinished run of the same recipe in out_dir)."""
    fresh: bool = False
    """Start a new run folder even when an unfinished run of the same recipe exists."""
    tasks: Path | None = None
    """The task family the agent stages, SFT and RL use (default: the one the evals stage builds,
    `evals/tasks`). A dataset folder with a manifest that puts tasks in `train_split` and in
    `agent_eval.split` (e.g. `opencomposer tasks build-default`); see docs/speedrun.md."""
    train_split: str = "train"
    rl_share: float = 0.0
    """The share of the train split kept for RL: SFT sees no demonstration of those tasks, and RL
    draws its groups from them only (`agent.kept_for_rl`; 0: SFT and RL both use every train task).
    RL on tasks whose demonstrations SFT learned spends most groups where every rollout passes (7 of
    15 in one `renames-small` run, docs/rl.md), and such a group teaches nothing about passing."""
    stages: tuple[str, ...] = CHECKS + RECIPE
    """Which stages run, in the fixed order of CHECKS + RECIPE."""
    agent: AgentSettings = field(default_factory=AgentSettings)
    agent_eval: AgentEvalConfig = field(default_factory=AgentEvalConfig)
    sandbox: sandbox_stage.SandboxStageConfig = field(default_factory=sandbox_stage.SandboxStageConfig)
    harness: harness_stage.HarnessStageConfig = field(default_factory=harness_stage.HarnessStageConfig)
    evals: evals_stage.EvalsStageConfig = field(default_factory=evals_stage.EvalsStageConfig)
    model: model_stage.ModelStageConfig = field(default_factory=model_stage.ModelStageConfig)
    inference: inference_stage.InferenceStageConfig = field(default_factory=inference_stage.InferenceStageConfig)
    cpt: train_stage.CPTStageConfig = field(default_factory=train_stage.CPTStageConfig)
    sft: train_stage.SFTStageConfig = field(default_factory=train_stage.SFTStageConfig)
    rl: rl_stage.RLStageConfig = field(default_factory=rl_stage.RLStageConfig)
    agent_control: AgentControlConfig = field(default_factory=AgentControlConfig)
    """Off by default: the lr = 0 control's agent eval (`AgentControlConfig`)."""
    kernels: precision.KernelsStageConfig = field(default_factory=precision.KernelsStageConfig)


def preset_file(name: str) -> Path:
    """configs/speedrun-<name>.toml, from the working directory or from this checkout."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        p = root / "configs" / f"speedrun-{name}.toml"
        if p.is_file():
            return p
    found = sorted(p.stem.removeprefix("speedrun-") for p in (Path(__file__).resolve().parents[3] / "configs")
                   .glob("speedrun-*.toml"))
    raise SpeedrunFailed(f"no preset {name!r} (configs/speedrun-{name}.toml); presets: {found}")


def base_model(cfg: SpeedrunConfig, run_dir: RunDir) -> Path:
    """The embedded default as imported by the model stage (imported on demand when it was skipped)."""
    folder = cfg.model.folder or run_dir.root / "model" / "smollm2-135m-instruct"
    if not (folder / "config.json").exists():
        from opencomposer.model.interop import import_default

        import_default(folder)
    return folder


def recipe_key(cfg: SpeedrunConfig) -> str:
    """What must match for a run folder to be continued: the whole recipe, not where it runs."""
    import dataclasses

    return dump_json(dataclasses.replace(cfg, out_dir=Path("runs"), run_dir=None, fresh=False))


def open_run(cfg: SpeedrunConfig) -> tuple[RunDir, bool]:
    """(run folder, resumed?)."""
    if cfg.run_dir is not None:
        if Path(cfg.run_dir).is_dir():
            return RunDir.open(cfg.run_dir), True
        Path(cfg.run_dir).mkdir(parents=True)
        return RunDir(Path(cfg.run_dir)), False
    if not cfg.fresh and Path(cfg.out_dir).is_dir():
        key = recipe_key(cfg)
        for root in sorted(Path(cfg.out_dir).glob(f"*-{cfg.name}"), reverse=True):
            events = list(read_jsonl(root / "events.jsonl"))
            done = any(e["event"] == "speedrun_end" and not e.get("failed") for e in events)  # failed: retried
            if not done and (root / "recipe.json").is_file() and (root / "recipe.json").read_text() == key:
                return RunDir.open(root), True
    return RunDir.create(cfg.out_dir, cfg.name), False


def environment() -> dict:
    import os
    import platform
    import subprocess

    import torch

    from opencomposer.kernels.bf16 import native_bf16

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "cpu_bf16": native_bf16(), "opencomposer_commit": commit, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def finished_stages(run_dir: RunDir) -> set[str]:
    """Stages whose last record is a stage_end: their outputs are complete."""
    last: dict[str, str] = {}
    for e in read_jsonl(run_dir.events):
        if "stage" in e:
            last[e["stage"]] = e["event"]
    return {s for s, ev in last.items() if ev == "stage_end"}


def run(cfg: SpeedrunConfig) -> RunDir:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from opencomposer import report
    from opencomposer.core.log import setup_logging

    unknown = set(cfg.stages) - set(CHECKS + RECIPE)
    if unknown:
        raise SpeedrunFailed(f"unknown stage(s) {sorted(unknown)}; the stages are {list(CHECKS + RECIPE)}")
    run_dir, resumed = open_run(cfg)
    setup_logging(file=run_dir.log)
    if resumed and (run_dir.root / "recipe.json").is_file() and \
            (run_dir.root / "recipe.json").read_text() != recipe_key(cfg):
        raise SpeedrunFailed(f"{run_dir.root} was started with another recipe (recipe.json); continue it with that "
                             "recipe, or pass --fresh")
    (run_dir.root / "recipe.json").write_text(recipe_key(cfg))
    run_dir.write_config(cfg)
    if not (run_dir.root / "environment.json").exists():
        run_dir.write_json("environment.json", environment())
    done = finished_stages(run_dir) if resumed else set()
    log.info("speedrun %s -> %s%s", cfg.preset, run_dir.root,
             f" (resumed: {len(done)} stage(s) already done)" if resumed else "")
    events = EventLog(run_dir.events)
    metrics = MetricsWriter(run_dir.metrics)
    failed: list[str] = []
    with events, metrics, Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()) as bar:
        events.emit("speedrun_start", preset=cfg.preset, resumed=resumed, kept=sorted(done))
        for name in CHECKS + RECIPE:
            if name not in cfg.stages or not getattr(getattr(cfg, name, None), "enabled", True):
                events.emit("stage_skipped", stage=name)
                continue
            if name in done:
                continue
            if name not in RESUMES_ITSELF and (run_dir.root / name).exists():
                shutil.rmtree(run_dir.root / name)  # a stage killed mid-way starts over
            events.emit("stage_start", stage=name)
            t0 = time.monotonic()
            try:
                run_stage(name, cfg, run_dir, metrics, bar)
            except KeyboardInterrupt:
                events.emit("stage_failed", stage=name, error="interrupted")
                report.write(run_dir)  # what ran so far, with the interrupted stage marked
                raise
            except Exception as e:
                # Marked in the report card; the later stages still run (each says clearly what it lacks).
                import traceback

                # The traceback goes to the run folder (events.jsonl); the console gets one line.
                events.emit("stage_failed", stage=name, error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc())
                log.error("stage %s failed: %s: %s", name, type(e).__name__, e)
                failed.append(name)
                continue
            gc.collect()
            memory.trim()  # what the stage freed goes back to the OS before the next one (core/memory.py)
            events.emit("stage_end", stage=name, seconds=time.monotonic() - t0, **memory.usage())
        events.emit("speedrun_end", failed=failed)
    path = report.write(run_dir)
    log.info("report card: %s (and %s)", path, path.with_suffix(".html"))
    if failed:
        raise SpeedrunFailed(f"stage(s) {', '.join(failed)} failed (see {run_dir.log}); the report card with them "
                             f"marked is {path}")
    return run_dir


def run_stage(name: str, cfg: SpeedrunConfig, run_dir: RunDir, metrics: MetricsWriter, bar) -> None:
    root = run_dir.root
    tasks = Path(cfg.tasks) if cfg.tasks is not None else root / "evals" / "tasks"
    one_shot = {"harness": ("harness: agent loop on a planted bug", harness_stage.run),
                "model": ("model: import SmolLM2, answer a coding prompt", model_stage.run),
                "inference": ("inference: serve it, sample, check numerics, swap weights", inference_stage.run)}
    if name in one_shot:
        task = bar.add_task(one_shot[name][0], total=None)
        one_shot[name][1](getattr(cfg, name), run_dir, metrics)
        bar.update(task, total=1, completed=1)
    elif name == "sandbox":
        task = bar.add_task("sandbox: checks, tests, fork, latency", total=cfg.sandbox.latency_samples)
        sandbox_stage.run(cfg.sandbox, run_dir, metrics, progress=lambda: bar.advance(task))
    elif name == "evals":
        task = bar.add_task("tasks: build + validate, oracle/noop calibration", total=None)
        evals_stage.run(cfg.evals, run_dir, metrics,
                        progress=lambda m: bar.update(task, description=f"tasks: {m}"[:70]))
        bar.update(task, total=1, completed=1)
    elif name == "kernels":
        task = bar.add_task("kernels: formats vs float64, a MoE per backend",
                            total=cfg.kernels.steps * len(cfg.kernels.backends))
        precision.run(cfg.kernels, run_dir, metrics, progress=lambda: bar.advance(task))
    elif name in ("agent_base", "agent_sft", "agent_rl", "agent_control"):
        # the control evaluates the SFT weights: what RL at lr 0 would export (AgentControlConfig)
        model = base_model(cfg, run_dir) if name == "agent_base" else \
            root / {"agent_control": "sft"}.get(name, name.removeprefix("agent_")) / "model"
        if not (tasks / "manifest.json").exists():
            raise FileNotFoundError(f"{name}: no task family at {tasks} (did the evals stage fail?)")
        task = bar.add_task(f"{name}: the served model through the harness, held out", total=None)
        run_agent_eval(name, cfg.agent_eval, cfg.agent, run_dir, metrics, model, tasks,
                       progress=lambda rec: bar.advance(task))
        bar.update(task, total=1, completed=1)
    elif name == "cpt":
        task = bar.add_task("cpt: code mix, base evals before/after", total=cfg.cpt.steps)
        train_stage.run_cpt(cfg.cpt, run_dir, metrics, base_model(cfg, run_dir),
                            progress=lambda step, rec: bar.update(task, completed=step))
    elif name == "sft":
        task = bar.add_task("sft: demonstrations of the train split", total=cfg.sft.steps)
        data = run_demonstrations(cfg.agent, tasks, cfg.train_split, root / "sft" / "demonstrations",
                                  exclude=kept_for_rl(tasks, cfg.train_split, cfg.rl_share), spans=cfg.sft.span_edits)
        cpt = root / "cpt" / "model"
        train_stage.run_sft(cfg.sft, run_dir, metrics, cpt if cpt.exists() else base_model(cfg, run_dir), data,
                            progress=lambda step, rec: bar.update(task, completed=step))
    elif name == "rl":
        task = bar.add_task("rl: asynchronous GRPO in the harness, train split", total=cfg.rl.steps)
        rl_stage.run(cfg.rl, cfg.agent, run_dir, metrics, root / "sft" / "model", tasks, cfg.train_split,
                     progress=lambda rec: bar.update(task, completed=rec["step"]),
                     task_ids=kept_for_rl(tasks, cfg.train_split, cfg.rl_share))
