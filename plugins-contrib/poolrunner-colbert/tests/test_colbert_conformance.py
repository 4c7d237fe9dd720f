"""poolrunner-colbert passes poolrunner's plugin conformance suite (the test kit)."""

from __future__ import annotations

import poolrunner_colbert
import pytest
from colbert_folders import projection, pylate_folder

from poolrunner.core.testing.conformance import PoolingPluginConformance


class TestColbertConformance(PoolingPluginConformance):
    @pytest.fixture
    def plugin(self):
        return poolrunner_colbert

    @pytest.fixture
    def claimed_tasks(self):
        return {"token_embed"}

    @pytest.fixture
    def task_models(self, poolrunner_tiny_model, tmp_path):
        return {"token_embed": pylate_folder(poolrunner_tiny_model(), tmp_path / "tiny-colbert", projection(32, 16))}

    def output_spec(self, task, model_config, num_tokens):
        return (num_tokens, 16), "float32"  # the projection's width, not hidden_size
