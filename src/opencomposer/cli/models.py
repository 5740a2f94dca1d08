"""Model, serving, training, kernels, report and speedrun commands."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from opencomposer.cli.common import _data_dir, _overrides, _train_progress


def cmd_speedrun(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer import speedrun
    from opencomposer.core.config import load_config

    recipe = ns.config or speedrun.preset_file(ns.preset)
    cfg = load_config(speedrun.SpeedrunConfig, recipe,
                      [*_overrides(ns, extra), *(["--fresh=true"] if ns.fresh else [])])
    if ns.config and cfg.preset == "default":  # a recipe of your own is not the default preset
        import dataclasses

        cfg = dataclasses.replace(cfg, preset=Path(ns.config).stem)
    run_dir = speedrun.run(cfg)
    print(run_dir.report.read_text())
    print(f"run folder: {run_dir.root}\nreport card: {run_dir.report.with_suffix('.html')}")
    return 0


def cmd_model_import_default(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.progress import Progress

    from opencomposer.model.interop import import_default
    from opencomposer.tokenizer.gguf import GGUFError

    out = Path(ns.out) if ns.out else _data_dir() / "models" / "smollm2-135m-instruct"
    try:
        from rich.console import Console

        with Progress(console=Console(stderr=True)) as bar:
            task = bar.add_task("dequantising GGUF tensors", total=None)
            import_default(out, progress=lambda i, n: bar.update(task, completed=i, total=n))
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def cmd_serve(ns: argparse.Namespace, extra: list[str]) -> int:
    import dataclasses
    import os

    from opencomposer.core.config import load_config
    from opencomposer.core.shutdown import wait_for_stop
    from opencomposer.inference.server import ServeConfig, exit_after, make_server
    from opencomposer.model.errors import ModelLoadError
    from opencomposer.tokenizer.bpe import TokenizerError

    # -c serve.toml and --a.b=value like every other command; the flags below win over both.
    cfg = load_config(ServeConfig, ns.config, _overrides(ns, extra))
    flags = {"model": Path(ns.model) if ns.model else None, "name": ns.name, "host": ns.host, "port": ns.port,
             "slots": ns.slots, "max_len": ns.max_len, "speculative": ns.speculative or None,
             "admin_token": ns.admin_token or os.environ.get("OPENCOMPOSER_ADMIN_TOKEN"), "weights": ns.weights}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in flags.items() if v is not None})
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    try:
        server = make_server(cfg, _data_dir() / "models" / "smollm2-135m-instruct").start()
    except (ModelLoadError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {server.name} at {server.url} (admin endpoint {'on' if cfg.admin_token else 'off'})",
          file=sys.stderr, flush=True)
    # The process that started this server, when it asked to be followed (rl/services.py sets it):
    # a replica ends when that process dies, even where its PR_SET_PDEATHSIG did not act.
    parent = int(os.environ.get("OPENCOMPOSER_PARENT_PID", "0") or 0)
    if wait_for_stop(parent) == "parent":
        print("the process that started this server is gone; stopping", file=sys.stderr, flush=True)
    exit_after(cfg.shutdown_timeout_s, "the server's shutdown")
    server.stop()
    return 0


def _train_command(module, config_cls, label: str, ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.core.config import load_config

    cfg = load_config(config_cls, ns.config, _overrides(ns, extra))
    bar, update = _train_progress(sum(p.steps for p in cfg.phases), label)
    with bar:
        summary = module.run(cfg, data_dir=_data_dir(), progress=update)
    print(json.dumps(summary, indent=2))
    return 0


def cmd_pretrain(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.train import pretrain

    return _train_command(pretrain, pretrain.PretrainConfig, "pretrain", ns, extra)


def cmd_sft(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.train import sft

    return _train_command(sft, sft.SFTConfig, "sft", ns, extra)


def cmd_rl(ns: argparse.Namespace, extra: list[str]) -> int:
    """Asynchronous RL in the harness (rl/loop.py); `--out` an existing run folder resumes it."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from opencomposer.core.config import load_config
    from opencomposer.rl.loop import RLConfig, run

    cfg = load_config(RLConfig, ns.config, _overrides(ns, extra))
    out = Path(ns.out) if ns.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S-rl")
    columns = (TextColumn("rl"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
               TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("rl", total=cfg.steps, info="rolling out")

        def update(rec: dict) -> None:
            bar.update(task, completed=rec["step"], info=f"v{rec['version']} reward {rec['reward']:.2f} "
                                                          f"pass {rec['pass_rate']:.0%}")

        summary = run(cfg, out, progress=update)
    print(json.dumps({k: v for k, v in summary.items() if k != "steps"}, indent=2, default=str))
    print(f"run folder: {out}", file=sys.stderr)
    return 0


def cmd_study_cpt_vs_rl(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.core.config import load_config
    from opencomposer.train import study

    cfg = load_config(study.StudyConfig, ns.config, _overrides(ns, extra))
    result = study.run(cfg, data_dir=_data_dir())
    print(Path(result["folder"], "study.md").read_text())
    return 0


def cmd_kernels_check(ns: argparse.Namespace, extra: list[str]) -> int:
    from rich.progress import Progress

    from opencomposer import report
    from opencomposer.core.config import load_config
    from opencomposer.core.metrics import EventLog, MetricsWriter
    from opencomposer.core.rundir import RunDir
    from opencomposer.train import precision

    cfg = load_config(precision.KernelsStageConfig, ns.config, _overrides(ns, extra))
    run_dir = RunDir.create(ns.out, "kernels")
    run_dir.write_config(cfg)
    with EventLog(run_dir.events) as events, MetricsWriter(run_dir.metrics) as metrics, Progress() as bar:
        task = bar.add_task("kernels: train the MoE per backend", total=cfg.steps * len(cfg.backends))
        events.emit("stage_start", stage="kernels")
        t0 = time.monotonic()
        precision.run(cfg, run_dir, metrics, progress=lambda: bar.advance(task))
        events.emit("stage_end", stage="kernels", seconds=time.monotonic() - t0)
    print(report.write(run_dir).read_text())
    print(f"run folder: {run_dir.root}")
    return 0


def cmd_eval_base(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer.core.config import load_config
    from opencomposer.train import base_evals
    from opencomposer.train.pretrain import load_base

    cfg = load_config(base_evals.BaseEvalConfig, ns.config, _overrides(ns, extra))
    model, tok, _ = load_base(ns.model, _data_dir())
    result = base_evals.run(model.eval(), tok, cfg)
    text = json.dumps(result, indent=2)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    print(text)
    return 0


def cmd_report(ns: argparse.Namespace, extra: list[str]) -> int:
    from opencomposer import report
    from opencomposer.core.rundir import RunDir

    path = report.write(RunDir.open(ns.run_dir))
    print(path.read_text())
    return 0
