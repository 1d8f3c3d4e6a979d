"""atom-core: serve a model over an OpenAI-compatible HTTP API, generate text, chat, benchmark.

    atom-core serve [PATH] --host 127.0.0.1 --port 8000     # needs: pip install "atom_core[serve]"
    atom-core generate [PATH] --prompt "Return the number of"
    atom-core chat [PATH]                                    # an interactive chat in the terminal
    atom-core bench --offline [PATH]                         # the engine's throughput
    atom-core bench --url http://127.0.0.1:8000 --rate 4 8 inf   # online, against any OpenAI-compatible server

PATH is a local checkpoint folder (default: the built-in demo model). Only ``serve`` needs the
``serve`` extra; the rest runs on the base install.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
from pathlib import Path

from atom_core import __version__
from atom_core.serve.engine_options import (DEFAULT_PROMPTS, Parser, UsageError, add_engine_arguments,
                                            build_engine, chat_template_for, checkpoint_path, clean_text,
                                            finite_float, generate_and_print, positive_int)

PROG = "atom-core"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    commands.required = True

    serve = commands.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_engine_arguments(serve)
    serve.add_argument("--seed", type=seed_value, default=None,
                       help="the engine seed: requests without their own seed draw the same in every run given the "
                            "same requests in the same order (default: fresh randomness)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=port_number, default=8000, help="(default 8000)")
    serve.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model names a request may give; responses give the first (default: the folder's "
                            "name, or 'atom_core-demo'). Put PATH before it: the names take what follows")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on /v1 (default: $ATOM_CORE_API_KEY, else none)")
    serve.add_argument("--max-waiting-requests", type=positive_int, default=1024,
                       help="requests that may wait for their first token; more get 503 (default 1024)")
    serve.add_argument("--max-request-bytes", type=positive_int, default=8 * 2**20,
                       help="largest request body; larger get 413 (default 8 MiB)")
    serve.add_argument("--max-output-tokens", type=positive_int, default=None,
                       help="the most max_tokens a request may ask (default: max_model_len)")
    serve.add_argument("--chat-template", default=None, help="a chat template file (or the template text) to use "
                                                             "instead of the model's")
    serve.add_argument("--enable-rl-endpoints", action="store_true",
                       help="the routes RL loops drive (vLLM's /sleep, /wake_up, /is_sleeping, /reset_prefix_cache; "
                            "SGLang's /update_weights_from_disk and weight-update group routes), behind the API key: "
                            "docs/serving.md")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a chat request bring its own chat_template (vLLM's flag; refused without it: the "
                            "template runs on the server)")
    for flag, what in (("--allowed-origins", "origins"), ("--allowed-methods", "methods"),
                       ("--allowed-headers", "headers")):
        serve.add_argument(flag, type=json_string_list, default=("*",), metavar="JSON",
                           help=f"CORS: the {what} browsers may use, a JSON list (vLLM's flag; default [\"*\"])")
    serve.add_argument("--allow-credentials", action="store_true",
                       help="CORS: let browsers send credentials (vLLM's flag; not with origin \"*\")")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--enable-log-requests", dest="log_requests", action="store_true", default=True,
                       help="a log line per HTTP request (uvicorn's access log, at --log-level info; the default). "
                            "Request contents are never logged")
    serve.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                       help="no log line per request (vLLM's flag)")
    for flag, metavar in (("--enable-auto-tool-choice", None), ("--tool-call-parser", "NAME")):
        serve.add_argument(flag, action=RefusedFlag, nargs=0 if metavar is None else None, metavar=metavar,
                           why=TOOL_CALLS_REFUSED, help="refused: tool-call parsing is not implemented")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                       help="run the engine in a process of its own (a one-replica --data-parallel-size front), as "
                            "vLLM does: HTTP, streaming and detokenization then share no GIL with the engine's steps "
                            "(default: on when the engine runs on a GPU, off on the CPU; docs/serving.md)")

    generate = commands.add_parser("generate", help="generate text for some prompts and report tokens/s")
    add_engine_arguments(generate)
    _add_sampling_arguments(generate, max_tokens=48, temperature=0.7)
    generate.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a few built-in ones")

    chat = commands.add_parser("chat", help="an interactive chat in the terminal (one line per message; "
                                            "/reset forgets, /exit or end of input quits)")
    add_engine_arguments(chat)
    _add_sampling_arguments(chat, max_tokens=128, temperature=0.7)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    chat.add_argument("--chat-template", default=None, help="a chat template file (or text) instead of the model's")

    bench = commands.add_parser("bench", help="offline engine throughput (--offline) or online serving (--url)")
    add_engine_arguments(bench, model_flag=False)  # (its --model is the served model's name)
    mode = bench.add_mutually_exclusive_group(required=True)
    mode.add_argument("--offline", action="store_true", help="run the engine in this process")
    mode.add_argument("--url", default=None, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    bench.add_argument("--rate", type=float, nargs="+", default=[math_inf()],
                       help="online: request rates (requests/s, Poisson arrivals; inf = all at once); several "
                            "run one after another (default inf)")
    bench.add_argument("--max-concurrency", type=positive_int, default=None,
                       help="online: at most this many requests in flight; an arrived request waits for a place, "
                            "and its latencies count from when it is sent (vLLM's flag and semantics; default: "
                            "no limit)")
    bench.add_argument("--num-prompts", type=positive_int, default=256, help="(default 256, nano-vllm's)")
    bench.add_argument("--input-len", default="100:1024", help="prompt tokens MIN:MAX, uniform (default 100:1024)")
    bench.add_argument("--output-len", default="100:1024", help="output tokens MIN:MAX, uniform (default 100:1024)")
    bench.add_argument("--vocab", type=positive_int, default=10000,
                       help="prompt token ids are drawn below this (default 10000; at most the model's vocabulary "
                            "offline, and online where /v1/models gives vocab_size, as atom-core serve's does)")
    bench.add_argument("--seed", type=seed_value, default=0)
    bench.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                       help="online: do not send ignore_eos (vLLM's extension) for servers that refuse unknown "
                            "fields; requests may then end early at EOS (the figures count the tokens received)")
    bench.add_argument("--bench-temperature", type=finite_float(0.0, 2.0), default=0.6,
                       help="sampling temperature of the requests (default 0.6, nano-vllm's)")
    bench.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                       help="online: token-id prompts to /v1/completions, or word prompts to /v1/chat/completions")
    bench.add_argument("--model", default=None, help="online: the model name (default: the server's first)")
    bench.add_argument("--api-key", default=None, help="online: Bearer key (default: $ATOM_CORE_API_KEY / "
                                                       "$OPENAI_API_KEY)")
    bench.add_argument("--json", default=None, help="also write the results to this file")
    return parser


TOOL_CALLS_REFUSED = ("tool-call parsing is not implemented: calls are not parsed out of the reply, so a request's "
                      "tools are served with tool_choice 'none' only (rendered into the prompt; docs/serving.md)")


class RefusedFlag(argparse.Action):
    """A vLLM flag for something atom_core does not do: giving it is a usage error that says why (not
    "unrecognized arguments")."""

    def __init__(self, option_strings, dest, why: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {self.why}")


def math_inf() -> float:
    return float("inf")


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def json_string_list(text: str) -> list[str]:
    """--allowed-origins and the like: a JSON list of strings, as vLLM takes them (``'["*"]'``)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def seed_value(text: str) -> int:
    """--seed: an int in [0, 2**64), what SamplingParams takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {value}")
    return value


def _add_sampling_arguments(parser, *, max_tokens: int, temperature: float) -> None:
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens,
                        help=f"tokens to generate (default {max_tokens})")
    parser.add_argument("--temperature", type=finite_float(0.0, 100.0), default=temperature,
                        help=f"0 = greedy (default {temperature})")
    parser.add_argument("--top-p", type=finite_float(0.0, 1.0, low_open=True), default=0.9, help="(default 0.9)")
    parser.add_argument("--seed", type=seed_value, default=None,
                        help="the sampling seed (generate: prompt i uses seed + i; default: fresh randomness)")


# ------------------------------------------------------------------------------------------ commands

def run_serve(args) -> None:
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(f"atom-core serve needs the serve extra ({e.name or e} is not installed): "
                         'pip install "atom_core[serve]"') from None
    from atom_core.engine.async_engine import AsyncEngine
    from atom_core.serve.app import create_app
    from atom_core.serve.common import ServerConfig

    path = checkpoint_path(args)
    engine = build_engine(args)
    name, *aliases = args.served_model_name or [_model_name(path) if path else "atom_core-demo"]
    config = ServerConfig(model_name=name, model_aliases=tuple(aliases),
                          api_key=args.api_key or os.environ.get("ATOM_CORE_API_KEY") or None,
                          max_request_bytes=args.max_request_bytes, max_output_tokens=args.max_output_tokens,
                          chat_template=chat_template_for(engine, args.chat_template),
                          trust_request_chat_template=args.trust_request_chat_template,
                          enable_rl_endpoints=args.enable_rl_endpoints, allowed_origins=tuple(args.allowed_origins),
                          allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
                          allow_credentials=args.allow_credentials)
    app = create_app(AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests), config)
    print(f"serving {name!r} (max_model_len {engine.max_model_len}, device {engine.device}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=args.log_requests)
    finally:
        _shutdown(engine)


def _model_name(path: str) -> str:
    """The served name of a checkpoint at ``path``: its folder's name (``.`` resolved), a config file's stem."""
    p = Path(path).resolve()
    return p.stem if p.is_file() else p.name or str(p)


def _shutdown(engine) -> None:
    """Stop the engine's worker ranks (--tensor-parallel-size); nothing to do for one rank."""
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()


def run_generate(args) -> None:
    engine = build_engine(args)
    try:
        _generate(engine, args)
    finally:
        _shutdown(engine)


def _generate(engine, args) -> None:
    from atom_core.engine import SamplingParams

    if engine.tokenizer is None:
        raise UsageError("generate needs a model with a tokenizer (tokenizer.json); bench --offline and serve take "
                         "token ids")
    prompts = [clean_text(p) for p in args.prompt] if args.prompt else DEFAULT_PROMPTS
    seed = args.seed if args.seed is not None else 0
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                             seed=seed + i) for i in range(len(prompts))]
    generate_and_print(engine, prompts, params)


def run_chat(args, stdin=None, stdout=None) -> None:
    if stdin is None:
        if sys.stdin is None:
            raise UsageError("chat reads its messages from standard input, which is closed")
        buffer = getattr(sys.stdin, "buffer", None)  # (a text stream put in its place has none)
        # Undecodable bytes become U+FFFD, not an error that ends the conversation.
        stdin = sys.stdin if buffer is None else io.TextIOWrapper(buffer, encoding="utf-8", errors="replace")
    engine = build_engine(args)
    try:
        _chat(engine, args, stdin, stdout or sys.stdout)
    except BrokenPipeError:
        # The reader (| head) left: the conversation ends there, and stdout's last flush must not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        _shutdown(engine)


def _chat(engine, args, stdin, stdout) -> None:
    from atom_core.engine import SamplingParams
    from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE

    if engine.tokenizer is None:
        raise UsageError("chat needs a model with a tokenizer (tokenizer.json)")
    template = chat_template_for(engine, args.chat_template)
    # A base model under the plain fallback template writes the next "user:" line itself: stop there.
    stop = ["\nuser:"] if template == FALLBACK_CHAT_TEMPLATE else None
    opening = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(opening)
    interactive = stdin.isatty()
    if interactive:
        print("chat with the model: one line per message; /reset forgets, /exit quits", file=sys.stderr)
    turn = 0
    while True:
        if interactive:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            break
        text = clean_text(line).strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": text})
        prompt = _fit_context(engine, messages, opening, template)
        if prompt is None:
            messages.pop()
            print("error: this message alone is longer than the model's context", file=sys.stderr)
            continue
        room = engine.max_model_len - len(prompt)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=min(args.max_tokens, room),
                                stop=stop, seed=None if args.seed is None else args.seed + turn)
        engine.add_request(prompt, params)
        pieces = []
        print("assistant:", end=" ", file=stdout, flush=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                pieces.append(out.new_text)
                print(out.new_text, end="", file=stdout, flush=True)
        print(file=stdout, flush=True)
        messages.append({"role": "assistant", "content": "".join(pieces).strip()})
        turn += 1


def _fit_context(engine, messages: list[dict], opening: list[dict], template: str | None) -> list[int] | None:
    """The rendered conversation's token ids, dropping the oldest exchanges (a user message and the reply to it,
    so the history still opens with a user turn, as templates that check alternating roles require) until a
    reply has room."""
    while True:
        prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
        if len(prompt) < engine.max_model_len:
            return prompt
        if len(messages) <= len(opening) + 1:
            return None
        del messages[len(opening):len(opening) + 2]  # the oldest user message after the system one, and its reply


def _refuse_online_flags(args) -> None:
    """An offline run given a flag that only an online run reads: a usage error naming it (``--model`` names the
    served model online; offline, the checkpoint is PATH)."""
    given = [flag for flag, value, default in (
        ("--model", args.model, None), ("--api-key", args.api_key, None), ("--rate", args.rate, [math_inf()]),
        ("--max-concurrency", args.max_concurrency, None), ("--no-ignore-eos", args.ignore_eos, True),
        ("--endpoint", args.endpoint, "completions")) if value != default]
    if given:
        hint = " (the served model's name; offline, give the checkpoint as PATH)" if "--model" in given else ""
        raise UsageError(f"{', '.join(given)}: online only (with --url), not with --offline{hint}")


def run_bench(args) -> None:
    from atom_core.serve import bench

    try:
        input_len, output_len = bench.parse_range(args.input_len), bench.parse_range(args.output_len)
    except ValueError as e:
        raise UsageError(f"--input-len / --output-len: {e}") from None
    if not all(rate > 0 for rate in args.rate):
        raise UsageError(f"--rate must be > 0 (or inf), got {' '.join(map(str, args.rate))}")
    if args.json:  # found out now, not after the whole run
        _check_writable(args.json)
    rows = []
    if args.offline:
        _refuse_online_flags(args)
        engine = build_engine(args)
        try:
            vocab = min(args.vocab, engine.model.config.vocab_size)
            workload = bench.make_workload(args.num_prompts, input_len, output_len, vocab, args.seed,
                                           engine.max_model_len)
            if workload.note:
                print(workload.note, file=sys.stderr)
            rows.append(bench.run_offline(engine, workload, args.bench_temperature))
        finally:
            _shutdown(engine)
        bench.print_table(rows, bench.OFFLINE_COLUMNS)
    else:
        api_key = args.api_key or os.environ.get("ATOM_CORE_API_KEY") or os.environ.get("OPENAI_API_KEY")
        try:
            model, max_model_len, vocab_size = asyncio.run(bench.server_info(args.url, api_key))
        except (OSError, bench.HTTPError, ValueError, KeyError, IndexError) as e:
            raise UsageError(f"--url {args.url}: could not read /v1/models ({e})") from None
        if model is None and args.model is None:
            raise UsageError(f"--url {args.url}: /v1/models lists no model; name one with --model")
        vocab = min(args.vocab, vocab_size) if isinstance(vocab_size, int) and vocab_size > 0 else args.vocab
        workload = bench.make_workload(args.num_prompts, input_len, output_len, vocab, args.seed, max_model_len)
        if workload.note:
            print(workload.note, file=sys.stderr)
        for rate in args.rate:
            rows.append(asyncio.run(bench.run_online(args.url, workload, rate, model=args.model or model,
                                                     kind=args.endpoint, api_key=api_key,
                                                     temperature=args.bench_temperature, seed=args.seed,
                                                     ignore_eos=args.ignore_eos,
                                                     max_concurrency=args.max_concurrency)))
            if args.json:  # after each rate: a run stopped at a later rate keeps the earlier ones
                Path(args.json).write_text(bench.as_json(rows))
        bench.print_table(rows, bench.ONLINE_COLUMNS)
        for row in rows:
            if row["first_error"]:
                print(f"rate {row['rate']}: {row['failed']} failed; first error: {row['first_error']}",
                      file=sys.stderr)
    if args.json:
        Path(args.json).write_text(bench.as_json(rows))


def _check_writable(path: str) -> None:
    """--json: a file this process can write (an existing one is replaced at the end)."""
    p = Path(path)
    if p.is_dir() or not p.parent.is_dir() or (p.exists() and not os.access(p, os.W_OK)) or \
            (not p.exists() and not os.access(p.parent, os.W_OK)):
        raise UsageError(f"--json {path!r}: not a file that can be written")


COMMANDS = {"serve": run_serve, "generate": run_generate, "chat": run_chat, "bench": run_bench}


def main(argv: list[str] | None = None) -> int:
    """Run a command; a user error prints one line, ``error: ...``, on stderr and returns 2."""
    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
    except (UsageError, ValueError, TypeError, OSError, MemoryError) as e:
        print(f"error: {' '.join(str(e).split()) or type(e).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
