"""Events per second of `autofit.estimate.allocator.replay` on one core.

    .venv/bin/python bench/allocator_speed.py [events]

Replays a synthetic step of `events` events (default 100,000): a training-step-like stack of
activations (allocated forward, freed backward in reverse order) with gradients and small
temporaries in between, the sizes spread from bytes to hundreds of MiB, then the same number of
random alloc/free events (the fragmenting worst case), each with and without expandable segments.
"""

from __future__ import annotations

import random
import sys
import time

from autofit.estimate.allocator import replay

MiB = 1024**2


def step_events(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Forward: activations pile up with small temporaries freed at once; backward: activations
    freed in reverse with a gradient and temporaries in between."""
    rng = random.Random(seed)
    events: list[tuple[int, int]] = []
    key = 0
    while len(events) < n:
        stack = []
        for _ in range(rng.randint(50, 400)):
            size = int(rng.choice([0.1, 1.5, 6, 24, 96]) * MiB * rng.uniform(0.5, 1.5))
            events.append((key, max(size, 1)))
            stack.append(key)
            key += 1
            tmp = key
            events += [(tmp, rng.randint(1, 900_000)), (tmp, 0)]
            key += 1
        grads = []
        while stack:
            k = stack.pop()
            grad = key
            events += [(grad, rng.randint(1, 64 * MiB)), (k, 0)]
            grads.append(grad)
            key += 1
        events += [(g, 0) for g in grads]
    return events[:n]


def random_events(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    events: list[tuple[int, int]] = []
    live: list[int] = []
    key = 0
    while len(events) < n:
        if live and (len(live) > 2000 or rng.random() < 0.5):
            k = live.pop(rng.randrange(len(live)))
            events.append((k, 0))
        else:
            events.append((key, int(2 ** rng.uniform(9, 28))))
            live.append(key)
            key += 1
    return events


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    for name, events in (("step", step_events(n)), ("random", random_events(n))):
        for expandable in (False, True):
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                result = replay(events, expandable_segments=expandable)
                best = min(best, time.perf_counter() - start)
            print(
                f"{name:6} expandable={expandable!s:5} {len(events):,} events in {best:.3f} s: "
                f"{len(events) / best:,.0f} events/s (peak reserved "
                f"{result.peak_reserved / MiB:,.0f} MiB, allocated "
                f"{result.peak_allocated / MiB:,.0f} MiB)"
            )


if __name__ == "__main__":
    main()
