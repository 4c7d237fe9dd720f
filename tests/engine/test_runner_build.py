"""What the runner is built with at load: poolrunner's CPU attention kernel where it was built
(compile="auto" on a CPU that runs it), torch's SDPA elsewhere."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from poolrunner import Runtime
from poolrunner.core.kernels import cpu_kernels
from tests.helpers import pretend_amx

pytestmark = pytest.mark.skipif(not cpu_kernels.supported_dtypes(),
                                reason="the kernel needs an x86 CPU with AVX2 and a C++ compiler")


def _load_afresh(monkeypatch):
    """Have this test's loads find no build cached, in a cache of its own that monkeypatch drops
    again: the real build stays cached for the tests after it (a process holds one build)."""
    monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))


def test_a_runtime_on_the_cpu_fast_path_attends_in_it(model_path):
    assert Runtime(model_path, dtype="float32", load_entrypoints=False)._engine.runner.native_attention
    eager = Runtime(model_path, dtype="float32", compile="off", load_entrypoints=False)
    assert not eager._engine.runner.native_attention


def test_a_machine_that_cannot_build_it_attends_on_sdpa_and_says_why(monkeypatch, caplog, model_path, st_model):
    from torch.utils import cpp_extension

    def no_compiler(*_args, **_kwargs):
        raise RuntimeError("Error building extension 'poolrunner_packed_attention': g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    _load_afresh(monkeypatch)
    with caplog.at_level("WARNING", logger="poolrunner.core.kernels.cpu_kernels"):
        runtime = Runtime(model_path, dtype="float32", load_entrypoints=False)
    assert not runtime._engine.runner.native_attention
    assert ("poolrunner's CPU kernels could not be built, attention and RMSNorm run on torch: "
            "Error building extension 'poolrunner_packed_attention': g++: command not found") in caplog.messages
    texts = ["a kernel that did not build", "still answers"]
    expected = st_model.encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(runtime.embed(texts), expected, atol=1e-5)


def test_a_compiler_without_the_widest_builds_flags_builds_the_next(monkeypatch, caplog):
    """On a CPU with AMX the kernels are built with AMX's flags first; a compiler too old for them
    still builds the set below (one INFO line says why), not none."""
    import attrs
    from torch.utils import cpp_extension

    built = cpu_kernels._load()
    wider = attrs.evolve(built, name="wider")
    real_load = cpp_extension.load

    def load(name, *args, **kwargs):
        if "_wider_" in name:
            raise RuntimeError("g++: error: unrecognized command-line option '-mamx-tile'")
        return real_load(name, *args, **kwargs)

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(cpu_kernels, "_instruction_sets", lambda: (wider, built))
    _load_afresh(monkeypatch)
    with caplog.at_level("INFO", logger="poolrunner.core.kernels.cpu_kernels"):
        assert cpu_kernels._load() == built
    assert ("poolrunner's CPU kernels for wider could not be built: "
            "g++: error: unrecognized command-line option '-mamx-tile'") in caplog.messages


@pytest.mark.parametrize(("dtype", "amx", "budget"), [("bfloat16", True, 4096), ("bfloat16", False, 2048),
                                                      ("float32", True, 2048)])
def test_the_cpu_step_budget_is_larger_where_bf16_products_run_on_tiles(monkeypatch, model_path, dtype, amx, budget):
    """config.TILES_TOKEN_BUDGET: bf16 steps of 4,096 tokens on a CPU with AMX, 2,048 elsewhere
    and in float32; the option wins either way."""
    pretend_amx(monkeypatch, amx)
    runtime = Runtime(model_path, dtype=dtype, load_entrypoints=False)
    assert runtime.max_num_batched_tokens == runtime._engine.scheduler.max_num_batched_tokens == budget
    assert Runtime(model_path, dtype=dtype, max_num_batched_tokens=512,
                   load_entrypoints=False).max_num_batched_tokens == 512
