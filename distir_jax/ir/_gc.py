"""The cyclic garbage collector: paused while a program is built or lowered,
and kept off long-lived objects during a sweep."""

from __future__ import annotations

import contextlib
import functools
import gc


def gc_paused(fn):
    """Decorates ``fn`` to run with the cyclic garbage collector paused.

    Building, transforming and lowering a program allocates hundreds of
    thousands of small objects that stay alive (ops, values, types). Each
    automatic collection re-scans all of them while finding almost nothing to
    free, which costs about a third of the build time. Reference counting
    still frees memory meanwhile; cycles made meanwhile are collected after
    the call. Results do not change.

    The collector is restarted only if this call paused it, so nested calls,
    and callers that disabled it themselves, keep their setting.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return wrapper


@contextlib.contextmanager
def older_objects_frozen():
    """Full collections skip the objects alive on entry (``gc.freeze``) until exit.

    A sweep allocates enough to trigger full collections of the whole heap,
    which in a process that imported jax holds hundreds of thousands of
    long-lived objects: each such collection costs ~50 ms and frees none of
    them. Objects allocated inside are collected as usual; on exit the frozen
    ones go back to the oldest generation. A caller that froze objects itself
    (``gc.get_freeze_count() > 0``) keeps its own freeze: nothing is done then.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
