"""The processes poolrunner owns freeze what they loaded out of the garbage collector's reach
(:mod:`poolrunner.core.gc_heap`), so a full collection under load walks only what requests made."""

from __future__ import annotations

import gc
import weakref

import pytest

from poolrunner.core.config import RuntimeConfig
from poolrunner.core.distributed.actor import RuntimeActor
from poolrunner.core.gc_heap import freeze_loaded_objects


def collectable(obj: object) -> bool:
    """Whether some generation of the collector holds ``obj`` (a frozen object is in none)."""
    return any(other is obj for generation in range(3) for other in gc.get_objects(generation))


@pytest.fixture
def unfrozen():
    """Gives the frozen objects back to the collector after the test (this process is pytest's)."""
    yield
    gc.unfreeze()


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_the_loaded_objects_leave_every_generation_and_later_cycles_are_still_collected(unfrozen):
    loaded = Node()
    loaded.other = loaded
    freeze_loaded_objects()
    assert not collectable(loaded)
    assert gc.get_freeze_count() > 0

    made_later = Node()
    made_later.other = made_later
    assert collectable(made_later)
    gone = weakref.ref(made_later)
    del made_later
    gc.collect()
    assert gone() is None


def test_a_ray_data_actor_freezes_its_runtime_once_loaded(model_path, unfrozen):
    actor = RuntimeActor(RuntimeConfig(model=str(model_path)), [], {}, "fail")
    assert not collectable(actor.runtime)
