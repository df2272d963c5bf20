"""Progress of `hybrid-runtime run` on the terminal: a bar over the point runs (with an ETA) and a
bar over the current phase (prefill, decode steps); messages print above them. `quiet` shows
nothing; bars show only on a terminal unless asked for."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, runs: int, quiet: bool = False, bars: bool | None = None):
        self.quiet = quiet
        show = (not quiet) and (sys.stderr.isatty() if bars is None else bars)
        self._disable = not show
        self.outer = tqdm(total=runs, desc="point runs", unit="run", disable=self._disable, position=0)

    def message(self, text: str) -> None:
        if not self.quiet:
            tqdm.write(text, file=sys.stdout)

    def phase(self, desc: str, total: int, unit: str) -> tqdm:
        """A bar for one phase of the current point run; close it (or use it as a context) when done."""
        return tqdm(total=total, desc=desc, unit=unit, disable=self._disable, position=1, leave=False)

    def point_started(self, label: str) -> None:
        self.outer.set_postfix_str(label)

    def run_done(self) -> None:
        self.outer.update()

    def close(self) -> None:
        self.outer.close()


__all__ = ["Progress"]
