"""``Prefetcher``: prepares the next batches on a background thread while the device trains.

::

    source iterator --(thread: next(), jax.device_put)--> bounded queue --> for batch in ...
                        runs up to ``buffer_size`` batches ahead

The thread reads the source (parsing files, generating samples, building KJTs) and starts
the host-to-device copies, so that a jitted step rarely waits for data. Order is kept; an
exception raised by the source is raised again in the consumer at the same position.

Shutdown: ``close()`` (also called by ``with Prefetcher(...) as it:``, at the end of the
data, and when the ``Prefetcher`` is garbage collected) stops the thread, which then
closes the source if it has a ``close()`` (a generator: its ``finally`` blocks, e.g. open
files, run) and exits. A consumer that breaks out of its loop early should ``close()``
or use ``with``; the thread holds no reference to the ``Prefetcher`` and is a daemon,
so even a forgotten one never keeps the interpreter alive.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import jax

_POLL_S = 0.05
_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts ``item`` unless ``stop`` is set first; True if it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterable, q: queue.Queue, stop: threading.Event, device: Any) -> None:
    iterator = None
    try:
        iterator = iter(source)
        for item in iterator:
            if stop.is_set():
                return
            if device is not False:
                item = jax.device_put(item, device)
            if not _put(q, item, stop):
                return
        _put(q, _END, stop)
    except BaseException as error:  # handed to the consumer
        _put(q, _Failure(error), stop)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def _shutdown(stop: threading.Event, q: queue.Queue, thread: threading.Thread, timeout) -> None:
    stop.set()
    while True:  # unblock a producer waiting on a full queue, drop what it made
        try:
            q.get_nowait()
        except queue.Empty:
            break
    if thread is not threading.current_thread():
        thread.join(timeout)


class Prefetcher:
    """Iterates over ``source`` with up to ``buffer_size`` items prepared ahead.

    Args:
      source: any iterable (e.g. a ``CriteoReader``, ``SyntheticClickLog.batches(...)``).
      buffer_size: items prepared ahead (the queue bound), >= 1.
      device: where ``jax.device_put`` puts each item: ``None`` (the default device), a
        ``jax.Device`` or a ``jax.sharding.Sharding``; ``False`` skips ``device_put``.
      join_timeout_s: how long ``close()`` waits for the thread (``None``: until it ends,
        which is after the source's current ``next()`` returns).
    """

    def __init__(
        self,
        source: Iterable,
        *,
        buffer_size: int = 2,
        device: Any = None,
        join_timeout_s: float | None = None,
    ):
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}.")
        self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce,
            args=(source, self._queue, self._stop, device),
            name="jaxrec-prefetch",
            daemon=True,
        )
        self._closed = False
        self._finalizer = weakref.finalize(
            self, _shutdown, self._stop, self._queue, self._thread, join_timeout_s
        )
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        return item

    def close(self) -> None:
        """Stops the thread and closes the source; idempotent."""
        self._closed = True
        self._finalizer()

    @property
    def alive(self) -> bool:
        """Whether the background thread still runs."""
        return self._thread.is_alive()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
