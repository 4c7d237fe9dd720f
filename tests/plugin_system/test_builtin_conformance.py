"""Every built-in plugin passes the conformance suite that contrib plugins use.

The suite comes from the test kit (``poolrunner.core.testing``, loaded through the ``pytest11``
entry point); the built-ins are found by module name, so their entry point name is ``None``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from poolrunner.core.model.tasks import TOKEN_WEIGHT_HEAD_FILE
from poolrunner.core.testing.conformance import PoolingPluginConformance
from poolrunner.plugins import async_output, pixel_values, sequence_pooling, token_pooling, token_type_ids


class BuiltinConformance(PoolingPluginConformance):
    @pytest.fixture
    def entry_point_name(self) -> None:
        return None


class TestSequencePooling(BuiltinConformance):
    @pytest.fixture
    def plugin(self):
        return sequence_pooling

    @pytest.fixture
    def claimed_tasks(self):
        return {"embed", "classify"}

    @pytest.fixture
    def task_models(self, poolrunner_tiny_model):
        return {"embed": poolrunner_tiny_model(),
                "classify": poolrunner_tiny_model("BertForSequenceClassification", num_labels=2)}


@pytest.fixture(scope="module")
def bge_m3_like(tmp_path_factory, poolrunner_tiny_model) -> Path:
    """A tiny BertModel with a BGE-M3 token-weight head (``sparse_linear.pt``)."""
    folder = tmp_path_factory.mktemp("tiny-bge-m3")
    shutil.copytree(poolrunner_tiny_model(), folder, dirs_exist_ok=True)
    torch.manual_seed(0)
    torch.save(torch.nn.Linear(32, 1).state_dict(), folder / TOKEN_WEIGHT_HEAD_FILE)
    return folder


class TestTokenPooling(BuiltinConformance):
    @pytest.fixture
    def plugin(self):
        return token_pooling

    @pytest.fixture
    def claimed_tasks(self):
        return {"token_embed", "token_classify", "embed&token_classify"}

    @pytest.fixture
    def task_models(self, poolrunner_tiny_model, bge_m3_like):
        return {"token_embed": poolrunner_tiny_model(),
                "token_classify": poolrunner_tiny_model("BertForTokenClassification", num_labels=3),
                "embed&token_classify": bge_m3_like}


class TestTokenTypeIds(BuiltinConformance):
    @pytest.fixture
    def plugin(self):
        return token_type_ids

    @pytest.fixture
    def claimed_tasks(self):
        return set()


class TestPixelValues(BuiltinConformance):
    @pytest.fixture
    def plugin(self):
        return pixel_values

    @pytest.fixture
    def claimed_tasks(self):
        return set()


class TestAsyncOutput(BuiltinConformance):
    @pytest.fixture
    def plugin(self):
        return async_output

    @pytest.fixture
    def claimed_tasks(self):
        return set()
