"""What a run shows a person, and where everything else goes.

By default rank 0's console carries only what a newcomer needs: what is starting (ranks and
roles, model, env server), the progress bar, warnings of this package, and a summary at the
end. Library chatter (Megatron's config dumps and bucket lists, SGLang's start-up lines,
Python warnings, progress bars of checkpoint loaders) goes to one log file per rank under
`<output_dir>/logs/`. The other ranks write their whole stdout and stderr there too (SGLang's
scheduler processes inherit it), so a failure on such a rank is one line on the console that
names its log file. `run.verbose=true` sends everything to the console instead, as before.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO, Optional

CONSOLE_LOGGER = "tide_megatron.console"
"""Lines a person should see (start-up facts, checkpoints, evaluation results, the summary)."""

_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"
_original_stderr: Optional[IO[str]] = None


class _PackageWarnings(logging.Filter):
    """On the quiet console: this package's warnings and errors, nothing from libraries."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("tide_megatron") and record.levelno >= logging.WARNING


def log_path(log_dir: str, rank: int) -> str:
    return os.path.join(log_dir, f"rank{rank}.log")


def setup(rank: int, log_dir: str, verbose: bool) -> str:
    """Route logging for this rank; returns its log file. Call once, before the job starts."""
    global _original_stderr
    os.makedirs(log_dir, exist_ok=True)
    path = log_path(log_dir, rank)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank)))
    root.addHandler(file_handler)
    logging.captureWarnings(True)

    console = logging.getLogger(CONSOLE_LOGGER)
    console.setLevel(logging.INFO)
    if verbose:
        stream = logging.StreamHandler(sys.stderr)
        stream.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        stream.setFormatter(logging.Formatter(f"[rank{rank}] %(levelname)s %(name)s: %(message)s"))
        root.addHandler(stream)
        return path
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # checkpoint writers/loaders
    if rank == 0:
        warn = logging.StreamHandler(sys.stderr)
        warn.addFilter(_PackageWarnings())
        warn.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(warn)
        _console_to_stdout(console)
    else:
        # Everything this process and its children print goes to the log file; a copy of the
        # real stderr is kept for the one line that names the file when this rank fails.
        sys.stdout.flush()
        sys.stderr.flush()
        _original_stderr = os.fdopen(os.dup(2), "w", buffering=1)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    return path


def _console_to_stdout(console: logging.Logger) -> None:
    handler = _TqdmSafeHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    console.addHandler(handler)


class _TqdmSafeHandler(logging.Handler):
    """Writes above a live progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


def say(message: str) -> None:
    """One line for the person running the job (rank 0's console; every rank's log file)."""
    logging.getLogger(CONSOLE_LOGGER).info(message)


def report_failure(rank: int, log_dir: str, exc: BaseException) -> None:
    """A rank is failing: one line on the real console naming the exception and its log."""
    stream = _original_stderr or sys.stderr
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    try:
        stream.write(f"[rank{rank}] {type(exc).__name__}: {first} (full log: {log_path(log_dir, rank)})\n")
        stream.flush()
    except Exception:
        pass
