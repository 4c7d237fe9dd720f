"""``poolrunner embed --images DIR_OR_GLOB`` (issue 28): files in sorted order, each record naming
its file, vectors equal to transformers' CLIP ``get_image_features`` of the seeded tiny folder
(scikit-image photographs); a file that is not an image stops the run naming it, or is skipped."""

from __future__ import annotations

import json

import numpy as np
import pytest

from poolrunner.core.cli.main import main

PHOTOS = ("coffee", "astronaut", "chelsea")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from poolrunner.core.testing.tiny_models import tiny_clip_folder

    return tiny_clip_folder(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory):
    import skimage.data
    from PIL import Image

    folder = tmp_path_factory.mktemp("photos")
    for name in PHOTOS:
        Image.fromarray(getattr(skimage.data, name)()).save(folder / f"{name}.png")
    return folder


def features(folder, paths) -> np.ndarray:
    import torch
    import transformers
    from PIL import Image

    model = transformers.CLIPModel.from_pretrained(folder).eval()
    processor = transformers.CLIPImageProcessor.from_pretrained(folder)
    with torch.inference_mode():
        out = model.get_image_features(**processor(images=[Image.open(p) for p in paths],
                                                   return_tensors="pt")).pooler_output
    return torch.nn.functional.normalize(out, dim=-1).numpy()


def embed(folder, pattern, output, *extra) -> int:
    return main(["embed", "--model", str(folder), "--dtype", "float32", "--no-entrypoints", "--images",
                 str(pattern), "--output", str(output), *extra])


def test_folder_and_glob_sorted_rows_name_their_files(folder, photo_dir, tmp_path):
    want_paths = sorted(photo_dir.glob("*.png"))
    want = features(folder, want_paths)
    for pattern in (photo_dir, photo_dir / "*.png"):
        output = tmp_path / "out.jsonl"
        assert embed(folder, pattern, output) == 0
        rows = [json.loads(line) for line in output.read_text().splitlines()]
        assert [row["file"] for row in rows] == [str(p) for p in want_paths]
        assert [row["index"] for row in rows] == [0, 1, 2]
        got = np.array([row["embedding"] for row in rows], dtype=np.float32)
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1)
        print(f"cli-images {pattern.name}: min cosine {cosine.min():.8f}")
        assert cosine.min() >= 0.9999


def test_a_broken_file_is_named_and_may_be_skipped(folder, photo_dir, tmp_path, capsys):
    (tmp_path / "a.png").write_bytes((photo_dir / "chelsea.png").read_bytes())
    (tmp_path / "b.png").write_bytes(b"not an image")
    output = tmp_path / "out.jsonl"
    assert embed(folder, tmp_path / "*.png", output) != 0
    assert f"{tmp_path / 'b.png'}: this input is not an image PIL can read (12 bytes" in capsys.readouterr().err
    assert embed(folder, tmp_path / "*.png", output, "--on-error", "skip") == 0
    assert [json.loads(line)["file"] for line in output.read_text().splitlines()] == [str(tmp_path / "a.png")]
    assert embed(folder, tmp_path / "*.jpg", output) != 0
    assert "no files found" in capsys.readouterr().err
    cut = tmp_path / "cut"
    cut.mkdir()
    encoded = (photo_dir / "chelsea.png").read_bytes()
    (cut / "c.png").write_bytes(encoded[: len(encoded) // 2])
    assert embed(folder, cut / "*.png", output) != 0
    assert f"{cut / 'c.png'}: the image data is truncated or corrupt" in capsys.readouterr().err


def test_image_column_of_parquet_bytes_and_jsonl_paths(folder, photo_dir, tmp_path):
    """``--input FILE --image-field FIELD``: Parquet bytes, JSON Lines paths; chunks larger than
    ``--max-images-per-request`` run in requests of that many."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = [photo_dir / f"{name}.png" for name in PHOTOS]
    want = features(folder, paths)
    pq.write_table(pa.table({"id": [10, 11, 12], "img": [p.read_bytes() for p in paths]}), tmp_path / "in.parquet")
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"img": str(p)}) + "\n" for p in paths))
    for source in ("in.parquet", "in.jsonl"):
        output = tmp_path / f"{source}.out.jsonl"
        assert main(["embed", "--model", str(folder), "--dtype", "float32", "--no-entrypoints", "--input",
                     str(tmp_path / source), "--image-field", "img", "--max-images-per-request", "2",
                     "--output", str(output)]) == 0
        rows = [json.loads(line) for line in output.read_text().splitlines()]
        got = np.array([row["embedding"] for row in rows], dtype=np.float32)
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1)
        print(f"cli-image-field {source}: min cosine {cosine.min():.8f}")
        assert cosine.min() >= 0.9999 and [row["index"] for row in rows] == [0, 1, 2]
        assert [row.get("id") for row in rows] == ([10, 11, 12] if source == "in.parquet" else [None] * 3)
