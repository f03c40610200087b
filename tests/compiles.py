"""XLA backend compiles counted in tests, from jax.monitoring's compile event: a compile where
none is due (a request after ``tj.precompile``) shows as a non-empty list."""

import contextlib

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles():
    """Yields a list that gets the seconds of each XLA backend compile run inside the block."""
    seen = []

    def listen(event, duration, **_):
        if event == BACKEND_COMPILE:
            seen.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
