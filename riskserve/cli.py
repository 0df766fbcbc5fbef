"""The ``riskserve`` command line. Arguments are parsed in :func:`main`, never at import time."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from riskserve.platform.errors import RiskServeError

__all__ = ["main"]


def _models_build(args: argparse.Namespace) -> int:
    from riskserve.demo.build import build_demo_models

    only = [name.strip() for name in args.only.split(",")] if args.only else None
    print(f"building demo models into {args.out} (seed {args.seed})")
    models = build_demo_models(args.out, seed=args.seed, only=only, force=args.force)
    failing = [m for m in models if m.value < (0.9 if m.kind == "vllm" else 0.8)]
    for model in failing:
        print(f"error: {model.name} reaches only {model.metric} {model.value:.3f}", file=sys.stderr)
    return 1 if failing else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="riskserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="build and inspect model artifacts")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    build = models_commands.add_parser("build", help="build the demo models (deterministic for a seed)")
    build.add_argument("--out", type=Path, default=Path("models"), help="output directory (default: models)")
    build.add_argument("--seed", type=int, default=0, help="seed of the data set and the training")
    build.add_argument("--only", help="comma-separated subset of: credit, fraud, intent")
    build.add_argument("--force", action="store_true", help="rebuild even if a verified artifact exists")
    build.set_defaults(handler=_models_build)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; a riskserve error is printed as one line and exit code 2, never a traceback."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.handler(args)
    except RiskServeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
