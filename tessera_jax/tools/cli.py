"""What the command-line tools share: a parser whose errors are one line, checked option types,
the missing-extra message, and a progress line that keeps ticking through long silent calls.

The option types raise ``argparse.ArgumentTypeError``, so a malformed or nonsensical value ends
in ``prog: error: argument --name: ...`` and exit status 2, never in a traceback or a value
silently replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading

__all__ = ["Parser", "positive_int", "nonnegative_int", "positive_float", "nonnegative_float",
           "fraction", "int_tuple", "missing_extra", "ticking"]


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``prog`` is the ``python -m`` command of the tool and whose
    errors are one line on stderr (the option and the problem; ``--help`` for the rest)."""

    def __init__(self, module: str, **kwargs):
        super().__init__(prog=f"python -m {module}", **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _number(text: str, kind, what: str, ok) -> int | float:
    try:
        x = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if not ok(x):
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return x


def positive_int(text: str) -> int:
    """An int >= 1."""
    return _number(text, int, "an integer >= 1", lambda x: x >= 1)


def nonnegative_int(text: str) -> int:
    """An int >= 0."""
    return _number(text, int, "an integer >= 0", lambda x: x >= 0)


def positive_float(text: str) -> float:
    """A finite float > 0."""
    return _number(text, float, "a finite number > 0", lambda x: 0 < x < float("inf"))


def nonnegative_float(text: str) -> float:
    """A finite float >= 0."""
    return _number(text, float, "a finite number >= 0", lambda x: 0 <= x < float("inf"))


def fraction(text: str) -> float:
    """A float in (0, 1]."""
    return _number(text, float, "a number in (0, 1]", lambda x: 0 < x <= 1)


def int_tuple(names: str):
    """An option type for ``len(names.split(","))`` comma-separated ints >= 1, e.g.
    ``int_tuple("T,H,W")`` reads "4,16,16" as (4, 16, 16)."""
    n = len(names.split(","))

    def parse(text: str) -> tuple[int, ...]:
        parts = text.split(",")
        try:
            vals = tuple(int(p) for p in parts)
        except ValueError:
            vals = ()
        if len(parts) != n or len(vals) != n or min(vals) < 1:
            raise argparse.ArgumentTypeError(
                f"expected {n} comma-separated integers >= 1 ({names}), got {text!r}")
        return vals

    parse.__name__ = names      # argparse names the type in some messages
    return parse


def missing_extra(module: str, extra: str) -> str:
    """What a tool says when its optional dependency ``module`` is not installed."""
    return (f"this tool needs {module}, which is not installed; install the '{extra}' extra: "
            f"pip install 'tessera_jax[{extra}]'")


@contextlib.contextmanager
def ticking(desc: str, total: int | None = None, unit: str = "it", every: float = 1.0):
    """A tqdm progress line on stderr, redrawn every ``every`` seconds even when nothing
    advances it (a compile, a long first step), so no phase is silent; yields the bar. Only on
    a terminal: redirected output (logs, CI) gets no control characters."""
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
               mininterval=0.2, leave=False, disable=None,
               bar_format=None if total else "{desc}: {elapsed}")
    stop = threading.Event()

    def tick():
        while not stop.wait(every):
            bar.refresh()

    t = threading.Thread(target=tick, daemon=True)
    if not bar.disable:
        t.start()
    try:
        yield bar
    finally:
        stop.set()
        if t.is_alive():
            t.join()
        bar.close()
