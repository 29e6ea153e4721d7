"""`nicoffload`: the command line. One module per command group; this one holds the app.

Exit codes: 0 ok; 2 the user's input is wrong (`file:line:col: message`, no traceback); 1 the
system failed (the message names the component). With `--json`, stdout carries one JSON document
and nothing else; progress and messages go to stderr.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer

from nicoffload.errors import NicoffloadError

app = typer.Typer(
    name="nicoffload",
    help=(
        "Declare, plan and run the preprocessing of AI serving pipelines across DPU, host CPU and GPU.\n\n"
        "Typical use: `nicoffload validate pipelines/resnet50.yaml`, then "
        "`nicoffload plan pipelines/resnet50.yaml`, then "
        "`nicoffload run pipelines/resnet50.yaml --sample 200`."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int, exc: BaseException | None = None) -> None:
    """One line for the error, then one per note added to it on the way out (what was left
    as it was: `run --output`'s folder)."""
    typer.echo(f"nicoffload: {message}", err=True)
    for note in getattr(exc, "__notes__", ()):
        typer.echo(f"nicoffload: {note}", err=True)
    raise typer.Exit(code)


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, a scheduler's time limit), raised in the main thread as Ctrl-C is."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM unwinds it as Ctrl-C does: `with` blocks close (agents
    stop, `run --output` leaves its folder as it was) instead of the process vanishing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def handle_errors(fn: F) -> F:
    """Map nicoffload errors to exit codes and one-line messages; never a traceback for those."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with sigterm_unwinds():
                return fn(*args, **kwargs)
        except NicoffloadError as exc:
            prefix = "error" if exc.exit_code == 2 else "failure"
            fail(f"{prefix}: {exc}", exc.exit_code, exc)
        except Terminated as exc:
            fail("terminated", 128 + signal.SIGTERM, exc)
        except KeyboardInterrupt as exc:
            fail("interrupted", 130, exc)
        except BrokenPipeError:
            raise typer.Exit(0) from None

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def busy(text: str) -> Iterator[None]:
    """A spinner and the time elapsed on stderr while the block runs (on a terminal only:
    nothing is written to a pipe or a log)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        progress.add_task(text, total=None)
        yield


def emit_json(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def build_app() -> typer.Typer:
    """The app with every command registered (command modules register on `app` when imported)."""
    import importlib

    for name in ("pipeline", "run", "plan", "profile", "p4", "serve", "loadgen", "simulate"):
        importlib.import_module(f"nicoffload.cli.{name}")
    return app


def main() -> None:
    build_app()()
