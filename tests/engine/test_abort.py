"""``Engine.abort_request``: an admitted request leaves through ``remove_request`` exactly once,
and aborting an id the engine no longer holds is ignored."""

from __future__ import annotations

import poolrunner
from poolrunner.core import PoolingParams, PoolingRequest, hookimpl
from tests.helpers import assert_engine_empty


class Leaving:
    """Records every request its ``remove_request`` sees."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    @hookimpl
    def remove_request(self, state):
        self.removed.append(state.request_id)


def test_an_aborted_request_is_removed_once(poolrunner_hook_recorder):
    plugin = Leaving()
    runtime = poolrunner.Runtime(plugins=[plugin], load_entrypoints=False, dtype="float32")
    calls = poolrunner_hook_recorder(runtime)
    engine = runtime._engine
    engine.add_request(PoolingRequest(request_id="gone", prompt_token_ids=[101, 2000, 2001, 2002, 102],
                                      params=PoolingParams(task="embed")))
    assert list(engine.requests) == ["gone"]
    engine.abort_request("gone")
    engine.abort_request("gone")  # unknown by now: ignored
    assert plugin.removed == ["gone"]
    assert [call.name for call in calls.calls] == ["add_request", "remove_request"]
    assert_engine_empty(runtime)
