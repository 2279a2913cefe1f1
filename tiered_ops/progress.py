"""The progress bar of sweeps and tuning: tqdm without a time estimate until a few items are done (the first item
often compiles a kernel, and its time extrapolated over the rest read hours)."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

ETA_AFTER = 3  # items done before the bar shows a rate and the time remaining
NO_ETA = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


class Progress(tqdm):
    """``tqdm`` that shows no rate and no time remaining before ``ETA_AFTER`` items are done."""

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        if d["n"] < ETA_AFTER and d.get("bar_format") is None:
            d["bar_format"] = NO_ETA
        return d
