"""`opencomposer speedrun`: every stage that exists, on the embedded default, then the report card.

Stages so far: sandbox (isolation checks, real tests in a sandbox, snapshot/fork on real code,
latency); harness (the agent loop fixing a planted bug through the real tools, graded in a fresh
sandbox); evals (a benchmark built from real code, every task gated, the runner calibrated with
oracle = 100% and noop = 0%); model (the embedded SmolLM2 imported from GGUF and run by our own
Llama code, tokenizer and chat renderer); inference (that model served by our engine behind the
OpenAI-compatible server: latency, batched sampling, train/serve numerics, an in-flight weight
swap); cpt (continued pretraining on a code mix with codebase perplexity and state tracking before
and after); sft (the run's own agent trajectories, assistant-only loss); kernels (the quantisers
against float64, grouped-GEMM errors per format, and a tiny MoE trained per low-precision expert
backend against float32). Later capabilities (asynchronous RL, scale-out) add theirs here, each
writing into its own folder of the run so that `report.py` can read the run folder alone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from opencomposer.core.errors import UserError
from opencomposer.core.metrics import EventLog, MetricsWriter
from opencomposer.core.rundir import RunDir
from opencomposer.evals import stage as evals_stage
from opencomposer.harness import stage as harness_stage
from opencomposer.inference import stage as inference_stage
from opencomposer.model import stage as model_stage
from opencomposer.sandbox import stage as sandbox_stage
from opencomposer.train import precision
from opencomposer.train import stage as train_stage

log = logging.getLogger(__name__)


class SpeedrunFailed(RuntimeError, UserError):
    """One or more stages failed; the report card was written with them marked."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeedrunConfig:
    out_dir: Path = Path("runs")
    """Parent folder of run folders."""
    name: str = "speedrun"
    sandbox: sandbox_stage.SandboxStageConfig = field(default_factory=sandbox_stage.SandboxStageConfig)
    harness: harness_stage.HarnessStageConfig = field(default_factory=harness_stage.HarnessStageConfig)
    evals: evals_stage.EvalsStageConfig = field(default_factory=evals_stage.EvalsStageConfig)
    model: model_stage.ModelStageConfig = field(default_factory=model_stage.ModelStageConfig)
    inference: inference_stage.InferenceStageConfig = field(default_factory=inference_stage.InferenceStageConfig)
    cpt: train_stage.CPTStageConfig = field(default_factory=train_stage.CPTStageConfig)
    sft: train_stage.SFTStageConfig = field(default_factory=train_stage.SFTStageConfig)
    kernels: precision.KernelsStageConfig = field(default_factory=precision.KernelsStageConfig)


def base_model(cfg: SpeedrunConfig, run_dir: RunDir) -> Path:
    """The embedded default as imported by the model stage (imported on demand when it was skipped)."""
    return cfg.model.folder or run_dir.root / "model" / "smollm2-135m-instruct"


def run(cfg: SpeedrunConfig) -> RunDir:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from opencomposer import report
    from opencomposer.core.log import setup_logging

    run_dir = RunDir.create(cfg.out_dir, cfg.name)
    setup_logging(file=run_dir.log)
    run_dir.write_config(cfg)
    events = EventLog(run_dir.events)
    metrics = MetricsWriter(run_dir.metrics)
    log.info("speedrun -> %s", run_dir.root)
    stages = [("sandbox", cfg.sandbox.enabled), ("harness", cfg.harness.enabled), ("evals", cfg.evals.enabled),
              ("model", cfg.model.enabled), ("inference", cfg.inference.enabled), ("cpt", cfg.cpt.enabled),
              ("sft", cfg.sft.enabled), ("kernels", cfg.kernels.enabled)]
    failed: list[str] = []
    with events, metrics, Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()) as bar:
        for name, enabled in stages:
            if not enabled:
                events.emit("stage_skipped", stage=name)
                continue
            events.emit("stage_start", stage=name)
            t0 = time.monotonic()
            try:
                if name == "sandbox":
                    task = bar.add_task("sandbox: checks, tests, fork, latency", total=cfg.sandbox.latency_samples)
                    sandbox_stage.run(cfg.sandbox, run_dir, metrics, progress=lambda: bar.advance(task))
                elif name == "harness":
                    task = bar.add_task("harness: agent loop on a planted bug", total=None)
                    harness_stage.run(cfg.harness, run_dir, metrics)
                    bar.update(task, total=1, completed=1)
                elif name == "evals":
                    task = bar.add_task("evals: build + validate tasks, oracle/noop calibration", total=None)
                    evals_stage.run(cfg.evals, run_dir, metrics, progress=lambda m: bar.update(task, description=f"evals: {m}"[:70]))
                    bar.update(task, total=1, completed=1)
                elif name == "model":
                    task = bar.add_task("model: import SmolLM2, answer a coding prompt", total=None)
                    model_stage.run(cfg.model, run_dir, metrics)
                    bar.update(task, total=1, completed=1)
                elif name == "inference":
                    task = bar.add_task("inference: serve it, sample, check numerics, swap weights", total=None)
                    inference_stage.run(cfg.inference, run_dir, metrics)
                    bar.update(task, total=1, completed=1)
                elif name == "cpt":
                    task = bar.add_task("cpt: code mix, base evals before/after", total=cfg.cpt.steps)
                    train_stage.run_cpt(cfg.cpt, run_dir, metrics, base_model(cfg, run_dir),
                                        progress=lambda step, rec: bar.update(task, completed=step))
                elif name == "sft":
                    task = bar.add_task("sft: the run's agent trajectories", total=cfg.sft.steps)
                    sft_base = run_dir.root / "cpt" / "model"
                    train_stage.run_sft(cfg.sft, run_dir, metrics,
                                        sft_base if sft_base.exists() else base_model(cfg, run_dir),
                                        progress=lambda step, rec: bar.update(task, completed=step))
                elif name == "kernels":
                    task = bar.add_task("kernels: formats vs float64, a MoE per backend",
                                        total=cfg.kernels.steps * len(cfg.kernels.backends))
                    precision.run(cfg.kernels, run_dir, metrics, progress=lambda: bar.advance(task))
            except KeyboardInterrupt:
                events.emit("stage_failed", stage=name, error="interrupted")
                report.write(run_dir)  # what ran so far, with the interrupted stage marked
                raise
            except Exception as e:
                # Marked in the report card; the later stages still run (each falls back to the
                # embedded default where it would have used an earlier stage's output).
                import traceback

                # The traceback goes to the run folder (events.jsonl); the console gets one line.
                events.emit("stage_failed", stage=name, error=f"{type(e).__name__}: {e}",
                            traceback=traceback.format_exc())
                log.error("stage %s failed: %s: %s", name, type(e).__name__, e)
                failed.append(name)
                continue
            events.emit("stage_end", stage=name, seconds=time.monotonic() - t0)
    path = report.write(run_dir)
    log.info("report card: %s", path)
    if failed:
        raise SpeedrunFailed(f"stage(s) {', '.join(failed)} failed (see {run_dir.log}); the report card with them "
                             f"marked is {path}")
    return run_dir
