"""The progress bar shows no time estimate from a slow first item (a compile read as hours remaining)."""

import io
import time

from tiered_ops.progress import ETA_AFTER, Progress


def _items(n: int, first_s: float):
    for i in range(n):
        time.sleep(first_s if i == 0 else 0.0)  # the first item is slow, like a kernel compiled on first use
        yield i


def test_no_time_remaining_until_a_few_items_are_done():
    out = io.StringIO()
    n = 400
    for _ in Progress(_items(n, 0.5), total=n, file=out, mininterval=0, miniters=1, ncols=100, desc="sweep"):
        pass
    shown = [s.strip() for s in out.getvalue().split("\r") if s.strip()]
    by_done = {int(s.split("|")[2].split("/")[0]): s for s in shown}
    assert set(range(n + 1)) <= set(by_done), shown[:5]
    for done in range(ETA_AFTER):
        assert "<" not in by_done[done] and "/s" not in by_done[done], by_done[done]
    assert "<" in by_done[ETA_AFTER] and "/s" in by_done[ETA_AFTER], by_done[ETA_AFTER]
    assert by_done[0].startswith("sweep:") and "0/400" in by_done[0]
