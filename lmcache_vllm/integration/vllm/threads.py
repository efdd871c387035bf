"""Keeps our background threads out of OpenMP's way.

PyTorch runs parallel ops on OpenMP teams, one team per calling thread. When a second thread (our save
thread) runs a parallel op, libgomp then manages more threads than there are cores and stops letting
idle team members spin: every parallel region of vLLM's model thread then has to wake its workers.
Measured on 2 cores: a 32-token forward over a 4000-token context took 40 ms instead of 30 ms for the
rest of the process's life after one background save. `single_threaded_torch()`, called at the start
of a background thread, makes that thread's parallel ops run inline (one thread), so vLLM's team stays
the only one.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

_omp_set_num_threads = None
_looked_up = False


def _omp_setter() -> Callable[[int], Any] | None:
    global _omp_set_num_threads, _looked_up
    if not _looked_up:
        _looked_up = True
        try:  # the runtime torch loaded (same soname, so dlopen returns the loaded one)
            _omp_set_num_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
        except (OSError, AttributeError):
            _omp_set_num_threads = None
    return _omp_set_num_threads


def single_threaded_torch() -> bool:
    """Makes parallel torch ops (and our compiled ops) called from the current thread run on it alone.
    Only this thread is affected. Returns False where the OpenMP runtime could not be reached."""
    torch.get_num_threads()  # torch sets a new thread's OpenMP thread count on first use; do that first
    setter = _omp_setter()
    if setter is None:
        return False
    setter(1)
    return torch.get_num_threads() == 1
