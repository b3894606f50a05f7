"""The ``clefcore`` command: decide, demo, synth, verify, bench, serve, loadtest, download.

A user's mistake (a missing file, a busy port, a wrong model path, no network) ends the command with one line on
stderr and exit status 1; ``clefcore --debug COMMAND`` shows the traceback too.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

from . import __version__, answers
from .engine import load
from .errors import ClefError, RequestError
from .example_request import support_ticket
from .jsonvalue import parse_body
from .options import EngineOptions, HelpFormatter, model_options, serve_options
from .progress import terminal_bar

EXIT_REJECTED = 2
DEMO_MODEL = Path(tempfile.gettempdir()) / "clefcore-demo-tiny"


def _print(obj) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    EngineOptions().add_flags(p)


def _load(args, model: str):
    return load(model, args.device, EngineOptions.from_args(args), progress=terminal_bar(), revision=args.revision)


def cmd_decide(args) -> int:
    engine = _load(args, args.model)
    data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    try:
        prepared = engine.prepare(parse_body(data))
    except RequestError as e:
        _print(e.to_json())
        return EXIT_REJECTED
    logits, _, _ = engine.forward([prepared.record])
    out = answers.response(prepared.request, prepared.record, logits[0], engine.confidence)
    if args.debug:
        rec = prepared.record
        out["debug"] = {"input_ids": rec.input_ids.tolist(), "questions": [
            {"id": q.id, "question_span": list(q.question_span), "option_ids": list(q.option_ids),
             "option_spans": [list(s) for s in q.option_spans], "logits": [float(x) for x in z]}
            for q, z in zip(rec.questions, logits[0])]}
    _print(out)
    return 0


def cmd_demo(args) -> int:
    """The README's first command: a tiny synthetic model on the CPU and the example request."""
    from . import synth
    model = args.model
    if model is None:
        model = DEMO_MODEL
        if not (model / "config.json").exists():
            synth.write("tiny", 0, model)
    engine = _load(args, model)
    if args.model is None:
        sys.stderr.write(f"clefcore demo: synthetic random-weight model at {model} on {engine.device}; "
                         "its answers are meaningless (use --model for real weights)\n")
    body = support_ticket()
    _print({"request": body, "response": engine.decide(body)})
    return 0


def cmd_synth(args) -> int:
    from . import synth
    out = synth.write(args.preset, args.seed, args.out, progress=terminal_bar("writing"), vision=args.vision)
    print(out)
    return 0


def _delegate(module: str):
    """Subcommands whose code lives beside what they exercise (the GPU backend, the server)."""
    def run(args) -> int:
        try:
            command = importlib.import_module(module)
        except ImportError as e:  # an optional part is not installed (aiohttp for serve)
            return _missing(args.command, e)
        return command.run(args)
    return run


DESCRIPTION = ("Answers System One requests (Cloudflare's Clef-flash) on an NVIDIA GPU or the CPU: one request from "
               "a file, or many over HTTP. 'clefcore COMMAND --help' lists a command's options.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clefcore", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"clefcore {__version__}")
    parser.add_argument("--debug", action="store_true", dest="traceback",
                        help="on an error, print its traceback too")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("decide", help="answer one System One request (a JSON file, or - for stdin)",
                       formatter_class=HelpFormatter)
    model_options(p)
    _engine_options(p)
    p.add_argument("--debug", action="store_true", help="add input ids, spans and logits under \"debug\"")
    p.add_argument("file")
    p.set_defaults(func=cmd_decide)

    p = sub.add_parser("demo", help="synthesize a tiny random model and answer the example request",
                       formatter_class=HelpFormatter)
    model_options(p, absent=f"a tiny random-weight model, written to {DEMO_MODEL} the first time")
    _engine_options(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("synth", help="write a random-weight checkpoint in the release layout",
                       formatter_class=HelpFormatter)
    p.add_argument("--preset", choices=("tiny", "clef-flash"), default="tiny",
                   help="the shapes: tiny (a small test model) or clef-flash (the release's 9B shapes, ~19 GB)")
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights: one seed, the same files")
    p.add_argument("--out", required=True, help="the directory to write the checkpoint into")
    p.add_argument("--vision", action="store_true",
                   help="write a complete random vision tower at the preset's shapes (clef-flash: the release's "
                        "27 blocks, 456M parameters, +0.9 GB) and its vision_config, so the model answers images; "
                        "without it only a one-tensor stub is written and image requests are refused")
    p.set_defaults(func=cmd_synth)

    for name, module, help_text in (
            ("verify", "clefcore.verify", "compare the GPU path with the fp32 numpy path on the example request"),
            ("bench", "clefcore.bench", "kernel and end-to-end microbenchmarks"),
            ("serve", "clefcore.server.main", "serve System One over HTTP"),
            ("loadtest", "clefcore.loadtest", "offered load against a server, latency by request class"),
            ("download", "clefcore.download", "fetch a release from the Hugging Face Hub into the cache, each file "
                                              "checked against the Hub's hashes")):
        p = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        if name == "serve":  # its flags are clefcore/options.py's: the server (and aiohttp) loads only to run
            serve_options(p)
            p.set_defaults(func=_delegate(module))
            continue
        try:
            importlib.import_module(module).add_arguments(p)
        except ImportError as e:  # an optional part is not installed (e.g. CuPy for verify/bench)
            p.set_defaults(func=lambda args, e=e, name=name: _missing(name, e))
            continue
        p.set_defaults(func=_delegate(module))
    return parser


def _missing(name: str, error: Exception) -> int:
    sys.stderr.write(f"clefcore {name}: unavailable ({error})\n")
    return 1


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ClefError, OSError) as error:   # what the user can fix: a path, a port, the network, a model
        if args.traceback:
            raise
        sys.stderr.write(f"clefcore {args.command}: {_one_line(error)}\n")
        return 1
    except KeyboardInterrupt:
        return 130


def _one_line(error: Exception) -> str:
    if isinstance(error, ClefError):
        text = error.message
    elif error.filename is not None:        # an OSError about a file: which file, and what is wrong with it
        text = f"{error.filename}: {error.strerror}"
    else:
        text = error.strerror or str(error)
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
