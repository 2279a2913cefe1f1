"""What the CLI reads and writes as files, checked first: a mistake there is a ``UsageError`` that names the path and
what to do (``tiered-ops`` prints it on one line and exits 2)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

# The columns every results CSV has (written by ``export --csv``, ``bench --csv`` or a committed report).
RESULT_COLUMNS = ("op", "impl", "tier", "problem", "dtype", "mode", "device_key", "ok", "caller_us", "source_hash",
                  "timestamp")


class UsageError(Exception):
    """A mistake in what the command was given (a path, a file, a server): ``main`` prints it on one line and exits
    2, without a traceback. The message names the path and what to do."""


def read_results(files: list[str]) -> pd.DataFrame:
    """The rows of results CSV files, each checked: one that is missing, not a CSV or without the columns of a
    results file is a UsageError naming it."""
    import pandas as pd

    frames = []
    for f in files:
        if not Path(f).is_file():
            raise UsageError(f"{f}: {'is a directory' if Path(f).is_dir() else 'no such file'}; expected a results "
                             "CSV (`tiered-ops export --csv FILE` writes one, or reports/<gpu>/results.csv)")
        try:
            df = pd.read_csv(f)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
            raise UsageError(f"{f}: not a results CSV ({str(e).strip().splitlines()[0]}); give a file written by "
                             "`tiered-ops export --csv` or a committed reports/<gpu>/results.csv") from None
        missing = [c for c in RESULT_COLUMNS if c not in df.columns]
        if missing:
            raise UsageError(f"{f}: not a results CSV (no column {', '.join(missing)}); give a file written by "
                             "`tiered-ops export --csv` or a committed reports/<gpu>/results.csv")
        frames.append(df)
    return pd.concat(frames, ignore_index=True)


def out_file(path: str, option: str) -> Path:
    """A file to write: its directory must exist (a UsageError naming it otherwise)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a directory; give the path of a file to write")
    if not p.parent.is_dir():
        raise UsageError(f"{option} {path}: directory {p.parent} does not exist; create it (mkdir -p {p.parent}) "
                         "or give another path")
    return p
