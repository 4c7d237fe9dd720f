"""poolrunner-bgem3 passes poolrunner's plugin conformance suite (the test kit)."""

from __future__ import annotations

import poolrunner_bgem3
import pytest
from bgem3_folders import HIDDEN, write_bgem3_folder

from poolrunner.core.testing.conformance import PoolingPluginConformance


@pytest.fixture(scope="module")
def bgem3_folder(tmp_path_factory):
    return write_bgem3_folder(tmp_path_factory.mktemp("bgem3") / "tiny-bge-m3", colbert_dim=16)


class TestBgem3Conformance(PoolingPluginConformance):
    @pytest.fixture
    def plugin(self):
        return poolrunner_bgem3

    @pytest.fixture
    def claimed_tasks(self):
        return {"m3_embed"}

    @pytest.fixture
    def task_models(self, bgem3_folder):
        return {"m3_embed": bgem3_folder}

    @pytest.fixture
    def option_values(self):
        return {"outputs": "dense,sparse,colbert"}  # every part: the output_spec below

    def output_spec(self, task, model_config, num_tokens):
        if task == "m3_embed":  # the sparse part keeps the distinct ids with a positive weight
            return {"dense": ((HIDDEN,), "float32"), "token_ids": ((None,), "int64"),
                    "weights": ((None,), "float32"), "colbert": ((num_tokens - 1, 16), "float32")}
        return super().output_spec(task, model_config, num_tokens)
