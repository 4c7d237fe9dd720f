"""The built-in ``pixel_values`` plugin, hook by hook: an image request's pixels become rows of
its positions, a step with images gets ``pixel_rows`` and ``image_rows`` for exactly its
scheduled tokens, text-only steps get nothing, and removal is idempotent. A page-retrieval
model's pages (``images_in_prompt``) take their prompt's positions, rows of their own width
left-aligned in the step's widest."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from poolrunner.core import InvalidRequestError, PoolingParams, PoolingRequest, RequestState
from poolrunner.core.plugin_api.batch import InputBatch
from poolrunner.core.plugin_api.request import advance
from poolrunner.plugins import pixel_values as plugin

CLIP = SimpleNamespace(name="tiny-clip", architecture="CLIPModel", image_positions=5, images_in_prompt=False)
TEXT = SimpleNamespace(name="tiny-bert", architecture="BertModel", image_positions=None, images_in_prompt=False)
PAGES = SimpleNamespace(name="tiny-colqwen2", architecture="ColQwen2ForRetrieval", image_positions=None,
                        images_in_prompt=True)


def image_state(request_id: str, pixels: torch.Tensor, positions: int = 5,
                grid: tuple[int, ...] | None = None) -> RequestState:
    kwargs = None if grid is None else {"image_grid_thw": torch.tensor([grid])}  # ColQwen2's, [1, 3]
    return RequestState(request=PoolingRequest(request_id=request_id, prompt_token_ids=(0,) * positions,
                                               params=PoolingParams(task="embed"), pixel_values=pixels,
                                               image_kwargs=kwargs))


def text_state(request_id: str, length: int) -> RequestState:
    return RequestState(request=PoolingRequest(request_id=request_id, prompt_token_ids=tuple(range(3, 3 + length)),
                                               params=PoolingParams(task="embed")))


def test_add_request_spreads_the_pixels_over_the_positions():
    pixels = torch.arange(3 * 2 * 2, dtype=torch.float32).view(3, 2, 2)  # 12 values over 5 positions: 3 each
    state = image_state("a", pixels)
    plugin.add_request(state=state, model_config=CLIP)
    rows = state.plugin_data[plugin.NAME]
    assert rows.shape == (5, 3)
    assert rows.reshape(-1)[:12].tolist() == pixels.reshape(-1).tolist() and rows.reshape(-1)[12:].tolist() == [0] * 3
    text = text_state("b", 4)
    plugin.add_request(state=text, model_config=CLIP)
    assert plugin.NAME not in text.plugin_data


def test_an_image_for_another_model_is_refused():
    with pytest.raises(InvalidRequestError) as info:
        plugin.add_request(state=image_state("a", torch.zeros(3, 2, 2)), model_config=TEXT)
    assert str(info.value) == ("request 'a' is an image of 5 positions, but model tiny-bert (BertModel) takes "
                               "images of None positions")
    with pytest.raises(InvalidRequestError, match="takes images of 5 positions"):
        plugin.add_request(state=image_state("b", torch.zeros(3, 2, 2), positions=4), model_config=CLIP)


def test_prepare_inputs_gives_the_scheduled_rows_of_each_image():
    image = image_state("img", torch.arange(15, dtype=torch.float32).view(3, 5, 1))  # 3 values per position
    text = text_state("txt", 2)
    for state in (image, text):
        plugin.add_request(state=state, model_config=CLIP)
    assert plugin.prepare_inputs(batch=InputBatch.build([text], [2], torch.device("cpu")), model_config=CLIP) is None
    advance(image, 1)  # a step that starts at the image's second position
    extra = plugin.prepare_inputs(batch=InputBatch.build([text, image], [2, 3], torch.device("cpu")),
                                  model_config=CLIP)
    assert extra["image_rows"].tolist() == [False, False, True, True, True]
    assert extra["pixel_rows"].tolist() == [[0, 0, 0], [0, 0, 0], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_remove_request_is_idempotent():
    state = image_state("a", torch.zeros(3, 2, 2))
    plugin.add_request(state=state, model_config=CLIP)
    plugin.remove_request(state=state)
    plugin.remove_request(state=state)
    assert state.plugin_data == {}


def test_image_kwargs_travel_per_position_or_per_image():
    """SigLIP2's ``pixel_attention_mask`` (one entry per position) and ``spatial_shapes`` (one per
    image) become ``<name>_rows`` for exactly the scheduled tokens, in their own dtype."""
    kwargs = {"pixel_attention_mask": torch.tensor([1, 1, 1, 0, 0], dtype=torch.int32),
              "spatial_shapes": torch.tensor([1, 3], dtype=torch.int64)}
    image = RequestState(request=PoolingRequest(
        request_id="img", prompt_token_ids=(0,) * 5, params=PoolingParams(task="embed"),
        pixel_values=torch.zeros(5, 2), image_kwargs=kwargs))
    text = text_state("txt", 2)
    for state in (image, text):
        plugin.add_request(state=state, model_config=CLIP)
    advance(image, 2)
    extra = plugin.prepare_inputs(batch=InputBatch.build([text, image], [2, 3], torch.device("cpu")),
                                  model_config=CLIP)
    assert extra["pixel_attention_mask_rows"].dtype == torch.int32
    assert extra["pixel_attention_mask_rows"].tolist() == [[0], [0], [1], [0], [0]]
    assert extra["spatial_shapes_rows"].tolist() == [[0, 0], [0, 0], [1, 3], [1, 3], [1, 3]]
    plugin.remove_request(state=image)
    assert image.plugin_data == {}
def test_pages_take_their_prompts_positions_rows_of_their_width_and_their_grid():
    """Pages of 4 and 2 positions (widths 3 and 4), a query between them: each page's rows are
    left-aligned in the step's widest, and its grid is on each of its positions."""
    wide = image_state("wide", torch.arange(8, dtype=torch.float32).view(2, 4), positions=2, grid=(1, 1, 2))
    narrow = image_state("narrow", torch.arange(10, dtype=torch.float32).view(5, 2), positions=4, grid=(1, 5, 1))
    query = text_state("query", 2)
    for state in (narrow, query, wide):
        plugin.add_request(state=state, model_config=PAGES)
    extra = plugin.prepare_inputs(batch=InputBatch.build([narrow, query, wide], [4, 2, 2], torch.device("cpu")),
                                  model_config=PAGES)
    assert extra["image_rows"].tolist() == [True] * 4 + [False] * 2 + [True] * 2
    assert extra["pixel_rows"].tolist() == [[0, 1, 2, 0], [3, 4, 5, 0], [6, 7, 8, 0], [9, 0, 0, 0],
                                            [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert extra["image_grid_thw_rows"].tolist() == [[1, 5, 1]] * 4 + [[0, 0, 0]] * 2 + [[1, 1, 2]] * 2
