"""The ``dualrl`` command line.

    dualrl config [--config FILE] [--backend NAME] [key.path=value ...]
        load a YAML config, apply dotted overrides and --backend, validate it, print it.

The training entry point (GRPO on a chosen backend) arrives with the algorithm issues;
until then ``config`` is the way to check a run's configuration before launching it.
"""

from __future__ import annotations

import argparse
import sys

from core.config import BACKENDS, DEFAULT_CONFIG_PATH, ConfigError, load_config


def _config_command(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides, backend=args.backend)
    except (ConfigError, FileNotFoundError) as err:
        print(f"invalid config {args.config}:\n{err}", file=sys.stderr)
        return 2
    import yaml

    print(yaml.safe_dump(cfg, sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dualrl",
        description="RL post-training of language models with a switchable training backend "
        f"({', '.join(BACKENDS)}).",
    )
    sub = parser.add_subparsers(dest="command")
    cfg = sub.add_parser("config", help="validate a config (YAML + overrides) and print the resolved result")
    cfg.add_argument("--config", default=str(DEFAULT_CONFIG_PATH), help="YAML file (default: %(default)s)")
    cfg.add_argument("--backend", choices=BACKENDS, help="training backend; sets policy.backend")
    cfg.add_argument("overrides", nargs="*", help="dotted overrides, e.g. policy.train_micro_batch_size=2")
    cfg.set_defaults(func=_config_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
