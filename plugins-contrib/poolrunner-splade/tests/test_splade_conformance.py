"""poolrunner-splade passes poolrunner's plugin conformance suite (the test kit)."""

from __future__ import annotations

import poolrunner_splade
import pytest

from poolrunner.core.testing.conformance import PoolingPluginConformance


class TestSpladeConformance(PoolingPluginConformance):
    @pytest.fixture
    def plugin(self):
        return poolrunner_splade

    @pytest.fixture
    def claimed_tasks(self):
        return {"sparse_embed"}

    @pytest.fixture
    def task_models(self, poolrunner_tiny_model):
        return {"sparse_embed": poolrunner_tiny_model("BertForMaskedLM")}

    @pytest.fixture
    def option_values(self):
        return {"top_k": 5}

    def output_spec(self, task, model_config, num_tokens):
        if task == "sparse_embed":  # k non-zero weights, k unknown in advance
            return {"token_ids": ((None,), "int64"), "weights": ((None,), "float32")}
        return super().output_spec(task, model_config, num_tokens)
