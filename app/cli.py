"""The ``kvmesh`` command line: one subcommand per service, plus ``demo`` and ``bench``.

``build_parser()`` is the single definition of every flag; ``tests/app/test_compose.py`` parses
the commands of ``docker-compose.yml`` with it, so the two cannot drift apart. ``main`` parses
with ``parse_args``, which reports an unknown flag on the subcommand it was given to. A bad
setting, flag or variable, ends a command at start with one line naming it, exit status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import socket
import sys
import typing
from collections.abc import Callable, Coroutine, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pydantic import ValidationError

from app.bench import BENCHMARK_HELP, BENCHMARKS, load_benchmark
from app.core.settings import Settings

__all__ = ["build_parser", "main", "parse_args"]

Handler = Callable[[argparse.Namespace], int]
S = typing.TypeVar("S", bound=Settings)


def _package_version() -> str:
    try:
        return version("kvmesh")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _add_redis_flag(parser: argparse.ArgumentParser, unset: str) -> None:
    parser.add_argument(
        "--redis-url",
        default=None,
        help="Redis to use: redis://, rediss://, unix://, redis+cluster:// or rediss+cluster:// "
        f"(default: $REDIS_URL or $KVMESH_REDIS_URL; if neither is set, {unset})",
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
        help_text = info.description or name
        # A field whose default is None says in its description what unset means ("the
        # preset's"); one whose description already names its default gets no second one.
        if info.is_required():  # not to argparse: the variable may give it
            help_text += f" (required: this flag or KVMESH_{name.upper()})"
        elif info.default is not None and "default" not in help_text:
            help_text += f" (default: {info.default})"
        annotation = info.annotation
        choices = _literal_choices(annotation)
        extra = info.json_schema_extra
        if typing.get_origin(annotation) is list:  # repeatable, named in the singular
            parser.add_argument(
                flag.removesuffix("s"),
                dest=name,
                action="append",
                default=None,
                metavar=str(extra.get("metavar", "VALUE")) if isinstance(extra, dict) else None,
                help=help_text,
            )
        elif annotation is bool:
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


def _subcommand_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The parser of the (sub)subcommand that ``args`` chose: ``kvmesh ingest vllm``'s, ...
    (argparse keeps no public record of it: found through its private ``_actions``)."""
    while True:
        subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subparsers[0].dest, None) if subparsers else None
        if chosen is None:
            return parser
        parser = subparsers[0].choices[chosen]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``build_parser().parse_args(argv)``, but an argument no parser took is reported by the
    subcommand's parser (``kvmesh worker: error: unrecognized arguments: --bogus``, with its
    usage): argparse reports it on the top parser, as if ``kvmesh`` itself had no such flag."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subcommand_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


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
    _add_redis_flag(demo, "a private redis-server for the run")
    demo.add_argument("--workers", type=int, default=4, help="worker processes (default: 4)")
    demo.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="end about this many seconds after start: each policy replays only the requests "
        "that fit (at least one; starting the processes alone takes 10 to 20 s), then the "
        "cluster serves until the time is up (default: the whole workload, then serve until "
        "Ctrl-C)",
    )
    demo.add_argument("--trace", default=None, help="a Mooncake trace (default: the built-in)")
    demo.add_argument(
        "--requests", type=int, default=None, help="replay the first N requests (default: all)"
    )
    demo.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000)")
    demo.add_argument(
        "--speed", type=float, default=85.0, help="trace seconds per second (default: 85)"
    )
    demo.add_argument(
        "--no-browser", action="store_true", help="do not open the dashboard (default: open it)"
    )
    demo.set_defaults(handler=_cmd_demo)

    worker = sub.add_parser("worker", help="a worker service owning one GPU's KV cache")
    _add_redis_flag(worker, "a private redis-server (for a worker on its own)")
    from app.worker.settings import WorkerSettings

    _add_settings_flags(worker, WorkerSettings)
    worker.set_defaults(handler=_cmd_worker)

    router = sub.add_parser("router", help="the cache-aware router (workers found in Redis)")
    _add_redis_flag(router, "none: the router refuses to start")
    from app.router.settings import RouterSettings

    _add_settings_flags(router, RouterSettings)
    router.set_defaults(handler=_cmd_router)

    dashboard = sub.add_parser(
        "dashboard", help="a live web dashboard of the cluster's KV cache (read-only)"
    )
    _add_redis_flag(dashboard, "none: the dashboard refuses to start")
    from app.dashboard.settings import DashboardSettings

    _add_settings_flags(dashboard, DashboardSettings)
    dashboard.set_defaults(handler=_cmd_dashboard)

    replay = sub.add_parser(
        "replay", help="replay a Mooncake trace through an in-process cluster, per policy"
    )
    from app.replay.cli import add_arguments as add_replay_arguments

    add_replay_arguments(replay)
    replay.set_defaults(handler=_cmd_replay)

    bench = sub.add_parser(
        "bench",
        help="run a benchmark",
        description="Run a benchmark; kvmesh bench NAME --help says what it measures and what "
        "--quick runs instead.",
    )
    _add_bench_flags(bench, default=False, quick="a small run, as the tests do")
    bench_sub = bench.add_subparsers(dest="name", metavar="NAME", required=True)
    for name in sorted(BENCHMARKS):
        about, quick = BENCHMARK_HELP.get(name, (f"the benchmark {name}", "a small run"))
        one = bench_sub.add_parser(name, help=about, description=f"kvmesh bench {name}: {about}.")
        # SUPPRESS: a flag given before NAME (``bench --json NAME``, as before NAME had a parser
        # of its own) is not overwritten by this parser's default.
        _add_bench_flags(one, default=argparse.SUPPRESS, quick=f"a small run: {quick}")
        if name == "router":
            one.add_argument(
                "--rate",
                type=_positive_rate,
                default=None,
                metavar="R",
                help="offered rate of POST /route, requests/s, open loop (default: 1000; "
                "with --quick 200)",
            )
    bench.set_defaults(handler=_cmd_bench)

    wait = sub.add_parser(
        "wait-ready",
        help="wait until a kvmesh service answers GET /ready with 200, and print its answer",
        description="Poll URL/ready until it answers 200 (exit 0, its body printed) or the "
        "timeout passes (exit 1, with the last reasons it gave); for scripts that start a "
        "router or worker in the background.",
    )
    wait.add_argument("url", help="the service, e.g. localhost:8000 or http://gpu3:8001")
    wait.add_argument(
        "--timeout", type=float, default=60.0, help="give up after this many seconds (default: 60)"
    )
    wait.set_defaults(handler=_cmd_wait_ready)

    ingest = sub.add_parser("ingest", help="republish another engine's KV events to the stream")
    ingest_sub = ingest.add_subparsers(dest="source", metavar="SOURCE", required=True)
    from app.ingest.settings import SOURCES, add_flags

    for source, model in SOURCES.items():  # trtllm, vllm, sglang
        one_source = ingest_sub.add_parser(source, help=model.summary)
        add_flags(one_source, model)
        _add_redis_flag(one_source, "none: the ingest refuses to start")
        one_source.set_defaults(handler=_cmd_ingest)

    from app.ingest.settings import RegisterSettings

    register = sub.add_parser("register", help=RegisterSettings.summary)
    add_flags(register, RegisterSettings)
    _add_redis_flag(register, "none: it refuses to start")
    register.set_defaults(handler=_cmd_register)

    return parser


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_bench_flags(parser: argparse.ArgumentParser, *, default: Any, quick: str) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        default=default,
        help="print the result as one JSON line, last (default: a table)",
    )
    parser.add_argument(
        "--quick", action="store_true", default=default, help=f"{quick} (default: the full run)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # a bad Redis URL (flag or variable) or log level ends any command here, in one line
        settings = _shared_settings(args)
    except ValidationError as exc:
        _print_setting_errors(args, exc)
        return 2
    logging.basicConfig(
        level=args.log_level or settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.handler
    return handler(args)


def _cmd_wait_ready(args: argparse.Namespace) -> int:
    import time

    import httpx

    base = args.url if "://" in args.url else f"http://{args.url}"
    url = base.rstrip("/") + "/ready"
    deadline = time.monotonic() + args.timeout
    last = "no answer"
    while True:
        try:
            answer = httpx.get(url, timeout=2.0)
        except httpx.HTTPError as exc:
            last = f"no answer ({type(exc).__name__})"
        else:
            if answer.status_code == 200:
                print(answer.text)
                return 0
            last = f"HTTP {answer.status_code}: {answer.text[:300]}"
        if time.monotonic() >= deadline:
            print(
                f"kvmesh wait-ready: {url} not ready after {args.timeout:g} s: {last}",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.2)


def _cmd_replay(args: argparse.Namespace) -> int:
    from app.replay.cli import main as replay_main

    return replay_main(args)


# -- worker --------------------------------------------------------------------------------


def _cmd_worker(args: argparse.Namespace) -> int:
    from app.worker.app import serve
    from app.worker.settings import WorkerSettings

    return _run_service(args, WorkerSettings, serve)


def _cmd_router(args: argparse.Namespace) -> int:
    from app.router.settings import RouterSettings

    def serve_router(settings: RouterSettings) -> None:
        if settings.processes > 1:
            from app.core.replicas import serve_replicas

            replica = functools.partial(_router_replica, settings)
            code = serve_replicas(settings.processes, settings.host, settings.port, replica)
            if code:
                raise SystemExit(code)
            return
        from app.core.serving import serve
        from app.services import router_app

        serve(router_app(settings), settings.host, settings.port, settings.log_level)

    return _run_service(args, RouterSettings, serve_router)


def _router_replica(settings: Any, sock: socket.socket, index: int) -> None:
    """One of ``kvmesh router --processes N``'s processes (spawned: ``app.core.replicas``)."""
    from app.core.replicas import die_with_parent
    from app.core.serving import serve
    from app.services import router_app

    die_with_parent()
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if settings.router_id is not None:
        settings = settings.model_copy(update={"router_id": f"{settings.router_id}-{index}"})
    serve(router_app(settings), settings.host, settings.port, settings.log_level, sock)


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from app.dashboard.settings import DashboardSettings

    def serve_dashboard(settings: DashboardSettings) -> None:
        from app.core.serving import serve
        from app.services import dashboard_app

        serve(dashboard_app(settings), settings.host, settings.port, settings.log_level)

    return _run_service(args, DashboardSettings, serve_dashboard)


def _run_service(args: argparse.Namespace, model: type[S], serve: Callable[[S], None]) -> int:
    """Build the service's settings (a bad one: one line naming it, exit 2), then serve."""
    try:
        settings = _service_settings(args, model)
    except ValidationError as exc:
        _print_setting_errors(args, exc)
        return 2
    if settings.redis_url is None and args.command in ("router", "dashboard"):
        print(
            f"kvmesh {args.command}: --redis-url ({_variables('redis_url')}): it reads the "
            "workers' streams; give the Redis they publish to",
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


def _shared_settings(args: argparse.Namespace) -> Settings:
    """The settings every command shares, with its ``--redis-url`` (if it has one) over
    ``REDIS_URL``; a bad URL fails here, before any command starts."""
    if args.command in ("replay", "wait-ready"):  # no Redis: a bad REDIS_URL is not theirs
        return Settings(redis_url=None)
    redis_url = getattr(args, "redis_url", None)
    return Settings(redis_url=redis_url) if redis_url is not None else Settings()


def _print_setting_errors(args: argparse.Namespace, exc: ValidationError) -> None:
    for error in exc.errors():
        print(f"kvmesh {args.command}: {_setting_error(error)}", file=sys.stderr)


# pydantic names an error of a field read from several variables after the alias it tried
# (Settings.redis_url: REDIS_URL or KVMESH_REDIS_URL); the flag is named after the field.
_ALIASES = {"REDIS_URL": "redis_url", "KVMESH_REDIS_URL": "redis_url"}


def _variables(name: str) -> str:
    """The environment variables a setting is read from, as the help and errors name them."""
    return "KVMESH_REDIS_URL / REDIS_URL" if name == "redis_url" else f"KVMESH_{name.upper()}"


def _setting_error(error: Any) -> str:
    """One line naming the setting: its flag, its variable and what is wrong with it."""
    loc = [str(part) for part in error.get("loc", ())]
    message = str(error.get("msg", "invalid"))
    if loc:
        name = _ALIASES.get(loc[0], loc[0])
    else:  # a check across fields: its message starts with the setting's name
        name, _, rest = message.removeprefix("Value error, ").partition(": ")
        message = rest or message
    message = message.removeprefix("Value error, ")
    return f"--{name.replace('_', '-')} ({_variables(name)}): {message}"


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


def _cmd_ingest(args: argparse.Namespace) -> int:
    """``kvmesh ingest SOURCE``: its settings checked (a bad one: one line naming it, exit 2),
    the ingester run until done or Ctrl-C (130), its stats printed as JSON."""
    from app.ingest.errors import IngestSettingsError
    from app.ingest.settings import TrtllmIngestSettings, from_args

    try:
        settings = from_args(args)
    except IngestSettingsError as exc:
        print(f"kvmesh ingest: {exc}", file=sys.stderr)
        return 2
    run: Coroutine[Any, Any, dict[str, Any]]
    if isinstance(settings, TrtllmIngestSettings):
        from app.ingest.trtllm import run_trtllm_ingest

        run = run_trtllm_ingest(settings)
    else:
        from app.ingest.vllm import run_vllm_ingest

        run = run_vllm_ingest(settings)
    try:
        stats = asyncio.run(run)
    except KeyboardInterrupt:
        return 130
    print(json.dumps(stats, sort_keys=True))
    return 0


def _cmd_register(args: argparse.Namespace) -> int:
    """``kvmesh register``: its settings checked (exit 2 naming a bad one), then the server kept
    registered until Ctrl-C or SIGTERM (it unregisters on the way out)."""
    import signal

    from app.ingest.errors import IngestSettingsError
    from app.ingest.register import run_register
    from app.ingest.settings import NO_REDIS, RegisterSettings, option_values

    redis_url = args.redis_url or Settings().redis_url
    try:
        if redis_url is None:
            raise IngestSettingsError(NO_REDIS)
        settings = RegisterSettings(redis_url=redis_url, **option_values(args, RegisterSettings))
    except IngestSettingsError as exc:
        print(f"kvmesh register: {exc}", file=sys.stderr)
        return 2

    async def main() -> dict[str, Any]:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        return await run_register(settings, stop)

    try:
        entry = asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    print(json.dumps(entry, sort_keys=True))
    return 0


# -- demo ----------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from app.demo.runner import DEMO_TRACE, DemoError, DemoFailed, DemoOptions, run_demo
    from app.replay.trace import TraceError

    if (
        args.workers < 1
        or (args.requests is not None and args.requests < 1)
        or args.speed <= 0
        or (args.duration is not None and args.duration < 0)
    ):
        print(
            "kvmesh demo: --workers and --requests must be >= 1, --speed > 0, --duration >= 0",
            file=sys.stderr,
        )
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
    except DemoFailed as exc:
        print(f"kvmesh demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmesh demo: stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
