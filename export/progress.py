"""Progress and timing for the phases of an export: one line per phase whose clock ticks while it runs.

Long single calls (the exporter, a big reference batch) report nothing themselves; a ticker thread refreshes
the phase's line every second so the terminal is never silent for more than that.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout

from tqdm import tqdm

TICK_SECONDS = 1.0


class Phases:
    """Times named phases (`times`, seconds) and shows each as a tqdm line unless disabled."""

    def __init__(self, show: bool = True) -> None:
        self.show = show
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, total: int | None = None, unit: str = "it") -> Iterator[tqdm]:
        fmt = "{desc}: {elapsed}" if total is None else None
        bar = tqdm(total=total, desc=name, unit=unit, disable=not self.show, bar_format=fmt, dynamic_ncols=True)
        stop = threading.Event()
        ticker = threading.Thread(target=_tick, args=(bar, stop), daemon=True)
        if self.show:
            ticker.start()
        start = time.perf_counter()
        try:
            yield bar
        finally:
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start
            stop.set()
            if ticker.is_alive():
                ticker.join()
            bar.close()

    def summary(self) -> str:
        parts = [f"{name} {seconds:.1f} s" for name, seconds in self.times.items()]
        return f"{', '.join(parts)}; total {sum(self.times.values()):.1f} s"


def _tick(bar: tqdm, stop: threading.Event) -> None:
    while not stop.wait(TICK_SECONDS):
        bar.refresh()


class StageLog(io.TextIOBase):
    """A stdout stand-in that turns the exporter's verbose lines ("[torch.onnx] Run decompositions...") into the
    phase line's description, so the user sees which step of the export is running."""

    def __init__(self, bar: tqdm, prefix: str) -> None:
        self.bar, self.prefix = bar, prefix

    def write(self, text: str) -> int:
        line = text.strip().removeprefix("[torch.onnx]").strip()
        if line.endswith("..."):  # a step starting ("... ✅" ends one)
            step = line.removesuffix("...").split(" for ")[0].split(" with ")[0].lower()
            self.bar.set_description_str(f"{self.prefix}: {step}", refresh=True)
        return len(text)


@contextmanager
def exporter_stages(bar: tqdm, prefix: str) -> Iterator[None]:
    with redirect_stdout(StageLog(bar, prefix)):
        yield
