"""The ``kvmesh`` command line: one subcommand per service, plus ``demo`` and ``bench``.

``build_parser()`` is the single definition of every flag; ``tests/app/test_compose.py`` parses
the commands of ``docker-compose.yml`` with it, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import typing
from collections.abc import Callable, Coroutine, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from app.bench import BENCHMARKS, load_benchmark
from app.settings import Settings

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace], int]
S = typing.TypeVar("S", bound=Settings)


def _package_version() -> str:
    try:
        return version("kvmesh")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _add_redis_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis to use (default: $REDIS_URL; demo and bench start a private one if unset)",
    )


def _add_settings_flags(parser: argparse.ArgumentParser, model: type[Settings]) -> None:
    """One flag per field of a service's settings model (``--max-batch-size``, ...).

    Defaults are None, so a flag left out falls back to the ``KVMESH_`` variable, then to the
    model's default (shown in the help); pydantic validates what the flags give."""
    shared = {"redis_url", "admin_token", "log_level"}  # --redis-url, the environment, --log-level
    for name, info in model.model_fields.items():
        if name in shared:
            continue
        flag = "--" + name.replace("_", "-")
        default = "" if info.is_required() else f" (default: {info.default})"
        help_text = f"{info.description or name}{default}"
        annotation = info.annotation
        choices = _literal_choices(annotation)
        if annotation is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif choices:
            parser.add_argument(flag, choices=choices, default=None, help=help_text)
        else:
            kinds = {annotation, *typing.get_args(annotation)} & {int, float}
            kind = int if int in kinds else float if kinds else str
            parser.add_argument(flag, type=kind, default=None, metavar=name.upper(), help=help_text)


def _literal_choices(annotation: Any) -> list[str] | None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return [str(a) for a in args]
    for arg in args:  # Literal[...] | None
        if typing.get_origin(arg) is typing.Literal:
            return [str(a) for a in typing.get_args(arg)]
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmesh",
        description="KV-cache manager and cache-aware router for LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        default=None,
        help="log level (default: $KVMESH_LOG_LEVEL or INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo", help="Redis, workers, a router and its dashboard on this machine, and a workload"
    )
    _add_redis_flag(demo)
    demo.add_argument("--workers", type=int, default=4, help="worker processes (default: 4)")
    demo.add_argument(
        "--duration", type=float, default=None, help="exit this many seconds after start"
    )
    demo.add_argument("--trace", default=None, help="a Mooncake trace (default: the built-in)")
    demo.add_argument("--requests", type=int, default=None, help="replay the first N requests")
    demo.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000)")
    demo.add_argument("--speed", type=float, default=85.0, help="trace seconds per second")
    demo.add_argument("--no-browser", action="store_true", help="do not open the dashboard")
    demo.set_defaults(handler=_cmd_demo)

    worker = sub.add_parser("worker", help="a worker service owning one GPU's KV cache")
    _add_redis_flag(worker)
    from app.worker.settings import WorkerSettings

    _add_settings_flags(worker, WorkerSettings)
    worker.set_defaults(handler=_cmd_worker)

    router = sub.add_parser("router", help="the cache-aware router (workers found in Redis)")
    _add_redis_flag(router)
    from app.router.settings import RouterSettings

    _add_settings_flags(router, RouterSettings)
    router.set_defaults(handler=_cmd_router)

    dashboard = sub.add_parser(
        "dashboard", help="a live web dashboard of the cluster's KV cache (read-only)"
    )
    _add_redis_flag(dashboard)
    from app.dashboard.settings import DashboardSettings

    _add_settings_flags(dashboard, DashboardSettings)
    dashboard.set_defaults(handler=_cmd_dashboard)

    replay = sub.add_parser(
        "replay", help="replay a Mooncake trace through an in-process cluster, per policy"
    )
    from app.replay.cli import add_arguments as add_replay_arguments

    add_replay_arguments(replay)
    replay.set_defaults(handler=_cmd_replay)

    bench = sub.add_parser("bench", help="run a benchmark")
    bench.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("--json", action="store_true", help="print the result as one JSON line")
    bench.add_argument("--quick", action="store_true", help="a small run (for tests)")
    bench.set_defaults(handler=_cmd_bench)

    ingest = sub.add_parser("ingest", help="republish another engine's KV events to the stream")
    ingest_sub = ingest.add_subparsers(dest="source", metavar="SOURCE", required=True)
    trtllm = ingest_sub.add_parser(
        "trtllm", help="poll a TensorRT-LLM server's POST /kv_cache_events"
    )
    trtllm.add_argument("--url", required=True, help="the server, e.g. http://gpu3:8000")
    trtllm.add_argument("--worker-id", required=True, help="worker id to publish the events as")
    trtllm.add_argument(
        "--tokens-per-block", type=int, default=None, help="the engine's block size (registry)"
    )
    trtllm.add_argument(
        "--poll-interval-s", type=float, default=0.05, help="pause after an empty answer"
    )
    trtllm.add_argument(
        "--max-polls", type=int, default=None, help="stop after this many polls (default: never)"
    )
    _add_redis_flag(trtllm)
    trtllm.set_defaults(handler=_cmd_ingest_trtllm)
    for source, what in (("vllm", "vLLM"), ("sglang", "SGLang")):
        zmq_ingest = ingest_sub.add_parser(
            source, help=f"subscribe to a {what} server's ZMQ KV events (--kv-events-config)"
        )
        defaults = _zmq_ingest_defaults(source)
        zmq_ingest.add_argument(
            "--endpoint", default=defaults["endpoint"], help="its PUB socket, e.g. tcp://gpu3:5557"
        )
        zmq_ingest.add_argument(
            "--replay-endpoint", default=None, help="its replay ROUTER socket, e.g. tcp://gpu3:5567"
        )
        zmq_ingest.add_argument("--topic", default=defaults["topic"], help="the topic it publishes")
        zmq_ingest.add_argument("--worker-id", required=True, help="worker id to publish as")
        zmq_ingest.add_argument("--url", default=None, help="the server, e.g. http://gpu3:8000")
        zmq_ingest.add_argument(
            "--block-size", type=int, default=defaults["block_size"], help="its tokens per block"
        )
        zmq_ingest.add_argument(
            "--data-parallel-size",
            type=int,
            default=1,
            help="its data-parallel ranks: rank r publishes on the endpoints' ports + r and "
            "becomes worker <worker-id>-dp<r> (default 1: one worker, <worker-id>)",
        )
        zmq_ingest.add_argument(
            "--window-size",
            type=int,
            default=0,
            help="its attention window in tokens, put on the events (e.g. vLLM's "
            "--max-model-len; default 0: not given; a sliding-window group sends its own)",
        )
        zmq_ingest.add_argument(
            "--max-batches", type=int, default=None, help="stop after this many messages"
        )
        _add_redis_flag(zmq_ingest)
        zmq_ingest.set_defaults(handler=_cmd_ingest_zmq)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings()
    logging.basicConfig(
        level=args.log_level or settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.handler
    return handler(args)


def _cmd_replay(args: argparse.Namespace) -> int:
    from app.replay.cli import main as replay_main

    return replay_main(args)


# -- worker --------------------------------------------------------------------------------


def _cmd_worker(args: argparse.Namespace) -> int:
    from app.worker.service import serve
    from app.worker.settings import WorkerSettings

    return _run_service(args, WorkerSettings, serve)


def _cmd_router(args: argparse.Namespace) -> int:
    from app.router.service import serve
    from app.router.settings import RouterSettings

    return _run_service(args, RouterSettings, serve)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from app.dashboard.settings import DashboardSettings
    from app.router.service import serve

    def serve_dashboard(settings: DashboardSettings) -> None:
        serve(settings.router_settings(), routing=False)

    return _run_service(args, DashboardSettings, serve_dashboard)


def _run_service(args: argparse.Namespace, model: type[S], serve: Callable[[S], None]) -> int:
    """Build the service's settings (a bad one: one line naming it, exit 2), then serve."""
    from pydantic import ValidationError

    try:
        settings = _service_settings(args, model)
    except ValidationError as exc:
        for error in exc.errors():
            print(f"kvmesh {args.command}: {_setting_error(error)}", file=sys.stderr)
        return 2
    if settings.redis_url is None and args.command in ("router", "dashboard"):
        print(
            f"kvmesh {args.command}: --redis-url (REDIS_URL): it reads the workers' streams; "
            "give the Redis they publish to",
            file=sys.stderr,
        )
        return 2
    serve(settings)
    return 0


def _service_settings(args: argparse.Namespace, model: type[S]) -> S:
    """Flags given on the command line, over ``KVMESH_`` variables, over the defaults."""
    given = {
        name: getattr(args, name)
        for name in model.model_fields
        if getattr(args, name, None) is not None
    }
    return model(**given)


def _setting_error(error: Any) -> str:
    """One line naming the setting: its flag, its variable and what is wrong with it."""
    loc = [str(part) for part in error.get("loc", ())]
    message = str(error.get("msg", "invalid"))
    if loc:
        name = loc[0]
    else:  # a check across fields: its message starts with the setting's name
        name, _, rest = message.removeprefix("Value error, ").partition(": ")
        message = rest or message
    message = message.removeprefix("Value error, ")
    return f"--{name.replace('_', '-')} (KVMESH_{name.upper()}): {message}"


# -- bench ---------------------------------------------------------------------------------


def _cmd_bench(args: argparse.Namespace) -> int:
    result = load_benchmark(args.name)(args)
    if args.json:
        # The last line of output is the JSON object, so scripts can `tail -n1`.
        print(json.dumps(result, sort_keys=True))
    else:
        print(_format_table(args.name, result))
    return 0


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        rows: list[tuple[str, Any]] = []
        for key, item in value.items():
            rows.extend(_flatten(f"{prefix}.{key}" if prefix else str(key), item))
        return rows
    return [(prefix, value)]


def _format_table(title: str, result: dict[str, Any]) -> str:
    rows = _flatten("", result)
    width = max((len(key) for key, _ in rows), default=0)
    lines = [f"benchmark: {title}"]
    lines += [f"  {key:<{width}}  {value}" for key, value in rows]
    return "\n".join(lines)


# -- ingest --------------------------------------------------------------------------------


def _run_ingest(
    args: argparse.Namespace, ingest: Callable[[str], Coroutine[Any, Any, dict[str, Any]]]
) -> int:
    """What every ``kvmesh ingest`` does around its source: the Redis URL and the worker id
    checked (exit 2), the ingester run until done or Ctrl-C (130), its stats printed as JSON."""
    from events.keys import validate_worker_id

    redis_url = args.redis_url or Settings().redis_url
    if redis_url is None:
        print("kvmesh ingest: give --redis-url or set REDIS_URL", file=sys.stderr)
        return 2
    try:
        validate_worker_id(args.worker_id)
        if getattr(args, "block_size", 1) <= 0:
            raise ValueError(f"--block-size must be positive, got {args.block_size}")
        if getattr(args, "data_parallel_size", 1) <= 0:
            raise ValueError(
                f"--data-parallel-size must be positive, got {args.data_parallel_size}"
            )
        if getattr(args, "data_parallel_size", 1) > 1:  # the ranks' ids: <worker-id>-dp<rank>
            validate_worker_id(f"{args.worker_id}-dp{args.data_parallel_size - 1}")
        if getattr(args, "window_size", 0) < 0:
            raise ValueError(f"--window-size must be >= 0, got {args.window_size}")
    except ValueError as exc:
        print(f"kvmesh ingest: {exc}", file=sys.stderr)
        return 2
    try:
        stats = asyncio.run(ingest(redis_url))
    except KeyboardInterrupt:
        return 130
    print(json.dumps(stats, sort_keys=True))
    return 0


def _cmd_ingest_trtllm(args: argparse.Namespace) -> int:
    from app.ingest import run_trtllm_ingest

    return _run_ingest(
        args,
        lambda redis_url: run_trtllm_ingest(
            args.url,
            args.worker_id,
            redis_url,
            tokens_per_block=args.tokens_per_block,
            poll_interval_s=args.poll_interval_s,
            max_polls=args.max_polls,
        ),
    )


def _zmq_ingest_defaults(source: str) -> dict[str, Any]:
    # Both publishers default to endpoint tcp://*:5557 and topic "" (vLLM's KVEventsConfig,
    # SGLang's disaggregation/kv_events.py KVEventsConfig); see docs/operations.md. vLLM's blocks
    # default to 16 tokens (--block-size); SGLang's pages to 1 (--page-size: None resolves to 1
    # unless the attention backend needs larger pages -- then give --block-size).
    block_size = 16 if source == "vllm" else 1
    return {"endpoint": "tcp://localhost:5557", "topic": "", "block_size": block_size}


def _cmd_ingest_zmq(args: argparse.Namespace) -> int:
    from app.ingest_vllm import run_vllm_ingest

    return _run_ingest(
        args,
        lambda redis_url: run_vllm_ingest(
            args.endpoint,
            args.worker_id,
            redis_url,
            replay_endpoint=args.replay_endpoint,
            topic=args.topic,
            url=args.url,
            block_size=args.block_size,
            window_size=args.window_size,
            data_parallel_size=args.data_parallel_size,
            source=args.source,
            max_batches=args.max_batches,
        ),
    )


# -- demo ----------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.demo.runner import DEMO_TRACE, DemoError, DemoOptions, run_demo
    from app.replay.trace import TraceError

    if args.workers < 1 or (args.requests is not None and args.requests < 1) or args.speed <= 0:
        print("kvmesh demo: --workers and --requests must be >= 1, --speed > 0", file=sys.stderr)
        return 2
    options = DemoOptions(
        workers=args.workers,
        duration_s=args.duration,
        trace=Path(args.trace) if args.trace else DEMO_TRACE,
        requests=args.requests,
        port=args.port,
        browser=not args.no_browser,
        speed=args.speed,
        redis_url=args.redis_url or Settings().redis_url,
    )
    try:
        run_demo(options)
    except (TraceError, DemoError) as exc:
        print(f"kvmesh demo: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvmesh demo: stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
