"""`tokenmill serve`: the OpenAI-compatible server. Flags follow vLLM's spelling."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from tokenmill.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.openai.reasoning import REASONING_PARSERS
from tokenmill.entrypoints.openai.tool_calls import TOOL_PARSERS
from tokenmill.sampling_params import POOLING_TYPES

API_KEY_ENV = "TOKENMILL_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="Model to serve (same as --model), as in `tokenmill serve smollm2-135m`",
    )
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="Address to bind; 0.0.0.0 for every interface (default: 127.0.0.1)"
    )
    g.add_argument("--port", type=int, default=8000, help="Port to listen on (default: 8000)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) the API answers to; the first is the default (default: --model)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"Require 'Authorization: Bearer <key>' (or 'x-api-key: <key>') on /v1/*, /tokenize, /detokenize and "
        f"/debug/* (default: ${API_KEY_ENV} if set, else no auth)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template in place of the model's: a file's path, or the template itself (vLLM's flag)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="How tool calls are written and read: hermes (<tool_call> tags), llama3_json (Llama 3.x JSON) or "
        "pythonic ([f(a=1)]) (default: read off the chat template, hermes when it has no tool format)",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="Split the reasoning between <think> tags from replies into reasoning_content (and reasoning items, "
        "thinking blocks); constraints apply after it (default: off)",
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="Responses kept in memory for previous_response_id and GET /v1/responses/{id}, least recently used "
        "evicted first; 0 keeps none (default: 1024)",
    )
    g.add_argument(
        "--embedding-pooling",
        default="last",
        choices=list(POOLING_TYPES),
        help="How /v1/embeddings pools the prompt's final hidden states (after the final norm): the last token's, "
        "or their mean; L2-normalised either way (default: last)",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="Do not log the periodic stats line")
    g.add_argument("--log-stats-interval", type=float, default=10.0, help="Seconds between stats lines (default: 10)")
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (default: info)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="On SIGTERM, seconds to let in-flight requests finish before aborting them (default: 30)",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        help="Close a connection whose request headers have not all arrived this many seconds after "
        "it opened or its previous response ended (default: 30)",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="Close a connection whose request body has not all arrived this many seconds after its "
        "headers (default: 60)",
    )
    add_engine_args(parser, defaults=SERVE_DEFAULTS)


SERVE_DEFAULTS = {"step_time_factor": 2.0}
"""Engine defaults of `tokenmill serve` that differ from the library's: a server keeps its running streams'
inter-token latency within ~2x a plain decode step while prompts arrive (docs/architecture.md, "A step-time target")."""


def run(args: argparse.Namespace) -> int:
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.entrypoints.openai.server import ServerSettings, serve

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    if args.model_tag is not None:
        if args.model not in (args.model_tag, _default_model()):
            raise ValueError(f"the positional model {args.model_tag!r} and --model {args.model!r} disagree")
        args.model = args.model_tag
    config = engine_config_from_args(args)
    names = args.served_model_name or [config.model.model]
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    chat_template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    engine = AsyncEngine(config)
    settings = ServerSettings(
        served_model_names=names,
        model_root=config.model.model,
        api_key=api_key,
        chat_template=chat_template,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        log_stats_interval_s=None if args.disable_log_stats else args.log_stats_interval,
        responses_store_size=args.responses_store_size,
        embedding_pooling=args.embedding_pooling,
    )
    logging.getLogger("tokenmill").setLevel(logging.INFO)
    return serve(
        engine,
        settings,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        shutdown_timeout_s=args.shutdown_timeout,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
    )


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself when it is a template (it has a Jinja tag)."""
    path = Path(value)
    if "{" not in value:
        if not path.is_file():
            raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
        return path.read_text()
    return value


def _default_model() -> str:
    from tokenmill.config import DEFAULT_MODEL_ALIAS

    return DEFAULT_MODEL_ALIAS
