"""Progress display for long work (model conversion, benchmarks), on stderr so stdout stays data."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

stderr_console = Console(stderr=True)


@contextlib.contextmanager
def status(message: str, *, enabled: bool = True) -> Iterator[None]:
    """A spinner with elapsed time for work of unknown length (e.g. GGUF dequantization)."""
    if not enabled or not sys.stderr.isatty():
        stderr_console.print(f"[dim]{message} ...[/dim]") if enabled else None
        yield
        return
    with stderr_console.status(message):
        yield


def progress_bar(*, enabled: bool = True) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr_console,
        disable=not enabled,
    )
