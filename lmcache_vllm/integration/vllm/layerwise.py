"""Driving the engine's layer-by-layer generators (`CacheEngine.retrieve_layer` / `store_layer`).

Each `next()` of such a generator moves one more layer. `advance` takes one step and turns the end of
the generator into False and a failure into a call of `on_error` (the caller logs and counts it): a
failing layer copy never raises into vLLM's step. `LayerSteps` advances several generators, one per
request, together: the worker steps them all at each layer vLLM announces.
"""
from __future__ import annotations

import functools
from typing import Callable, Generator, Generic, TypeVar

Tag = TypeVar("Tag")
LayerGenerator = Generator[object, None, object]


def advance(gen: LayerGenerator, on_error: Callable[[Exception], None]) -> bool:
    """One step of `gen`: True when it may have more; False once it finished, or failed (`on_error`)."""
    try:
        next(gen)
        return True
    except StopIteration:
        return False
    except Exception as exc:
        on_error(exc)
        return False


def run_to_end(gen: LayerGenerator, on_error: Callable[[Exception], None]) -> None:
    """Every remaining step of `gen` (a layerwise store's commit)."""
    while advance(gen, on_error):
        pass


class LayerSteps(Generic[Tag]):
    """Generators stepped together, each with the tag its failure is reported with."""

    def __init__(self) -> None:
        self.entries: list[tuple[Tag, LayerGenerator]] = []

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, tag: Tag, gen: LayerGenerator) -> None:
        self.entries.append((tag, gen))

    def step(self, on_error: Callable[[Tag, Exception], None]) -> None:
        """One step of every generator; finished and failed ones are dropped."""
        self.entries = [(tag, gen) for tag, gen in self.entries
                        if advance(gen, functools.partial(on_error, tag))]

    def take(self) -> list[tuple[Tag, LayerGenerator]]:
        """Every generator still running, handed over (and forgotten here)."""
        entries, self.entries = self.entries, []
        return entries

    def close(self) -> None:
        """Stops every generator (a generator's `finally` releases what it holds)."""
        for _, gen in self.take():
            gen.close()
