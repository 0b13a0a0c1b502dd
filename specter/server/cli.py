"""`specter serve`: its command-line options (the engine's are `generate`'s own) and the uvicorn process."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from specter.log import get_logger

log = get_logger(__name__)

DRAIN_GRACE_S = 10.0
"""How long uvicorn waits beyond --drain-timeout before it cancels the connections itself: closing the engine ends
every request within a round, so this is only a backstop."""
ENGINE_GROUPS = ("memory and device", "speculation and policies")  # generate's option groups that build the engine
ENGINE_OPTIONS = ("--sampling", "--progress")  # engine options generate files under other groups


def add_serve_parser(commands: Any) -> None:
    """Add `serve` to the CLI's subcommands. The engine options are taken from `generate`'s parser, so an option
    added there (read by cli.engine_config) is served too without being written twice."""
    from specter.cli import _add_generate, _add_logging

    serve = commands.add_parser("serve", help="serve the OpenAI API (completions, chat, streaming, metrics)")
    serve.add_argument("--model", default="tiny", help="checkpoint directory, or the name of a built-in model (default: tiny)")
    serve.add_argument("--served-model-name", type=_name, default=None, metavar="NAME",
                       help="the model name clients send and /v1/models lists (default: --model)")
    serve.add_argument("--host", type=_host, default="127.0.0.1",
                       help="address to bind (default: loopback only; 0.0.0.0 for every interface, said so)")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind; 0 picks a free one (printed on start)")
    serve.add_argument("--api-key", type=_api_key, default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on /v1/* (not empty: an unset variable must not "
                            "turn the check off)")
    serve.add_argument("--max-queue", type=_non_negative, default=64, metavar="N",
                       help="requests that may wait for the engine; one more gets 429 with Retry-After (default 64)")
    serve.add_argument("--drain-timeout", type=_seconds, default=60.0, metavar="S",
                       help="on SIGTERM, wait this long for admitted requests to finish, then end them: a 503 for an "
                            "answer not begun, an error event for a stream (default 60)")
    serve.add_argument("--max-body-bytes", type=_body_bytes, default=None, metavar="N",
                       help="largest request body, in bytes or with a unit (8MiB); a larger one gets 413 before it is "
                            "read (default 8 MiB)")
    generate = argparse.ArgumentParser(add_help=False)
    _add_generate(generate)
    for group in generate._action_groups:  # argparse has no public way to copy a group
        if group.title in ENGINE_GROUPS:
            copy = serve.add_argument_group(group.title)
            for action in group._group_actions:
                copy._add_action(action)
    extra = serve.add_argument_group("engine (other)")
    for action in generate._actions:
        if any(flag in ENGINE_OPTIONS for flag in action.option_strings):
            extra._add_action(action)
    copied = set(serve._actions)
    for group in generate._mutually_exclusive_groups:  # --budget or --residents, refused together as generate does
        if set(group._group_actions) <= copied:
            serve.add_mutually_exclusive_group()._group_actions.extend(group._group_actions)
    _add_logging(serve)


def _api_key(text: str) -> str:
    if not text.strip():  # `--api-key "$UNSET"` would otherwise serve everyone
        raise argparse.ArgumentTypeError("must not be empty or blank; leave --api-key out to serve without a key")
    return text


def _host(text: str) -> str:
    if not text.strip():  # `--host "$UNSET"` would otherwise bind every interface
        raise argparse.ArgumentTypeError("must not be empty or blank; leave --host out for loopback only, or give "
                                         "0.0.0.0 to serve every interface")
    return text


def _name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty or blank; leave --served-model-name out to serve the "
                                         "model under its --model name")
    return text


def _integer(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def _non_negative(text: str) -> int:
    value = _integer(text, "a whole number 0 or more")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _body_bytes(text: str) -> int:
    """A byte count: a bare whole number is bytes (any from 1), or a size with its unit (8MiB), as --budget takes."""
    from specter.config import parse_bytes

    if text.strip().isdigit():
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be 1 byte or more, got {value}")
        return value
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _port(text: str) -> int:
    value = _integer(text, "a TCP port, a whole number from 0 to 65535")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port from 0 to 65535 (0 picks a free one), got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number 0 or more), got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, got {text}")
    return value


def engine_args(args: argparse.Namespace) -> argparse.Namespace:
    """`args` completed with generate's defaults for what serve does not take, so cli.engine_config reads it as is."""
    from specter.cli import _add_generate

    generate = argparse.ArgumentParser(add_help=False)
    _add_generate(generate)
    return argparse.Namespace(**(vars(generate.parse_args([])) | vars(args)))


def cmd_serve(args: argparse.Namespace) -> int:
    from specter.cli import engine_config
    from specter.kernel import run

    config = engine_config(engine_args(args))  # validated before anything loads
    tokenizer = served_tokenizer(args.model)
    check_address(args.host, args.port)
    return run(serve(args, config, tokenizer))


def served_tokenizer(model: str) -> Any:
    """The checkpoint's tokenizer, read before the weights: every answer of the API is text, so a checkpoint without
    tokenizer.json is refused before a load that would end in a server answering empty strings."""
    from specter.builtin import resolve_model
    from specter.errors import ConfigError
    from specter.tokenizer import Tokenizer

    directory = resolve_model(model)
    tokenizer = Tokenizer.from_dir(directory)
    if tokenizer is None:
        raise ConfigError(f"the checkpoint at {directory} has no tokenizer.json, and every answer of the server is "
                          "text; add the tokenizer the model was trained with (or use `specter generate --prompt-ids`, "
                          "which answers in token ids)")
    return tokenizer


def check_address(host: str, port: int) -> None:
    """Refuse an address that cannot be bound before the model loads (minutes for a large one), not after. Bound
    with SO_REUSEADDR as uvicorn binds, so a port left in TIME_WAIT by a server just stopped is not refused."""
    import socket

    from specter.errors import ConfigError

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)  # "": all
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except (OSError, UnicodeError, ValueError) as error:  # a name too long for IDNA is a UnicodeError
        reason = getattr(error, "strerror", None) or error
        raise ConfigError(f"cannot listen on {host}:{port} ({reason}); check --host, stop what holds the port, or "
                          "choose another --port (0: a free one)") from None


async def serve(args: argparse.Namespace, config: Any, tokenizer: Any) -> int:
    from specter.api import Engine
    from specter.server.app import DEFAULT_MAX_BODY_BYTES, create_app

    uvicorn = _require_server_packages()
    async with Engine.from_pretrained(args.model, config, tokenizer=tokenizer) as engine:
        name = args.served_model_name or args.model
        app = create_app(engine, model_name=name, max_queue=args.max_queue, api_key=args.api_key,
                         max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        # uvicorn's own timeout cancels the connections' tasks, which would end a request with a bare 500 and a
        # traceback: it only backs up the drain, which ends the requests itself by closing the engine.
        settings = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                                  lifespan="off", timeout_graceful_shutdown=args.drain_timeout + DRAIN_GRACE_S,
                                  timeout_keep_alive=5)
        server = _draining_server(settings, name, engine, args.drain_timeout)
        # uvicorn re-raises the signal it drained on once it is done; a handler that does nothing lets the
        # process leave through its normal exit (status 0) after the engine is closed below.
        signal.signal(signal.SIGTERM, lambda *_: None)
        try:
            await server.serve()
        finally:
            app.close()
    return 0


def _require_server_packages() -> Any:
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as error:
        from specter.errors import ConfigError

        raise ConfigError(f"`specter serve` needs {error.name}; install the server extra: pip install 'specter[serve]'") from None
    return uvicorn


def _draining_server(settings: Any, name: str, engine: Any, drain_s: float) -> Any:
    """uvicorn's Server, saying on stderr where it listens once it does (the real port when --port 0), and ending the
    requests still admitted `drain_s` after a shutdown began by closing the engine: each then ends as the routes end
    a request the engine refused (`specter.server.app._serve`, `_events`), a 503 or a stream's error event."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"specter serve: {name} on http://{host}:{port}/v1", file=sys.stderr, flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            expired = asyncio.Event()
            ender = asyncio.ensure_future(_end_after(drain_s, expired))
            try:
                await super().shutdown(sockets)
            finally:
                if expired.is_set():
                    await ender  # a close begun is finished, never cut short (the engine's own close would skip it)
                else:
                    ender.cancel()

    async def _end_after(seconds: float, expired: asyncio.Event) -> None:
        await asyncio.sleep(seconds)
        expired.set()
        log.warning("server.drain_timeout", seconds=seconds, advice="the requests still admitted were ended (503)")
        await engine.aclose()

    return DrainingServer(settings)
