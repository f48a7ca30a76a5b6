"""The ``dualrl`` command line.

    dualrl grpo [--config FILE] [--backend NAME] [--resume] [key.path=value ...]
        GRPO on the chosen backend; with no arguments the embedded default
        (core/configs/grpo_arithmetic.yaml: a built-in tiny model on the arithmetic task).
    dualrl sft  [same options]   SFT (core/configs/sft_arithmetic.yaml: answers of the task)
    dualrl dpo  [same options]   DPO (core/configs/dpo_arithmetic.yaml: right vs wrong answers)
    dualrl config [--config FILE] [--backend NAME] [key.path=value ...]
        load a YAML config, apply dotted overrides and --backend, validate it, print it.
    dualrl parity [--layouts L ...] [--model NAME|PATH] [--json OUT] [--crossload ring|full] [--engine [L ...]]
        numerical parity of the backend layouts vs each other and single-process HF: a
        pass/fail matrix (benchmarks.parity); exit code 1 when a check fails.
    dualrl bench [--size tiny|small|1b] [--layouts L ...] [--model NAME|PATH] [--device cpu|cuda] ...
        every layout on one workload in one run: tokens/s x HF eager, MFU, memory, refit GB/s,
        vLLM tokens/s, the GRPO step's breakdown x TRL (benchmarks.compare; --help lists all).
    dualrl bench --gpu [--size 1b|tiny] [--mbs M ...] [--sections throughput refit loss] ...
        one device (a GPU, else the CPU): every backend next to HF eager, tokens/s, MFU, peak
        memory, refit source seconds, fp32 loss curves vs plain torch (benchmarks.gpu).

Bad input (config, data, resume checkpoint) ends the command with exit code 2 and a
message naming the field, file or checkpoint, before any worker starts; a failure during
training (a reward function that raised, a non-finite loss) with exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from core.config import DEFAULT_CONFIG_PATH, EMBEDDED_CONFIGS, ConfigError, load_config, load_raw_config
from core.policy.config import BACKENDS

#: ``dualrl grpo``'s config when none is given: the embedded default.
GRPO_DEFAULT_CONFIG_PATH = EMBEDDED_CONFIGS["grpo"]


def load_command_config(args: argparse.Namespace) -> Any:
    """The validated config of a parsed ``config`` / ``grpo`` / ``sft`` / ``dpo`` command line:
    everything the command checks before any worker starts -- the run config of the command
    (``dualrl config``: of the command whose section the file holds), then the preflight
    against the model's files and the classes it names, and the packages of the enabled
    trackers (W&B, MLflow) -- every error naming the file or override at fault."""
    from core.algorithms.config import RUN_CONFIGS, run_config_class
    from core.logging import tracker_package_errors
    from core.policy.preflight import preflight_errors

    overrides = list(args.overrides) + (["checkpointing.resume=true"] if getattr(args, "resume", False) else [])
    if args.command == "config":
        schema = run_config_class(load_raw_config(args.config, overrides, backend=args.backend))
    else:
        schema = RUN_CONFIGS[args.command]
    checks = [lambda cfg: preflight_errors(cfg.policy), lambda cfg: tracker_package_errors(cfg.logger)]
    return load_config(args.config, overrides, backend=args.backend, schema=schema, checks=checks)


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
        run(cfg, log=_console_line)
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


def _console_line(text: str) -> None:
    """A line of the run's log, printed above its progress bar: tqdm.write clears the open bars
    and redraws them, where a plain print would continue the bar's line."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)


def _parity_command(args: argparse.Namespace) -> int:
    from benchmarks import parity  # heavy work (Ray, models) only when asked for

    return parity.main(args.forwarded, prog="dualrl parity")


def _bench_command(args: argparse.Namespace) -> int:
    if "--gpu" in args.forwarded:  # the one-device mode: every backend next to HF eager (benchmarks.gpu)
        from benchmarks import gpu

        rest = [a for a in args.forwarded if a != "--gpu"]
        return gpu.main(rest, prog="dualrl bench --gpu")
    from benchmarks import compare  # heavy work (Ray, models) only when asked for

    return compare.main(args.forwarded, prog="dualrl bench")


def _add_config_args(cmd: argparse.ArgumentParser, default_config: Path) -> None:
    cmd.add_argument("--config", default=str(default_config), help="YAML file (default: %(default)s)")
    cmd.add_argument("--backend", choices=BACKENDS, help="training backend; sets policy.backend")
    cmd.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.train_micro_batch_size=2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dualrl",
        description=f"RL post-training of language models with a switchable training backend ({', '.join(BACKENDS)}).",
    )
    sub = parser.add_subparsers(dest="command")
    helps = {
        "grpo": "GRPO training (no arguments: the embedded arithmetic default)",
        "sft": "supervised fine-tuning (no arguments: the built-in arithmetic answers, from random weights)",
        "dpo": "DPO (no arguments: built-in right-vs-wrong answer pairs, from builtin:arithmetic-llama)",
    }
    for algorithm, path in EMBEDDED_CONFIGS.items():
        cmd = sub.add_parser(algorithm, help=helps[algorithm])
        _add_config_args(cmd, path)
        cmd.add_argument(
            "--resume",
            action="store_true",
            help="continue from the latest complete checkpoint in checkpointing.checkpoint_dir",
        )
        cmd.set_defaults(func=_train_command)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    forward = {"bench": _bench_command, "parity": _parity_command}
    if argv[:1] and argv[0] in forward:  # every option is the benchmark's own (argparse cannot forward them)
        return forward[argv[0]](argparse.Namespace(forwarded=argv[1:]))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
