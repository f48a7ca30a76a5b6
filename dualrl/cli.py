"""The ``dualrl`` command line.

    dualrl grpo [--config FILE] [--backend NAME] [--resume] [key.path=value ...]
        GRPO on the chosen backend; with no arguments the embedded default
        (core/configs/grpo_arithmetic.yaml: a built-in tiny model on the arithmetic task);
        with grpo.async_grpo.enabled=true and no --config, its async form
        (core/configs/grpo_arithmetic_async.yaml: the engine on a slot of its own).
    dualrl sft  [same options]   SFT (core/configs/sft_arithmetic.yaml: answers of the task)
    dualrl dpo  [same options]   DPO (core/configs/dpo_arithmetic.yaml: right vs wrong answers)
    dualrl eval [--checkpoint DIR | --model PATH] [--k K ...] [--num-samples N] [--dataset NAME]
                [--split S] [--max-prompts N] [--out DIR] [--config FILE] [--backend NAME] [key.path=value ...]
        pass@k, maj@k, mean@k (and the greedy accuracy) of a run checkpoint or a model on held-out
        prompts, with bootstrap intervals: a table, eval.json and pass_at_k.png (docs/evaluation.md).
        The config is a GRPO run's: the checkpoint's own config.yaml, else the embedded default.
    dualrl config [--config FILE] [--backend NAME] [key.path=value ...]
        load a YAML config, apply dotted overrides and --backend, validate it, print it.
    dualrl parity [--layouts L ...] [--model NAME|PATH] [--json OUT] [--crossload ring|full] [--engine [L ...]]
        numerical parity of the backend layouts vs each other and single-process HF: a
        pass/fail matrix (benchmarks.parity); exit code 1 when a check fails.
    dualrl bench [--size tiny|small|1b] [--layouts L ...] [--model NAME|PATH] [--device cpu|cuda] ...
        every layout on one workload in one run: tokens/s x HF eager, MFU, memory, refit GB/s,
        vLLM tokens/s, the GRPO step's breakdown x TRL (benchmarks.compare; --help lists all).
    dualrl serve [--config FILE] [--backend NAME] [key.path=value ...]
        the Tinker API on 127.0.0.1:8000 for the official tinker SDK (core/configs/serve_arithmetic.yaml;
        docs/tinker.md): training and sampling clients on the chosen backend.
    dualrl bench --gpu [--size 1b|tiny] [--mbs M ...] [--sections throughput refit loss] ...
        one device (a GPU, else the CPU): every backend next to HF eager, tokens/s, MFU, peak
        memory, refit source seconds, fp32 loss curves vs plain torch (benchmarks.gpu).

Bad input (config, data, resume checkpoint) ends the command with exit code 2 and a
message naming the field, file or checkpoint, before any worker starts; a failure during
training (a reward function that raised, a non-finite loss) with exit code 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.config import DEFAULT_CONFIG_PATH, EMBEDDED_CONFIGS, ConfigError, load_config, load_raw_config, parse_override
from core.policy.registry import backend_names
from core.reporting import show_logs_above_progress

if TYPE_CHECKING:
    from core.algorithms.config import MasterConfig

#: ``dualrl grpo``'s config when none is given: the embedded default.
GRPO_DEFAULT_CONFIG_PATH = EMBEDDED_CONFIGS["grpo"]
#: ... and with ``grpo.async_grpo.enabled=true`` among the overrides: the embedded default set
#: up for async (the engine on a slot of its own, the importance-sampling correction on).  The
#: switch alone cannot be enough on the synchronous file: its engine shares the policy's
#: devices, which async refuses (core.algorithms.config: ``_async_problems``).
GRPO_ASYNC_DEFAULT_CONFIG_PATH = GRPO_DEFAULT_CONFIG_PATH.with_name("grpo_arithmetic_async.yaml")
ASYNC_SWITCH = ("grpo", "async_grpo", "enabled")


def default_config_path(command: str, overrides: list[str]) -> Path:
    """The config a command reads when no ``--config`` is given (see GRPO_ASYNC_DEFAULT_CONFIG_PATH)."""
    if command == "config":
        return DEFAULT_CONFIG_PATH
    if command == "grpo" and any(_sets(o, ASYNC_SWITCH, True) for o in overrides):
        return GRPO_ASYNC_DEFAULT_CONFIG_PATH
    return EMBEDDED_CONFIGS[command]


def _sets(override: str, key: tuple[str, ...], value: Any) -> bool:
    try:
        return parse_override(override) == (key, value)
    except ConfigError:
        return False  # reported, naming the override, when the config loads


def load_command_config(args: argparse.Namespace) -> Any:
    """The validated config of a parsed ``config`` / ``grpo`` / ``sft`` / ``dpo`` command line:
    everything the command checks before any worker starts -- the run config of the command
    (``dualrl config``: of the command whose section the file holds), then the preflight
    against the model's files and the classes it names, and the packages of the enabled
    trackers (W&B, MLflow) -- every error naming the file or override at fault."""
    from core.algorithms.config import RUN_CONFIGS
    from core.logging import tracker_package_errors
    from core.policy.preflight import preflight_errors

    overrides = list(args.overrides) + (["checkpointing.resume=true"] if getattr(args, "resume", False) else [])
    if args.command == "config":
        schema = file_config_class(load_raw_config(args.config, overrides, backend=args.backend))
    else:
        schema = RUN_CONFIGS[args.command]
    checks = [lambda cfg: preflight_errors(cfg.policy), lambda cfg: tracker_package_errors(cfg.logger)]
    return load_config(args.config, overrides, backend=args.backend, schema=schema, checks=checks)


def file_config_class(raw: Mapping[str, Any]) -> type[MasterConfig]:
    """The run config of the command a loaded file belongs to (what ``dualrl config`` checks
    it as): ``dualrl serve``'s for a file with a ``serve`` section and no algorithm section,
    else the algorithm's (``run_config_class``)."""
    from core.algorithms.config import RUN_CONFIGS, run_config_class
    from core.tinker_api.config import ServeRunConfig

    if "serve" in raw and not any(name in raw for name in RUN_CONFIGS):
        return ServeRunConfig
    return run_config_class(raw)


def load_eval_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the validated GRPO run config, the checkpoint or None) of a parsed ``dualrl eval`` line:
    ``--config``, else the checkpoint's own ``config.yaml``, else the embedded GRPO default;
    ``--model`` / ``--k`` / ``--num-samples`` become overrides of the fields they set."""
    from core.algorithms.config import GRPORunConfig
    from core.checkpointing import CheckpointError, read_checkpoint
    from core.policy.preflight import preflight_errors

    ckpt = read_checkpoint(args.checkpoint) if args.checkpoint else None
    path = args.config
    if path is None and ckpt is not None:
        if ckpt.identity.get("algorithm") != "grpo":
            raise CheckpointError(
                f"dualrl eval --checkpoint {ckpt.path}: written by dualrl {ckpt.identity.get('algorithm')}, whose "
                "config has no prompts, environment or generation settings; give --config FILE, a GRPO config of "
                "the same model"
            )
        path = ckpt.path / "config.yaml"
    overrides = list(args.overrides)
    if args.model is not None:
        overrides.append(f"policy.model_name={args.model}")
        if not any(o.startswith("policy.tokenizer.name=") for o in overrides):
            overrides.append(f"policy.tokenizer.name={args.model}")
    if args.k is not None:
        overrides.append(f"grpo.val_pass_at_k={list(args.k)}")
    if args.num_samples is not None:
        overrides.append(f"grpo.val_num_samples={args.num_samples}")
    cfg = load_config(
        path or GRPO_DEFAULT_CONFIG_PATH,
        overrides,
        backend=args.backend,
        schema=GRPORunConfig,
        checks=[lambda c: preflight_errors(c.policy)],
    )
    return cfg, ckpt


def _eval_command(args: argparse.Namespace) -> int:
    from core.checkpointing import CheckpointError

    try:
        cfg, ckpt = load_eval_config(args)
    except (ConfigError, CheckpointError, FileNotFoundError) as err:
        print(f"dualrl eval: invalid input:\n{err}", file=sys.stderr)
        return 2
    from core.algorithms.commands import run_eval  # heavy imports only when evaluating
    from core.algorithms.eval_run import EvalRequest
    from core.environments import EnvironmentPoolError, RewardError
    from core.generation.engine_health import EngineDeadError

    request = EvalRequest(ckpt, args.dataset, args.split, args.max_prompts, Path(args.out) if args.out else None)
    try:
        show_logs_above_progress()  # the run's lines (workers up, the report) above its progress bar
        run_eval(cfg, request)
    except (RewardError, EnvironmentPoolError, EngineDeadError) as err:
        print(f"dualrl eval: evaluation failed: {err}", file=sys.stderr)
        return 1
    except _input_errors() as err:
        print(f"dualrl eval: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_eval_parser(sub: Any) -> None:
    cmd = sub.add_parser(
        "eval",
        help="pass@k / maj@k / mean@k of a run checkpoint or a model on held-out prompts (docs/evaluation.md)",
        description="Evaluate a run checkpoint or a model as GRPO validates: the greedy accuracy, and with --k "
        "pass@k, maj@k and mean@k from --num-samples samples per prompt, each with a bootstrap interval. "
        "Overrides (key.path=value) go before --k, whose list would take them.",
    )
    what = cmd.add_mutually_exclusive_group()
    what.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a run checkpoint step_N/, or a run's checkpoint "
        "directory (its latest complete one); its config.yaml is the default --config",
    )
    what.add_argument(
        "--model",
        metavar="PATH",
        help="an HF model directory (e.g. checkpointing.export_hf_dir) "
        "or hub name: sets policy.model_name and policy.tokenizer.name",
    )
    cmd.add_argument(
        "--k",
        type=_positive_int,
        nargs="+",
        help="the k's of pass@k, maj@k, mean@k (grpo.val_pass_at_k); without: the greedy accuracy only",
    )
    cmd.add_argument(
        "--num-samples",
        type=_positive_int,
        help="samples per prompt, >= every k (grpo.val_num_samples; default: the largest k)",
    )
    cmd.add_argument(
        "--dataset",
        help="a built-in task, a .jsonl/.json/.parquet file or a hub dataset, read "
        "with the config's data keys (default: the config's validation prompts)",
    )
    cmd.add_argument("--split", help="the split of a file / hub --dataset (default: data.split)")
    cmd.add_argument("--max-prompts", type=_positive_int, help="evaluate the first N prompts only")
    cmd.add_argument("--out", metavar="DIR", help="where eval.json and pass_at_k.png go (default: runs/eval/<name>)")
    cmd.add_argument("--config", help="a GRPO config (default: the checkpoint's config.yaml, else the embedded one)")
    cmd.add_argument("--backend", choices=backend_names(), help="training backend; sets policy.backend")
    cmd.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.generation.temperature=0.7")
    cmd.set_defaults(func=_eval_command)


def _config_command(args: argparse.Namespace) -> int:
    try:
        cfg = load_command_config(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"invalid config {args.config}:\n{err}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def _input_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "the run was asked for something wrong": reported without a traceback."""
    from core.checkpointing import CheckpointError
    from core.datasets import DatasetLoadError

    return ConfigError, CheckpointError, DatasetLoadError, FileNotFoundError, ValueError


def _run_function(algorithm: str):
    """The training entry point of ``algorithm`` (imported only when training)."""
    from core.algorithms.commands import COMMANDS

    return COMMANDS[algorithm]


def _train_command(args: argparse.Namespace) -> int:
    try:
        cfg = load_command_config(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"invalid config {args.config}:\n{err}", file=sys.stderr)
        return 2
    run = _run_function(args.command)  # heavy imports only when training
    from core.algorithms.async_grpo import RolloutProducerError
    from core.algorithms.loop import NonFiniteLossError
    from core.environments import RewardError
    from core.generation.engine_health import EngineDeadError

    try:
        show_logs_above_progress()  # the run's lines (workers up, warnings, the summary) above its progress bar
        run(cfg)
    except (RewardError, NonFiniteLossError, EngineDeadError, RolloutProducerError) as err:
        print(f"dualrl {args.command}: training failed: {err}", file=sys.stderr)
        print(
            "  (the last completed step is checkpointed when checkpointing is on: --resume continues)", file=sys.stderr
        )
        return 1
    except _input_errors() as err:
        print(f"dualrl {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    return 0


def _parity_command(args: argparse.Namespace) -> int:
    from benchmarks import parity  # heavy work (Ray, models) only when asked for

    return parity.main(args.forwarded, prog="dualrl parity")


def _serve_command(args: argparse.Namespace) -> int:
    from core.tinker_api.serve import main as serve  # FastAPI, the tinker SDK: only when serving

    return serve(args.forwarded, prog="dualrl serve")


def _bench_command(args: argparse.Namespace) -> int:
    if "--gpu" in args.forwarded:  # the one-device mode: every backend next to HF eager (benchmarks.gpu)
        from benchmarks import gpu

        rest = [a for a in args.forwarded if a != "--gpu"]
        return gpu.main(rest, prog="dualrl bench --gpu")
    from benchmarks import compare  # heavy work (Ray, models) only when asked for

    return compare.main(args.forwarded, prog="dualrl bench")


def _add_config_args(cmd: argparse.ArgumentParser, default_config: Path, note: str = "") -> None:
    cmd.add_argument("--config", help=f"YAML file (default: {default_config}{note})")
    cmd.add_argument("--backend", choices=backend_names(), help="training backend; sets policy.backend")
    cmd.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.train_micro_batch_size=2")


def build_parser() -> argparse.ArgumentParser:
    backends = ", ".join(backend_names())
    parser = argparse.ArgumentParser(
        prog="dualrl",
        description=f"RL post-training of language models with a switchable training backend ({backends}).",
    )
    sub = parser.add_subparsers(dest="command")
    helps = {
        "grpo": "GRPO training (no arguments: the embedded arithmetic default)",
        "sft": "supervised fine-tuning (no arguments: the built-in arithmetic answers, from random weights)",
        "dpo": "DPO (no arguments: built-in right-vs-wrong answer pairs, from builtin:arithmetic-llama)",
    }
    async_note = f"; {GRPO_ASYNC_DEFAULT_CONFIG_PATH} with grpo.async_grpo.enabled=true"
    for algorithm, path in EMBEDDED_CONFIGS.items():
        cmd = sub.add_parser(algorithm, help=helps[algorithm])
        _add_config_args(cmd, path, async_note if algorithm == "grpo" else "")
        cmd.add_argument(
            "--resume",
            action="store_true",
            help="continue from the latest complete checkpoint in checkpointing.checkpoint_dir",
        )
        cmd.set_defaults(func=_train_command)
    _add_eval_parser(sub)
    cfg = sub.add_parser("config", help="validate a config (YAML + overrides) and print the resolved result")
    _add_config_args(cfg, DEFAULT_CONFIG_PATH)
    cfg.set_defaults(func=_config_command)
    par = sub.add_parser(
        "parity",
        add_help=False,
        help="backend-layout parity matrix: logprobs, loss, grad norm, "
        "GRPO step, batch invariance, checkpoint cross-load, vLLM refit (benchmarks.parity; "
        "dualrl parity --help)",
    )
    par.set_defaults(func=_parity_command)
    bench = sub.add_parser(
        "bench",
        add_help=False,
        help="every backend layout on one workload, one table "
        "(benchmarks.compare; dualrl bench --help); --gpu: "
        "every backend on one device vs HF eager "
        "(benchmarks.gpu; dualrl bench --gpu --help)",
    )
    bench.set_defaults(func=_bench_command)
    serve = sub.add_parser(
        "serve", add_help=False, help="the Tinker API (the tinker SDK's clients) over HTTP (dualrl serve --help)"
    )
    serve.set_defaults(func=_serve_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    forward = {"bench": _bench_command, "parity": _parity_command, "serve": _serve_command}
    if argv[:1] and argv[0] in forward:  # every option is the benchmark's own (argparse cannot forward them)
        show_logs_above_progress(logging.WARNING)  # the library's warnings; the tables are the benchmark's own
        return forward[argv[0]](argparse.Namespace(forwarded=argv[1:]))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if fill_default_config(args) == GRPO_ASYNC_DEFAULT_CONFIG_PATH:
        print(f"grpo.async_grpo.enabled=true on the embedded default: reading {args.config}")
    return args.func(args)


def fill_default_config(args: argparse.Namespace) -> Path | None:
    """Set ``args.config`` of a training or ``config`` command given no ``--config`` to its
    default (:func:`default_config_path`) and return it; None when ``--config`` was given
    (``dualrl eval`` picks its own: :func:`load_eval_config`)."""
    if args.command not in EMBEDDED_CONFIGS and args.command != "config" or args.config is not None:
        return None
    path = default_config_path(args.command, list(args.overrides))
    args.config = str(path)
    return path


if __name__ == "__main__":
    sys.exit(main())
