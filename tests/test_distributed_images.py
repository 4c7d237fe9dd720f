"""Ray jobs over an image column (issue 28): a Parquet file of encoded images and a JSON Lines
file of image paths give transformers' CLIP ``get_image_features`` per row, on a local Ray
cluster; a row that is not an image is left out naming its place (``on_error="skip"``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = [
    pytest.mark.slow,
    # Ray Data's own DataContext() assigns its deprecated fields in __init__ (as test_distributed.py notes).
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]

PHOTOS = ("coffee", "astronaut", "chelsea")


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_image_column_parquet_and_jsonl(ray_cluster, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    import skimage.data
    import torch
    import transformers
    from PIL import Image

    from poolrunner.core.distributed import run_job
    from poolrunner.core.testing.tiny_models import tiny_clip_folder

    folder = tiny_clip_folder(tmp_path / "clip")
    paths = []
    for name in PHOTOS:
        Image.fromarray(getattr(skimage.data, name)()).save(tmp_path / f"{name}.png")
        paths.append(tmp_path / f"{name}.png")
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["a", "b", "c", "bad"], "image": [*(p.read_bytes() for p in paths), b"nope"]}),
                   tmp_path / "in" / "bytes.parquet")
    (tmp_path / "in" / "paths.jsonl").write_text("".join(json.dumps({"image": str(p)}) + "\n" for p in paths))

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    with torch.inference_mode():
        want = model.get_image_features(**processor(images=[Image.open(p) for p in paths],
                                                    return_tensors="pt")).pooler_output
    want = torch.nn.functional.normalize(want, dim=-1).numpy()

    options = {"dtype": "float32", "load_entrypoints": False, "max_images_per_request": 2}
    for source in ("bytes.parquet", "paths.jsonl"):  # one format per job
        output = tmp_path / f"out-{source}"
        result = run_job(str(tmp_path / "in" / source), str(output), model=str(folder), image_field="image",
                         on_error="skip", runtime_options=options)
        if source == "bytes.parquet":
            assert result.rows_left_out == 1
            assert "bytes.parquet row 3: this input is not an image" in result.left_out[0], result.left_out
        (name,) = result.written
        table = pq.read_table(output / name)
        rows = table.column("row").to_pylist()
        assert rows[:3] == [0, 1, 2]
        got = np.stack([np.asarray(v, dtype=np.float32) for v in table.column("embedding").to_pylist()[:3]])
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1)
        print(f"ray-images {source}: min cosine {cosine.min():.8f}")
        assert cosine.min() >= 0.9999
