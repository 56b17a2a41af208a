"""CompilePool: the threads that run the native grammar compiler, apart from everything else.

llguidance builds a grammar recursively, in native code, on the calling thread: a chain of a few
thousand rules overflows a default 8 MiB thread stack, and a stack overflow kills the process
(no exception can catch it). These threads are made with STACK_BYTES of stack (reserved address
space; only the pages a compile touches are used), which holds anything within the admission
limits of kvserve.sampling_params many times over. They are few and their own, so compiles
queue behind each other, never behind or in front of tokenizing, /health or the engine's steps.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

STACK_BYTES = 256 << 20
DEFAULT_THREADS = 2
_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set it, start, restore


class CompilePool:
    def __init__(
        self,
        threads: int = DEFAULT_THREADS,
        stack_bytes: int = STACK_BYTES,
        name: str = "kvserve-compile",
    ):
        self._jobs: list = []
        self._ready = threading.Condition()
        self._idents: set[int] = set()
        with _stack_lock:
            before = threading.stack_size(stack_bytes)
            try:
                workers = [
                    threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                    for i in range(threads)
                ]
                for w in workers:
                    w.start()
            finally:
                threading.stack_size(before)
        self._idents = {w.ident for w in workers}

    def on_pool_thread(self) -> bool:
        return threading.get_ident() in self._idents

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Run fn(*args) on a pool thread; its result or exception in the returned future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._ready:
            self._jobs.append((future, fn, args))
            self._ready.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                future, fn, args = self._jobs.pop(0)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter, whatever it is
                future.set_exception(e)
