"""The progress bar of precompute and the CLI (tqdm on stderr), apart so that bars never import torch."""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["note", "progress_bar"]


def progress_bar(total: int | None, unit: str, quiet: bool, **kwargs: Any) -> Any:
    """A tqdm bar on stderr (shown on a terminal only), with a fixed width where the terminal reports 0 columns.

    tqdm takes a 0-column, 0-line report literally (a pty started by ``script -q -c`` gives
    one) and prints nothing at all.
    """
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: DataLoader workers may be forked after this
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        size = None  # not a terminal: tqdm decides (it shows nothing)
    # A 0-column or 0-line report: tqdm hides the bar entirely; use a fixed 80x24 instead.
    fixed = size is not None and (size.columns == 0 or size.lines == 0)
    width: dict[str, Any] = {"ncols": 80, "nrows": 24} if fixed else {"dynamic_ncols": True}
    return tqdm(total=total, unit=unit, disable=True if quiet else None, **width, **kwargs)


def note(text: str, quiet: bool) -> None:
    """Print ``text`` on stderr where a progress bar shows (a terminal, not ``quiet``): what a long step does."""
    stream = sys.stderr
    if not quiet and stream is not None and stream.isatty():
        print(text, file=stream, flush=True)
