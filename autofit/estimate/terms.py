"""Memos of the estimator's terms, keyed by the knobs each term declares it reads.

A space repeats each knob value tens of thousands of times, so the estimator computes each group of
terms once per distinct value of the knobs it reads. A term names those knobs once (`reads`) and is
handed only them: a view of the config without the other knobs, which is also its memo key. A
term that starts reading one more knob fails at once (the view has no such field) instead of
answering from an entry keyed without it.

A term that reads the config's layout (`reads(..., layout=True)`) reads every knob the layout is a
function of (`autofit.layout.LAYOUT_KNOBS`) and is handed the layout the caller resolved once
(`autofit.layout.layout_of`, of the same GPUs, model and device as the term's context): the
layout is then a function of the key, so it is not part of it.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from operator import attrgetter
from typing import Any, Generic, TypeVar

from autofit.config import Config
from autofit.layout import LAYOUT_KNOBS

T = TypeVar("T")

__all__ = ["Term", "reads"]


class Term(Generic[T]):
    """A function of a config's `knobs` (given as a named tuple of just them) and of arguments
    that are not knobs: what a model or hardware fixes (`memo`'s `context`), or values derived
    from other terms (passed with each call, and part of the key). Called through `memo` only.
    With `layout`, the term also reads the layout knobs and is called with the config's layout
    (after its context, before the other arguments), which is not part of the key."""

    def __init__(self, fn: Callable[..., T], knobs: tuple[str, ...], layout: bool = False) -> None:
        if layout:
            knobs = (*knobs, *(name for name in LAYOUT_KNOBS if name not in knobs))
        unknown = set(knobs) - {f for f in Config.__dataclass_fields__}
        if unknown or len(knobs) < 2:
            raise ValueError(f"{fn.__name__} reads {knobs}: two or more of Config's fields")
        self.fn = fn
        self.knobs = knobs
        self.key = attrgetter(*knobs)
        self.view = namedtuple(f"{fn.__name__.lstrip('_')}_knobs", knobs)._make  # type: ignore[misc]
        self.takes_layout = layout

    def memo(self, *context: Any) -> Callable[..., T]:
        """The term with `context` bound, computed once per distinct value of its knobs and of the
        arguments of each call (a memo for one batch of configs: nothing outlives it). A term
        that reads the layout is called as `(config, layout, *args)`."""
        fn, key_of, view = self.fn, self.key, self.view
        found: dict[Any, T] = {}
        get = found.get
        keyed = 1 if self.takes_layout else 0  # a layout is a function of the key: not in it

        def memoised(config: Config, *args: Any) -> T:
            key = key_of(config)
            memo_key = (key, args[keyed:])
            value = get(memo_key)
            if value is None:
                value = found[memo_key] = fn(view(key), *context, *args)
            return value

        return memoised


def reads(*knobs: str, layout: bool = False) -> Callable[[Callable[..., T]], Term[T]]:
    """Declare the config knobs a term reads: `@reads("micro_batch", "seq_len")` over a function
    whose first parameter receives them (`knobs.micro_batch`); `layout=True`: and the config's
    layout, with every knob it is a function of (`Term`)."""

    def wrap(fn: Callable[..., T]) -> Term[T]:
        return Term(fn, knobs, layout)

    return wrap
