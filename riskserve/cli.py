"""The ``riskserve`` command line. Arguments are parsed in :func:`main`, never at import time.

riskserve models build --out models/        build the demo models (deterministic)
riskserve up PIPELINE.yaml [...]             start a local Ray + Serve with the pipelines (or --address)
riskserve decide --pipeline NAME --json '{...}'
riskserve describe --pipeline NAME
riskserve status
riskserve down
riskserve shadow PIPELINE MODEL CANDIDATE    score a candidate beside a model on live traffic (status,
                                             promote, stop)
riskserve audit show ID                      one decision's audit record (and its label)
riskserve audit export --since 24h --format parquet --out FILE
riskserve export serve-config PIPELINE.yaml  print a `serve deploy`-able config
riskserve demo                               the whole story on real gRPC
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from riskserve.platform.errors import ConfigError, NotFound, RiskServeError

if TYPE_CHECKING:
    from riskserve.client import RiskClient

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


def _up(args: argparse.Namespace) -> int:
    from riskserve.operations.local import deploy_to_cluster, up_local

    if args.address:
        endpoints = deploy_to_cluster(
            args.pipelines, address=args.address, grpc_port=args.grpc_port, host=args.host,
            ray_token_file=args.ray_token_file, reset_served=args.reset,
        )  # fmt: skip
        for name, endpoint in endpoints.items():
            print(f"deployed {name} to {args.address}; gRPC {endpoint} on each node with its ingress")
        return 0
    if args.ray_token_file is not None:
        raise ConfigError("--ray-token-file is for --address: a local riskserve makes its own Ray token")
    state = up_local(args.pipelines, grpc_port=args.grpc_port, host=args.host, reset_served=args.reset)
    for name, endpoint in state.endpoints.items():
        print(f"riskserve is up: {name} on {endpoint} (gRPC, metadata application={name})")
    print(
        f"  metrics: Prometheus scrapes http://127.0.0.1:{state.metrics_port}/metrics (deploy/prometheus.yml)"
    )
    print(f"  Ray GCS {state.gcs_address}; log {state.log}; stop with `riskserve down`")
    return 0


def _target(args: argparse.Namespace) -> str:
    """``--target``, or the local riskserve's endpoint of ``--pipeline`` (each pipeline has its port)."""
    if args.target:
        return str(args.target)
    from riskserve.operations.local import read_state

    state = read_state()
    if state is None:
        raise NotFound(
            "no local riskserve is running: `riskserve up PIPELINE.yaml` or pass --target HOST:PORT"
        )
    return state.endpoint(args.pipeline)


def _client(args: argparse.Namespace) -> RiskClient:
    """A client of ``--pipeline`` with the TLS files and token the command was given.

    The token comes from ``--token-file`` or the ``RISKSERVE_TOKEN`` environment variable, never from the
    command line (other users see a process's arguments).
    """
    import os

    from riskserve.client import RiskClient

    token = os.environ.get("RISKSERVE_TOKEN") or None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as error:
            raise ConfigError(f"--token-file: cannot read {args.token_file}: {error.strerror}") from error
    return RiskClient(
        _target(args), pipeline=args.pipeline, timeout_s=args.timeout, ca_file=args.ca_file,
        cert_file=args.cert_file, key_file=args.key_file, token=token, server_name=args.server_name,
    )  # fmt: skip


def _decide(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from riskserve.client import reason_lines, split_fields

    try:
        fields = json.loads(args.json)
    except json.JSONDecodeError as error:
        raise ConfigError(f"--json is not valid JSON: {error}") from error
    if not isinstance(fields, dict):
        raise ConfigError("--json must be an object of fields")
    structured = {"numeric", "categorical", "text", "request_id"}
    with _client(args) as client:
        if set(fields) <= structured and ("numeric" in fields or "categorical" in fields):
            response = client.decide(**fields)
        else:
            response = client.decide_request(split_fields(fields))
    if args.format == "text":
        from riskserve.proto.riskserve.v1 import risk_pipeline_pb2 as pb

        decision = pb.Decision.Name(response.decision)
        print(f"{response.request_id}: {decision}, risk score {response.risk_score:.3f}")
        for rule in response.reasons:
            print(f"  rule  {rule}")
        for line in reason_lines(response):
            print(f"  why   {line}")
        return 0
    print(json.dumps(MessageToDict(response, preserving_proto_field_name=True), indent=2))
    return 0


def _describe(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    with _client(args) as client:
        described = client.describe()
    print(json.dumps(MessageToDict(described, preserving_proto_field_name=True), indent=2))
    return 0


def _feedback(args: argparse.Namespace) -> int:
    with _client(args) as client:
        source = args.source if args.source is not None else ("" if client.authenticated else "cli")
        ack = client.feedback(
            request_id=args.request_id or "",
            label=args.label,
            feedback_id=args.feedback_id,
            source=source,
            decision_id=args.decision_id or "",
        )
    what = "duplicate (already recorded, applied once)" if ack.duplicate else "recorded (durable)"
    print(f"feedback {args.feedback_id}: {what}, seq {ack.seq}, model version {ack.model_version}")
    return 0


def _learning(args: argparse.Namespace) -> int:
    from riskserve.operations.swap import learning_status

    print(json.dumps(learning_status(args.pipeline), indent=2))
    return 0


def _status(args: argparse.Namespace) -> int:
    from riskserve.operations.status import print_status

    return print_status()


def _down(args: argparse.Namespace) -> int:
    from riskserve.operations.local import down

    state = down()
    print(f"stopped riskserve ({', '.join(state.pipelines)}, pid {state.pid})")
    return 0


def _swap(args: argparse.Namespace) -> int:
    from riskserve.operations.swap import swap_model

    result = swap_model(args.pipeline, args.model, args.artifact)
    where = f"{result.pipeline}/{result.model}"
    print(f"{where}: {result.old_version} -> {result.new_version} (all replicas in {result.seconds:.1f} s)")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from riskserve.operations.swap import rollback_model

    result = rollback_model(args.pipeline, args.model)
    print(f"{result.pipeline}/{result.model}: rolled back {result.old_version} -> {result.new_version}")
    return 0


def _shadow(args: argparse.Namespace) -> int:
    """``shadow PIPELINE MODEL CANDIDATE [--sample S]``, ``shadow status [PIPELINE]``,
    ``shadow promote PIPELINE MODEL``, ``shadow stop PIPELINE MODEL``."""
    from riskserve.operations import shadowing

    words = list(args.words)
    if words[0] == "status" and len(words) <= 2:
        statuses = shadowing.shadow_status(words[1] if len(words) == 2 else None)
        for pipeline, figures in statuses.items():
            if not figures:
                print(f"{pipeline}: no shadow")
            for shadow in figures:
                print(f"{pipeline}/{shadow.model}: " + json.dumps(shadow.model_dump(), indent=2))
        return 0
    if words[0] in ("promote", "stop") and len(words) == 3:
        if words[0] == "stop":
            shadowing.stop_shadow(words[1], words[2])
            print(f"{words[1]}/{words[2]}: shadow stopped")
            return 0
        result = shadowing.promote_shadow(words[1], words[2])
        print(f"{result.pipeline}/{result.model}: promoted {result.old_version} -> {result.new_version} "
              f"(all replicas in {result.seconds:.1f} s); shadow stopped")  # fmt: skip
        return 0
    if len(words) == 3:
        report = shadowing.start_shadow(words[0], words[1], Path(words[2]), sample=args.sample)
        where = f"{words[0]}/{words[1]}"
        print(f"{where}: candidate {report.version} verified ({report.golden_rows} golden rows), scoring "
              f"{args.sample:.0%} of live decisions; `riskserve shadow status` compares")  # fmt: skip
        return 0
    raise ConfigError(
        "usage: riskserve shadow PIPELINE MODEL CANDIDATE [--sample S] | shadow status [PIPELINE] | "
        "shadow promote PIPELINE MODEL | shadow stop PIPELINE MODEL"
    )


def _audit(args: argparse.Namespace) -> int:
    """``audit show ID`` and ``audit export --since T [--until T] --format F --out FILE``."""
    import time

    from riskserve.operations import audit_cli

    trail = audit_cli.find_trail(args.pipeline, args.dsn)
    try:
        if args.audit_command == "show":
            print(audit_cli.dumps(audit_cli.show_audit(trail, args.decision_id)))
            return 0
        since = audit_cli.parse_time(args.since, field="--since")
        until = audit_cli.parse_time(args.until, field="--until") if args.until else time.time() + 1
        count = audit_cli.export_audit(trail, since, until, args.format, args.out)
    finally:
        trail.db.close()
    print(f"{count} decisions written to {args.out} ({args.format})")
    return 0


def _export(args: argparse.Namespace) -> int:
    import yaml

    from riskserve.operations.serve_config import serve_config

    config = serve_config(args.pipelines, grpc_port=args.grpc_port)
    print(yaml.safe_dump(config, sort_keys=False), end="")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from riskserve.demo.run import run_demo

    return run_demo(models=args.models, pipeline=args.pipeline, grpc_port=args.grpc_port)


def _client_options(command: argparse.ArgumentParser) -> None:
    """TLS and token options of the commands that call the gRPC endpoint."""
    command.add_argument("--ca-file", type=Path, help="PEM CA that signed the server's certificate: use TLS")
    command.add_argument("--cert-file", type=Path, help="PEM client certificate (mutual TLS)")
    command.add_argument("--key-file", type=Path, help="PEM key of --cert-file")
    command.add_argument(
        "--token-file", type=Path, help="file holding the bearer token (default: $RISKSERVE_TOKEN, if set)"
    )
    command.add_argument("--server-name", help="name the server's certificate is checked against")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="riskserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="build and inspect model artifacts")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    build = models_commands.add_parser("build", help="build the demo models (deterministic for a seed)")
    build.add_argument("--out", type=Path, default=Path("models"), help="output directory (default: models)")
    build.add_argument("--seed", type=int, default=0, help="seed of the data set and the training")
    build.add_argument("--only", help="comma-separated subset of: credit, fraud, intent")
    build.add_argument("--force", action="store_true", help="rebuild even if a verified artifact exists")
    build.set_defaults(handler=_models_build)

    up = commands.add_parser("up", help="serve pipelines: a local Ray by default, or an existing cluster")
    up.add_argument("pipelines", nargs="+", type=Path, help="pipeline YAML files")
    up.add_argument(
        "--grpc-port", type=int, default=None,
        help="gRPC port of the first pipeline, the next pipelines on the next ports (default: the YAMLs')",
    )  # fmt: skip
    up.add_argument(
        "--host", default=None,
        help="address the gRPC endpoints bind (default: the YAMLs', 127.0.0.1; 0.0.0.0: every interface)",
    )  # fmt: skip
    up.add_argument("--address", help="Ray cluster address (ray://... or HOST:PORT) instead of a local Ray")
    up.add_argument(
        "--reset", action="store_true",
        help="serve the YAMLs' artifacts, forgetting the swapped, rolled back or learned versions recorded",
    )  # fmt: skip
    up.add_argument(
        "--ray-token-file", type=Path, default=None,
        help="with --address: the cluster's Ray token (default: RAY_AUTH_TOKEN[_PATH] or ~/.ray/auth_token)",
    )  # fmt: skip
    up.set_defaults(handler=_up)

    for name, handler, helptext in (
        ("decide", _decide, "one decision over gRPC"),
        ("describe", _describe, "a pipeline's features and models"),
    ):
        command = commands.add_parser(name, help=helptext)
        command.add_argument("--pipeline", required=True, help="pipeline name (the gRPC application)")
        command.add_argument("--target", help="HOST:PORT of the gRPC endpoint (default: the local riskserve)")
        command.add_argument("--timeout", type=float, default=10.0, help="seconds")
        _client_options(command)
        if name == "decide":
            command.add_argument(
                "--json", required=True, help='fields, e.g. \'{"amount": 12.5, "channel": "pos"}\''
            )
            command.add_argument(
                "--format", choices=("json", "text"), default="json",
                help="json: the whole response; text: the decision, the rules and the reason codes",
            )  # fmt: skip
        command.set_defaults(handler=handler)

    feedback = commands.add_parser("feedback", help="report the true outcome of a past decision (gRPC)")
    feedback.add_argument("--pipeline", required=True)
    which = feedback.add_mutually_exclusive_group(required=True)
    which.add_argument("--decision-id", help="the decision_id its Decide answer gave")
    which.add_argument(
        "--request-id", help="the decision's request_id (refused if several decisions carry it)"
    )
    feedback.add_argument("--label", required=True, type=int, help="1: it was fraud, 0: it was not")
    feedback.add_argument("--feedback-id", required=True, help="idempotency key: a retry is applied once")
    feedback.add_argument(
        "--source",
        default=None,
        help="who reports it, rate limited per source (default: cli; with a token: the token's identity)",
    )
    feedback.add_argument("--target", help="HOST:PORT of the gRPC endpoint (default: the local riskserve)")
    feedback.add_argument("--timeout", type=float, default=10.0, help="seconds")
    _client_options(feedback)
    feedback.set_defaults(handler=_feedback)
    learning = commands.add_parser("learning", help="online learning of a pipeline: cursor, batches, errors")
    learning.add_argument("pipeline")
    learning.set_defaults(handler=_learning)

    commands.add_parser("status", help="pipelines, models, versions, replicas, health").set_defaults(
        handler=_status
    )
    commands.add_parser("down", help="stop the local riskserve").set_defaults(handler=_down)

    swap = commands.add_parser("swap", help="verify an artifact and hot-swap one model to it")
    swap.add_argument("pipeline")
    swap.add_argument("model")
    swap.add_argument("artifact", type=Path)
    swap.set_defaults(handler=_swap)
    rollback = commands.add_parser("rollback", help="return a model to the artifact before its last swap")
    rollback.add_argument("pipeline")
    rollback.add_argument("model")
    rollback.set_defaults(handler=_rollback)

    shadow = commands.add_parser(
        "shadow",
        help="score a candidate beside a model on live traffic: PIPELINE MODEL CANDIDATE [--sample S] | "
        "status [PIPELINE] | promote PIPELINE MODEL | stop PIPELINE MODEL",
    )
    shadow.add_argument("words", nargs="+", metavar="ARG")
    shadow.add_argument("--sample", type=float, default=0.2, help="share of live decisions (default 0.2)")
    shadow.set_defaults(handler=_shadow)

    audit = commands.add_parser("audit", help="the decision audit trail: show one decision, export a period")
    audit_commands = audit.add_subparsers(dest="audit_command", required=True)
    show = audit_commands.add_parser("show", help="print one decision's record (and its label, if any)")
    show.add_argument("decision_id", metavar="ID", help="the decision_id the Decide answer gave")
    dump = audit_commands.add_parser("export", help="write the decisions of a period as Parquet or CSV")
    dump.add_argument("--since", required=True, help="ISO 8601 (UTC unless zoned) or ago: 30m, 24h, 7d")
    dump.add_argument("--until", help="ISO 8601 or a time ago (default: now)")
    dump.add_argument("--format", choices=["parquet", "csv"], default="parquet")
    dump.add_argument("--out", type=Path, required=True, help="the file to write (mode 0600)")
    for sub in (show, dump):
        sub.add_argument(
            "--pipeline", help="its YAML file, or the name of a running pipeline (default: the only one)"
        )
        sub.add_argument("--dsn", help="read this state database instead (sqlite:///PATH, postgresql://...)")
        sub.set_defaults(handler=_audit)

    export = commands.add_parser("export", help="generate deployment files")
    export_commands = export.add_subparsers(dest="export_command", required=True)
    config = export_commands.add_parser("serve-config", help="a `serve deploy`-able Ray Serve config")
    config.add_argument("pipelines", nargs="+", type=Path)
    config.add_argument("--grpc-port", type=int, default=None)
    config.set_defaults(handler=_export)

    demo = commands.add_parser("demo", help="up the card-fraud pipeline, real gRPC decisions, then down")
    demo.add_argument("--models", type=Path, default=Path("models"))
    demo.add_argument("--pipeline", type=Path, default=Path("deploy/pipelines/card_fraud.yaml"))
    demo.add_argument("--grpc-port", type=int, default=9000)
    demo.set_defaults(handler=_demo)
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
