"""Models by Hugging Face hub id, from the local Hugging Face cache only (issue 13).

The cache here is built by hand in the layout huggingface_hub writes (``models--ORG--NAME/``
with ``refs/<revision>`` holding a commit hash, ``blobs/<hash>`` holding the bytes and
``snapshots/<commit>/<file>`` relative symlinks to the blobs), from the default model's files.
The reference for "resolves as sentence-transformers does" is sentence-transformers itself,
loading the same hub id from the same cache with ``local_files_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import poolrunner
from poolrunner.core.cli.main import main
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.model import metadata
from tests.helpers import MIN_COSINE, cosine_rows

pytestmark = pytest.mark.slow

REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"
MAIN_COMMIT = "a" * 40
SHORT_COMMIT = "b" * 40
SHORT_REF = "short-context"  # a second ref: the same weights with max_seq_length 128
TEXTS = ["A man is playing a guitar.", "The new movie is awesome.", "A cat sits outside, watching the rain."]
NOT_A_FOLDER = ("is not a local model folder with a config.json; poolrunner loads only local folders and never "
                "downloads from a model hub")


def _add_snapshot(repo: Path, source: Path, commit: str, ref: str, overrides: dict[str, bytes]) -> Path:
    """``snapshots/<commit>/`` with every file of ``source`` (``overrides``: other bytes for some
    files) as relative symlinks into ``blobs/``, and ``refs/<ref>`` naming ``commit``."""
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        relative = file.relative_to(source)
        data = overrides.get(relative.as_posix()) or file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # huggingface_hub writes no newline
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, model_path) -> Path:
    """``HF_HOME`` whose ``hub/`` cache holds ``REPO_ID`` at ``main`` and at ``SHORT_REF``."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    _add_snapshot(repo, model_path, MAIN_COMMIT, "main", {})
    st_config = json.loads((model_path / "sentence_bert_config.json").read_text(encoding="utf-8"))
    short = json.dumps({**st_config, "max_seq_length": 128}).encode()
    _add_snapshot(repo, model_path, SHORT_COMMIT, SHORT_REF, {"sentence_bert_config.json": short})
    return home


@pytest.fixture(scope="module")
def hub_cache(hf_home) -> Path:
    return hf_home / "hub"


def _snapshot(hub_cache: Path, commit: str) -> Path:
    return hub_cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / commit


@pytest.fixture
def in_cache(monkeypatch, hub_cache) -> Path:
    """``HF_HUB_CACHE`` set to the fake cache (after huggingface_hub was imported)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    return hub_cache


class NetworkUsed(AssertionError):
    pass


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any name lookup or outgoing connection fails the test; huggingface_hub's own offline switch
    (frozen at import; the test suite's conftest sets HF_HUB_OFFLINE=1) is turned off, so only
    poolrunner's ``local_files_only=True`` keeps it off the network."""
    import huggingface_hub.constants

    def refuse(*args: object, **kwargs: object) -> None:
        raise NetworkUsed(f"network access attempted: {args!r:.200}")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


@pytest.fixture(scope="module")
def hub_runtime(hub_cache) -> Iterator[poolrunner.Runtime]:
    """``Runtime(REPO_ID)`` loaded from the fake cache with every network path refused."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(hub_cache))
        _no_network(patch)
        runtime = poolrunner.Runtime(REPO_ID, dtype="float32")
    yield runtime


# --------------------------------------------------------------------------- loading by hub id


def test_hub_id_embeds_exactly_like_the_local_folder(hub_runtime, hub_cache, runtime, model_path):
    assert hub_runtime.model_config.path == str(_snapshot(hub_cache, MAIN_COMMIT))
    assert hub_runtime.config.model == REPO_ID and hub_runtime.config.revision is None
    local = poolrunner.Runtime(str(model_path), dtype="float32")
    vectors = hub_runtime.embed(TEXTS)
    assert vectors.shape == (3, 384) and vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors, local.embed(TEXTS))
    np.testing.assert_array_equal(vectors, runtime.embed(TEXTS))  # the default model, same weights


def test_hub_id_matches_sentence_transformers_from_the_same_cache(hub_runtime, hub_cache, monkeypatch):
    from sentence_transformers import SentenceTransformer

    # The reference loads under the suite's HF_HUB_OFFLINE=1: with peft installed, transformers
    # looks for an adapter of a hub id on the network whatever local_files_only says.
    reference = SentenceTransformer(REPO_ID, cache_folder=str(hub_cache), local_files_only=True, device="cpu")
    _no_network(monkeypatch)
    assert reference.max_seq_length == hub_runtime.model_config.max_model_len == 256
    assert (cosine_rows(hub_runtime.embed(TEXTS), reference.encode(TEXTS)) >= MIN_COSINE).all()


def test_hf_home_is_read_at_call_time(monkeypatch, hf_home):
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    assert metadata.hub_cache_dir() == hf_home / "hub"
    assert metadata.resolve_model_path(REPO_ID) == _snapshot(hf_home / "hub", MAIN_COMMIT)
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub.
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "elsewhere"))
    assert metadata.hub_cache_dir() == hf_home / "elsewhere"
    with pytest.raises(ModelLoadError, match="is not in the local cache"):
        metadata.resolve_model_path(REPO_ID)


def test_revision_names_another_snapshot(in_cache, monkeypatch, hub_runtime):
    _no_network(monkeypatch)
    short = poolrunner.Runtime(REPO_ID, revision=SHORT_REF, dtype="float32")
    assert short.config.revision == SHORT_REF
    assert short.model_config.path == str(_snapshot(in_cache, SHORT_COMMIT))
    assert short.model_config.max_model_len == 128  # that snapshot's sentence_bert_config.json
    np.testing.assert_array_equal(short.embed(TEXTS), hub_runtime.embed(TEXTS))  # same weights
    # A commit hash is a revision too, and "main" is the default.
    assert metadata.resolve_model_path(REPO_ID, SHORT_COMMIT) == _snapshot(in_cache, SHORT_COMMIT)
    assert metadata.resolve_model_path(REPO_ID, "main") == _snapshot(in_cache, MAIN_COMMIT)


# --------------------------------------------------------------------------- errors and precedence


def test_missing_hub_id_names_the_id_and_the_cache(in_cache, monkeypatch):
    _no_network(monkeypatch)
    with pytest.raises(ModelLoadError) as excinfo:
        poolrunner.Runtime("someone/not-cached", dtype="float32")
    assert str(excinfo.value) == (
        f"model 'someone/not-cached' is not a local model folder, and the Hugging Face hub id "
        f"'someone/not-cached' is not in the local cache {str(in_cache)!r}; poolrunner never downloads "
        "from a model hub: download it first (`hf download someone/not-cached`, or `huggingface-cli download "
        "someone/not-cached`) or copy the model folder to this machine and pass its path"
    )


def test_a_bare_name_is_completed_as_sentence_transformers_completes_it(in_cache, monkeypatch, hub_runtime):
    """``all-MiniLM-L6-v2`` is ``sentence-transformers/all-MiniLM-L6-v2``, as SentenceTransformer
    reads it (the default organizations of its three model classes)."""
    from sentence_transformers import SentenceTransformer

    bare = REPO_ID.split("/")[1]
    reference = SentenceTransformer(bare, cache_folder=str(in_cache), local_files_only=True, device="cpu")
    _no_network(monkeypatch)
    runtime = poolrunner.Runtime(bare, dtype="float32")
    assert runtime.model_config.path == str(_snapshot(in_cache, MAIN_COMMIT))
    assert (cosine_rows(runtime.embed(TEXTS), reference.encode(TEXTS)) >= MIN_COSINE).all()
    with pytest.raises(ModelLoadError) as excinfo:
        metadata.resolve_model_path("not-cached-anywhere")
    assert str(excinfo.value) == (
        f"model 'not-cached-anywhere' is not a local model folder, and the Hugging Face hub id 'not-cached-anywhere' "
        f"is not in the local cache {str(in_cache)!r}, nor are 'sentence-transformers/not-cached-anywhere', "
        "'cross-encoder/not-cached-anywhere', 'sparse-encoder/not-cached-anywhere', where sentence-transformers "
        "looks a bare name up; poolrunner never downloads from a model hub: download it first (`hf download "
        "ORG/not-cached-anywhere`, or `huggingface-cli download ORG/not-cached-anywhere`) or copy the model folder "
        "to this machine and pass its path"
    )


def test_a_bare_name_held_by_two_organizations_is_refused(tmp_path, monkeypatch, model_path):
    """SentenceTransformer would take sentence-transformers/NAME and CrossEncoder cross-encoder/NAME:
    a folder does not say which class loads it. An interrupted download's empty folder counts
    for nothing; a name no organization holds is the bare id itself (a legacy id)."""
    cache = tmp_path / "hub"
    for repo_id in ("sentence-transformers/both", "cross-encoder/both", "cross-encoder/one", "legacy"):
        _add_snapshot(cache / ("models--" + repo_id.replace("/", "--")), model_path, MAIN_COMMIT, "main", {})
    (cache / "models--sentence-transformers--one" / "blobs").mkdir(parents=True)  # a download cut short
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    _no_network(monkeypatch)
    with pytest.raises(ModelLoadError) as excinfo:
        metadata.resolve_model_path("both")
    assert str(excinfo.value) == (
        "model 'both' is a bare name, and the local cache holds it as 'sentence-transformers/both' and "
        "'cross-encoder/both': sentence-transformers completes a bare name by the class that loads it "
        "(SentenceTransformer, CrossEncoder, SparseEncoder); pass the full id of the one to load")
    assert metadata.resolve_model_path("one") == cache / "models--cross-encoder--one" / "snapshots" / MAIN_COMMIT
    assert metadata.resolve_model_path("legacy") == cache / "models--legacy" / "snapshots" / MAIN_COMMIT


def test_missing_revision_names_the_revision(in_cache, monkeypatch):
    _no_network(monkeypatch)
    with pytest.raises(ModelLoadError) as excinfo:
        metadata.resolve_model_path(REPO_ID, "v9")
    assert str(excinfo.value) == (
        f"model {REPO_ID!r} is not a local model folder, and the Hugging Face hub id {REPO_ID!r} at revision "
        f"'v9' is not in the local cache {str(in_cache)!r}; poolrunner never downloads from a model hub: "
        f"download it first (`hf download {REPO_ID} --revision v9`, or `huggingface-cli download {REPO_ID} "
        "--revision v9`) or copy the model folder to this machine and pass its path"
    )


def test_a_local_folder_wins_over_the_hub_id(in_cache, tmp_path, monkeypatch, model_path):
    folder = tmp_path / REPO_ID
    folder.mkdir(parents=True)
    (folder / "config.json").write_bytes((model_path / "config.json").read_bytes())
    monkeypatch.chdir(tmp_path)
    assert metadata.resolve_model_path(REPO_ID) == Path(REPO_ID)
    with pytest.raises(ModelLoadError, match=rf"^revision 'main' applies to a Hugging Face hub id, but "
                                             rf"'{REPO_ID}' is a local model folder"):
        metadata.resolve_model_path(REPO_ID, "main")
    # The same spelling without a config.json is a folder, not a hub id: the folder error.
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=rf"^model '{REPO_ID}' {NOT_A_FOLDER}$"):
        metadata.resolve_model_path(REPO_ID)


@pytest.mark.parametrize("spelling", [f"./{REPO_ID}", f"~/{REPO_ID}", f"/{REPO_ID}", f"../{REPO_ID}"])
def test_a_path_spelling_is_never_a_hub_id(in_cache, spelling):
    with pytest.raises(ModelLoadError, match=rf"^model '{spelling}' {NOT_A_FOLDER}$"):
        metadata.resolve_model_path(spelling)


def test_an_invalid_hub_id_is_a_folder_error(in_cache):
    with pytest.raises(ModelLoadError, match=r"^model 'a/b/c' is not a local model folder with a config\.json, "
                                             r"nor a valid Hugging Face hub id \(.*never downloads"):
        metadata.resolve_model_path("a/b/c")


def test_revision_without_a_hub_id():
    with pytest.raises(ModelLoadError, match=r"^revision 'main' applies to a Hugging Face hub id; the default "
                                             r"model has none$"):
        poolrunner.Runtime(revision="main")


# --------------------------------------------------------------------------- command line


def test_cli_embed_by_hub_id(hub_cache, hub_runtime, tmp_path):
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache)}
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "POOLRUNNER_DISABLE_PLUGINS"):
        env.pop(name, None)
    output = tmp_path / "out.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "poolrunner", "embed", "--model", REPO_ID, "--dtype", "float32",
         "--output", str(output), *TEXTS],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    vectors = np.array([json.loads(line)["embedding"] for line in output.read_text().splitlines()])
    np.testing.assert_allclose(vectors, hub_runtime.embed(TEXTS), rtol=0, atol=1e-6)


@pytest.mark.parametrize("command", ["serve", "embed"])
def test_cli_revision_reaches_the_runtime(in_cache, capsys, command):
    argv = [command, "--model", REPO_ID, "--revision", "v9", "--dtype", "float32"]
    code = main([*argv, "some text"] if command == "embed" else argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert f"poolrunner: error: model {REPO_ID!r} is not a local model folder, and the Hugging Face hub id " \
           f"{REPO_ID!r} at revision 'v9' is not in the local cache {str(in_cache)!r}" in err
    assert "Traceback" not in err
