"""Distributed jobs on a local Ray cluster (``ray.init(num_cpus=2)``): Ray Data ``map_batches`` over
an actor pool of runtimes, over 300 real sentences (gensim's Lee background corpus).

Every row of the output must match the single-process :meth:`Runtime.embed` of the same text and
sentence-transformers' embedding (the independent reference), cosine >= 0.9999, under its own id
and row index, exactly once, even when an actor is killed mid-job; a rerun skips the files
already written.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from poolrunner.core import InvalidRequestError, hookimpl
from poolrunner.core.cli.main import main
from poolrunner.core.distributed import cluster
from poolrunner.core.distributed.actor import output_columns
from poolrunner.core.distributed.shards import list_shards
from poolrunner.core.errors import ModelLoadError
from poolrunner.distributed import JobConflictError, RayNotInstalledError, run_job
from tests.helpers import MIN_COSINE, cosine_rows

pytestmark = [
    pytest.mark.slow,
    # Ray Data's own DataContext() assigns its deprecated fields (use_push_based_shuffle,
    # use_polars) in __init__, warning on every first use; nothing poolrunner sets.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
]

NUM_SENTENCES = 300


class CrashOnce:
    """A plugin that kills its own process (a Ray actor) with SIGKILL when it admits its
    ``at_request``-th request, once per job: the first actor to get there creates ``marker``."""

    def __init__(self, marker: str, at_request: int) -> None:
        self.marker = marker
        self.at_request = at_request
        self.admitted = 0

    @hookimpl
    def add_request(self) -> None:
        self.admitted += 1
        if self.admitted != self.at_request:
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    import ray.cloudpickle

    cluster.init(None, num_cpus=2)  # as the CLI starts one
    # Actors cannot import this test module (pytest puts it on the driver's path only): ship
    # CrashOnce by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sentences(lee_path) -> list[str]:
    """The first 300 sentences of gensim's Lee background corpus (300 news documents)."""
    background = os.path.join(os.path.dirname(lee_path), "lee_background.cor")
    with open(background, encoding="cp1252") as handle:
        docs = [line.strip() for line in handle if line.strip()]
    found = [s for doc in docs for s in re.split(r"(?<=[.!?])\s+", doc) if s]
    return found[:NUM_SENTENCES]


@pytest.fixture(scope="module")
def single_process(runtime, sentences) -> np.ndarray:
    """The single-process run: ``Runtime.embed`` of every sentence, [300, 384] float32."""
    return runtime.embed(sentences)


def read_outputs(folder: Path) -> dict[str, pa.Table]:
    return {path.name: pq.read_table(path) for path in sorted(folder.glob("*.parquet"))}


def embeddings(table: pa.Table) -> np.ndarray:
    return np.stack(table.column("embedding").to_numpy(zero_copy_only=False))


def assert_matches(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    cosines = cosine_rows(actual, expected)
    assert cosines.min() >= MIN_COSINE, f"{what}: row {cosines.argmin()} has cosine {cosines.min()}"


def test_the_control_plane_of_a_cluster_poolrunner_starts_refuses_calls_without_its_token(ray_cluster) -> None:
    """Ray's GCS runs jobs for whoever can call it: a cluster the CLI starts must require the
    cluster's token (a call without it is UNAUTHENTICATED) and have no dashboard."""
    import grpc
    import ray
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    context = ray.get_runtime_context()
    gcs = context.gcs_address
    with grpc.insecure_channel(gcs) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=30)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not ray.worker.get_dashboard_url()


@pytest.mark.parametrize(("address", "environment", "options"), [
    (None, None, {"address": None, "include_dashboard": False}),
    ("local", None, {"address": None, "include_dashboard": False}),
    ("auto", None, {"address": "auto"}),
    ("ray://head:10001", None, {"address": "ray://head:10001"}),
    (None, "head:6379", {"address": None}),  # ray.init joins $RAY_ADDRESS's cluster
])
def test_ray_init_options(address, environment, options, monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if environment:
        monkeypatch.setenv("RAY_ADDRESS", environment)
    assert cluster.init_options(address) == options


def test_an_address_ray_cannot_read_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        cluster.init("nope-address")
    assert str(caught.value) == ("Ray address 'nope-address': Invalid address format: nope-address (expected "
                                 "HOST:PORT of a cluster's head, auto, or local)")


@pytest.mark.parametrize("form", ["{}", "ray://{}", "env"])
def test_an_address_nothing_listens_at_is_refused_at_once(form, monkeypatch) -> None:
    """Ray retries such an address for minutes; it is refused before ``ray.init``, naming it."""
    import time

    with socket.socket() as unused:  # a port of this machine that nothing listens at
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    named = address if form == "env" else form.format(address)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if form == "env":
        monkeypatch.setenv("RAY_ADDRESS", address)
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        cluster.init(None if form == "env" else named)
    assert time.monotonic() - start < cluster.CONNECT_S
    source, instead = ("$RAY_ADDRESS ", "unset RAY_ADDRESS") if form == "env" else ("", "leave the address out")
    assert (str(caught.value), caught.value.param) == (
        f"Ray address {source}{named!r}: nothing accepts a connection at {address} (Connection refused); start "
        f"the cluster's head there (`ray start --head --port {address.rpartition(':')[2]}`), or {instead} to "
        "start a cluster on this machine", "address")


def test_a_started_cluster_found_gone_is_not_asked_again(monkeypatch) -> None:
    """Each shutdown step asks whether the GCS still answers; once it did not, it is not asked
    (nor waited for) again, while a live one is asked every time."""
    import ray.exceptions
    from ray._private import ray_constants, worker

    class Node:
        all_processes = {ray_constants.PROCESS_TYPE_GCS_SERVER: ["gcs"]}

    class Gcs:
        asked, answers = 0, True

        def internal_kv_get(self, *args, **kwargs):
            Gcs.asked += 1
            if not Gcs.answers:
                raise ray.exceptions.RpcError("the GCS is gone")

    node = Node()
    monkeypatch.setattr(worker, "_global_node", node)
    monkeypatch.setattr(worker.global_worker, "gcs_client", Gcs(), raising=False)
    monkeypatch.setattr(cluster, "SETTLE_S", 0.0)
    assert [cluster.lost(), cluster.lost()] == [False, False] and Gcs.asked == 2
    Gcs.answers = False
    assert [cluster.lost(), cluster.lost()] == [True, True] and Gcs.asked == 3
    monkeypatch.setattr(worker, "_global_node", Node())  # another cluster started since
    assert cluster.lost() and Gcs.asked == 4


def test_bad_options_fail_before_any_work(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")
    with pytest.raises(InvalidRequestError, match=r"^unknown request_options: bogus \(known: "):
        run_job(str(tmp_path / "a.txt"), str(tmp_path / "out"), request_options={"bogus": 1})
    with pytest.raises(InvalidRequestError, match="^input '.*missing.jsonl' does not exist$"):
        run_job(str(tmp_path / "missing.jsonl"), str(tmp_path / "out"))
    with pytest.raises(InvalidRequestError, match=r"^lora 'nope' is not one of lora_modules \(--lora-modules\): none$"):
        run_job(str(tmp_path / "a.txt"), str(tmp_path / "out"), lora="nope")
    with pytest.raises(InvalidRequestError, match=r"^inputs mix formats \(jsonl: .*, text: .*\)"):
        (tmp_path / "b.jsonl").write_text('{"text": "two"}\n', encoding="utf-8")
        run_job(str(tmp_path), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_address_nothing_listens_at_fails_before_the_output_is_written(tmp_path, monkeypatch) -> None:
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as a new process: this one may hold a cluster
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")
    with socket.socket() as unused:  # a port of this machine that nothing listens at
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    with pytest.raises(InvalidRequestError, match=f"^Ray address '{address}': nothing accepts a connection"):
        run_job(str(tmp_path / "a.txt"), str(tmp_path / "out"), address=address)
    assert not (tmp_path / "out").exists()


def test_results_as_arrow_columns() -> None:
    """Equal [d] rows: fixed-size lists; ragged [k_i]: lists; [k_i, m]: lists of fixed-size rows;
    named outputs: a column each."""
    rng = np.random.default_rng(0)
    vectors = [rng.standard_normal(4).astype(np.float32) for _ in range(3)]
    ragged = [rng.standard_normal(k).astype(np.float32) for k in (2, 5, 1)]
    tokens = [rng.standard_normal((k, 3)).astype(np.float32) for k in (2, 4)]

    embed = output_columns("embed", vectors)["embedding"]
    assert embed.type == pa.list_(pa.float32(), 4) and embed.to_pylist() == [v.tolist() for v in vectors]
    column = output_columns("token_classify", ragged)["output"]
    assert column.type == pa.list_(pa.float32()) and column.to_pylist() == [v.tolist() for v in ragged]
    column = output_columns("token_embed", tokens)["output"]
    assert column.type == pa.list_(pa.list_(pa.float32(), 3)) and column.to_pylist() == [t.tolist() for t in tokens]
    named = output_columns("embed&token_classify", [{"embedding": v, "token_weights": r}
                                                      for v, r in zip(vectors, ragged, strict=True)])
    assert list(named) == ["embedding", "token_weights"]
    assert named["token_weights"].to_pylist() == [r.tolist() for r in ragged]


def test_output_names_are_deterministic_and_hidden_files_are_left_out(tmp_path) -> None:
    for folder in ("a", "b", "b/_tmp", "b/.cache"):
        (tmp_path / folder).mkdir()
    for name in ("a/x.txt", "b/x.txt", "b/_SUCCESS", "b/_tmp/y.txt", "b/.cache/z.txt", "b/.hidden.txt"):
        (tmp_path / name).write_text("one\n", encoding="utf-8")

    _, fmt, shards = list_shards(str(tmp_path))
    _, _, again = list_shards([str(tmp_path / "b"), str(tmp_path / "a" / "x.txt")])

    assert fmt == "text"
    assert [shard.path for shard in shards] == [str(tmp_path / "a/x.txt"), str(tmp_path / "b/x.txt")]
    names = [shard.output_name for shard in shards]
    assert all(re.fullmatch(r"x-[0-9a-f]{12}\.parquet", name) for name in names) and names[0] != names[1]
    assert sorted(shard.output_name for shard in again) == sorted(names)
    _, _, outside = list_shards(str(tmp_path), output=str(tmp_path / "b"))  # the output folder is no input
    assert [shard.path for shard in outside] == [str(tmp_path / "a/x.txt")]


def test_without_ray_the_flag_says_what_to_install(tmp_path, monkeypatch, capsys) -> None:
    for name in ("ray", "ray.data"):
        monkeypatch.setitem(sys.modules, name, None)  # `import ray.data` raises ImportError
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")

    code = main(["embed", "--ray", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out")])

    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert "poolrunner: error: distributed jobs need Ray Data and pyarrow" in err
    assert "install them with: pip install -e '.[ray]' (in the poolrunner checkout)" in err and "Traceback" not in err
    with pytest.raises(RayNotInstalledError):
        run_job(str(tmp_path / "a.txt"), str(tmp_path / "out"))


def test_jsonl_job_matches_single_process_with_an_actor_killed_mid_job(
    ray_cluster, tmp_path, sentences, single_process, st_model
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    for part in range(6):  # 6 files of 50 rows: ids lee-<sentence index>
        lines = [json.dumps({"id": f"lee-{i}", "text": sentences[i]}) for i in range(part * 50, part * 50 + 50)]
        (inputs / f"part{part}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    marker = tmp_path / "killed"

    # Each actor admits about 150 requests; the first to admit its 40th (in its third batch of 16)
    # dies with SIGKILL. Ray restarts it and retries the batch.
    result = run_job(str(inputs), str(tmp_path / "out"), num_actors=2, num_cpus_per_actor=1, batch_size=16,
                     runtime_options={"plugins": [CrashOnce(str(marker), at_request=40)], "dtype": "float32"})

    assert marker.exists(), "no actor was killed"
    outputs = read_outputs(tmp_path / "out")
    assert sorted(result.written) == sorted(outputs) and len(outputs) == 6
    assert result.skipped == () and result.num_rows == NUM_SENTENCES
    ids, vectors = [], []
    for name, table in outputs.items():
        part = int(name.removeprefix("part")[0])
        assert table.column_names == ["row", "id", "embedding"]
        assert table.column("row").to_pylist() == list(range(50))
        assert table.column("id").to_pylist() == [f"lee-{i}" for i in range(part * 50, part * 50 + 50)]
        ids += table.column("id").to_pylist()
        vectors.append(embeddings(table))
    assert sorted(ids, key=lambda i: int(i[4:])) == [f"lee-{i}" for i in range(NUM_SENTENCES)]  # none lost, none twice
    by_id = np.concatenate(vectors)[np.argsort([int(i[4:]) for i in ids])]
    assert by_id.dtype == np.float32 and by_id.shape == (NUM_SENTENCES, 384)
    assert_matches(by_id, single_process, "single process")
    reference = st_model.encode(sentences, convert_to_numpy=True, batch_size=64)
    assert_matches(by_id, reference, "sentence-transformers")


def test_rerun_skips_written_files_and_refuses_other_settings(
    ray_cluster, tmp_path, capsys, sentences, single_process
) -> None:
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    for part in range(3):  # Parquet, own id and text columns
        rows = range(part * 20, part * 20 + 20)
        pq.write_table(pa.table({"doc_id": pa.array(rows, pa.int64()), "body": [sentences[i] for i in rows],
                                 "extra": [1.5] * 20}), inputs / f"chunk{part}.parquet")
    options = {"text_field": "body", "id_field": "doc_id", "batch_size": 8, "runtime_options": {"dtype": "float32"}}
    first = run_job(str(inputs), str(out), **options)
    assert len(first.written) == 3 and first.num_rows == 60
    kept = {name: (out / name).stat().st_mtime_ns for name in first.written[1:]}
    (out / first.written[0]).unlink()
    capsys.readouterr()

    # The same job through the command line (its options spelled out) resumes it.
    code = main(["embed", "--ray", "--input", str(inputs), "--output", str(out), "--text-field", "body",
                 "--id-field", "doc_id", "--rows-per-batch", "8", "--dtype", "float32"])

    assert code == 0
    assert "wrote 1 files (20 rows" in capsys.readouterr().err
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # not rewritten
    assert sorted(read_outputs(out)) == sorted(first.written)
    for table in read_outputs(out).values():
        assert table.column_names == ["row", "doc_id", "embedding"]
        doc_ids = table.column("doc_id").to_pylist()
        assert table.column("row").to_pylist() == [i - doc_ids[0] for i in doc_ids]
        assert_matches(embeddings(table), single_process[doc_ids], f"doc_ids {doc_ids[0]}..")
    third = run_job(str(inputs), str(out), **options)
    assert (third.written, sorted(third.skipped), third.num_rows) == ((), sorted(first.written), 0)
    with pytest.raises(JobConflictError, match=r"other settings \(request_options differs: recorded request_options="
                                               r"\{\}, this run request_options=\{'normalize': False\}\)"):
        run_job(str(inputs), str(out), **options, request_options={"normalize": False})


def test_cli_embed_ray_text_files(ray_cluster, tmp_path, capsys, runtime, sentences, single_process) -> None:
    inputs, out = tmp_path / "texts", tmp_path / "vectors"
    inputs.mkdir()
    lines = {"a.txt": sentences[:12], "b.txt": [*sentences[12:20], "", *sentences[20:25]]}  # an empty line is a row
    for name, texts in lines.items():
        (inputs / name).write_text("\n".join(texts) + "\n", encoding="utf-8")

    code = main(["embed", "--ray", "--input", str(inputs), "--output", str(out), "--rows-per-batch", "8",
                 "--dtype", "float32"])

    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "wrote 2 files (26 rows" in captured.err
    tables = read_outputs(out)
    assert [name.split("-")[0] for name in tables] == ["a", "b"]
    for (name, table), texts in zip(tables.items(), lines.values(), strict=True):
        assert table.column_names == ["row", "embedding"]
        assert table.column("row").to_pylist() == list(range(len(texts)))
        assert_matches(embeddings(table), runtime.embed(texts), name)
    assert_matches(embeddings(tables[next(iter(tables))]), single_process[:12], "a.txt against the 300-row run")


def actor_output(path: str, rows: list[int | None], errors: list[str | None]) -> pa.Table:
    """A batch as the actors return it: each row's file, row, problem (``None``: good) and vector."""
    vectors = [None if error else [float(row)] for row, error in zip(rows, errors, strict=True)]
    return pa.table({"_path": [path] * len(rows), "row": pa.array(rows, pa.int64()),
                     "_error": pa.array(errors, pa.string()),
                     "embedding": pa.array(vectors, pa.list_(pa.float32(), 1))})


def test_the_writer_fails_a_file_on_its_fatal_row_and_leaves_skipped_rows_out(tmp_path) -> None:
    from pyarrow import fs

    from poolrunner.core.distributed.job import _ShardWriter
    from poolrunner.core.distributed.shards import Shard

    shards = [Shard(f"/in/{name}.jsonl", f"{name}-0.parquet") for name in "abcd"]
    writer = _ShardWriter(fs.LocalFileSystem(), str(tmp_path), shards)
    writer.write(actor_output("/in/a.jsonl", [0, 1, 2], [None, "/in/a.jsonl:2: bad", None]))
    writer.write(actor_output("/in/b.jsonl", [0, 1], [None, None]))  # b's temporary file is open...
    assert any(path.name.startswith(".b-0.parquet.") for path in tmp_path.iterdir())
    writer.write(actor_output("/in/b.jsonl", [None, 3], ["/in/b.jsonl:3: invalid JSON", None]))  # ...and goes
    writer.write(actor_output("/in/c.jsonl", [0], ["/in/c.jsonl:1: bad too"]))  # every row left out
    writer.finish()

    assert writer.failed == {"/in/b.jsonl": "/in/b.jsonl:3: invalid JSON"}
    assert (writer.rows_left_out, writer.left_out) == (2, ["/in/a.jsonl:2: bad", "/in/c.jsonl:1: bad too"])
    assert writer.written == ["a-0.parquet", "c-0.parquet", "d-0.parquet"]  # c and d: empty outputs
    assert sorted(path.name for path in tmp_path.iterdir()) == writer.written  # no temporary file left
    table = pq.read_table(tmp_path / "a-0.parquet")
    assert table.column_names == ["row", "embedding"] and table.column("row").to_pylist() == [0, 2]
    assert pq.read_table(tmp_path / "c-0.parquet").num_rows == 0

    interrupted = _ShardWriter(fs.LocalFileSystem(), str(tmp_path / "x"), shards)
    (tmp_path / "x").mkdir()
    interrupted.write(actor_output("/in/a.jsonl", [0], [None]))
    interrupted.abort()  # what Ctrl-C or a failure does
    assert list((tmp_path / "x").iterdir()) == []


def test_a_bad_row_fails_its_file_only_or_is_left_out(ray_cluster, tmp_path, capsys, runtime) -> None:
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    texts = {"a": ["one", "two"], "b": ["three", None, "four"], "c": ["five", "six"]}
    for name, rows in texts.items():
        lines = [json.dumps({"text": text}) if text else '{"text": oops}' for text in rows]
        (inputs / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    options = {"num_actors": 1, "batch_size": 4, "runtime_options": {"dtype": "float32"}}
    bad_row = f"{inputs / 'b.jsonl'}:2: invalid JSON: Expecting value (column 10)"

    with pytest.raises(InvalidRequestError) as raised:
        run_job(str(inputs), str(out), **options)

    assert str(raised.value) == (
        "1 of 3 input files failed and were not written (the other 2 were; rerun to resume once they are fixed, "
        f"or pass on_error='skip' / --on-error skip): {bad_row}")
    tables = read_outputs(out)
    assert [name.split("-")[0] for name in tables] == ["a", "c"]
    assert sorted(path.name for path in out.iterdir()) == sorted([*tables, "_poolrunner_job.json"])  # no temp file
    for table, name in zip(tables.values(), "ac", strict=True):
        assert_matches(embeddings(table), runtime.embed(texts[name]), name)

    result = run_job(str(inputs), str(out), **options, on_error="skip")  # the rerun writes b, its bad row left out

    assert (len(result.written), len(result.skipped), result.num_rows) == (1, 2, 2)
    assert (result.rows_left_out, result.left_out) == (1, (bad_row,))
    table = read_outputs(out)[result.written[0]]
    assert table.column("row").to_pylist() == [0, 2]
    assert_matches(embeddings(table), runtime.embed(["three", "four"]), "b")

    # A text the model refuses fails its file too, reported on one line by the command line.
    long_inputs = tmp_path / "texts"
    long_inputs.mkdir()
    (long_inputs / "x.txt").write_text("fine\n", encoding="utf-8")
    (long_inputs / "y.txt").write_text("short\n" + " ".join(f"word{i} is here" for i in range(150)) + "\n",
                                       encoding="utf-8")
    code = main(["embed", "--ray", "--input", str(long_inputs), "--output", str(tmp_path / "v"), "--dtype",
                 "float32"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    [line] = [line for line in captured.err.splitlines() if line.startswith("poolrunner: error:")]
    assert line.startswith("poolrunner: error: 1 of 2 input files failed and were not written (the other 1 were; ")
    assert re.search(rf"{re.escape(str(long_inputs / 'y.txt'))}:2: this input has \d+ tokens, more than the maximum "
                     "of 256", line)
    assert "Traceback" not in captured.err


def test_a_failure_of_ray_itself_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    from ray.exceptions import RayTaskError

    import poolrunner.core.distributed

    def lost_worker(*args: object, **kwargs: object) -> None:
        cause = OSError("the node died\nand more lines")
        raise RayTaskError("MapBatches(RuntimeActor)", "Traceback (most recent call last):\n  ...", cause)

    monkeypatch.setattr(poolrunner.core.distributed, "run_job", lost_worker)
    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")

    code = main(["embed", "--ray", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "out")])

    assert (code, capsys.readouterr().err) == (2, "poolrunner: error: the Ray job failed: OSError: the node died\n"
                                                  "poolrunner: hint: Ray's own logs are in "
                                                  "/tmp/ray/session_latest/logs on each node\n")


def test_a_model_that_cannot_load_fails_the_job_in_one_line(ray_cluster, tmp_path, capsys) -> None:
    """A folder that cannot be read is refused by the driver before Ray starts; one whose weights
    the actors cannot load fails the job with the actors' ModelLoadError, not Ray's report of
    their death (a traceback of ~300 lines)."""
    from poolrunner.core.testing.tiny_models import tiny_model_folder

    (tmp_path / "a.txt").write_text("one\n", encoding="utf-8")
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelLoadError, match=f"^model '{re.escape(str(missing))}' is not a local model folder"):
        run_job(str(tmp_path / "a.txt"), str(tmp_path / "api"), model=str(missing))
    assert not (tmp_path / "api").exists()
    no_weights = tiny_model_folder(tmp_path / "base", "bert", "model")
    (no_weights / "model.safetensors").unlink()
    code = main(["embed", "--ray", "--model", str(no_weights), "--input", str(tmp_path / "a.txt"), "--output",
                 str(tmp_path / "cli")])
    lines = capsys.readouterr().err.splitlines()
    assert code != 0 and lines[-1].startswith(f"poolrunner: error: cannot load the weights of {no_weights} as "
                                              "BertModel"), lines[-3:]


# PEFT 0.21 reads transformers' deprecated is_gradient_checkpointing: the reference's warning, not ours.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_job_rows_equal_peft(ray_cluster, tmp_path) -> None:
    """``run_job(lora_modules=, lora=)`` and ``embed --ray --lora-modules --lora``: every row is
    PEFT's embedding with the adapter active."""
    pytest.importorskip("peft")  # the test extra installs it; a missing reference is not a pass
    from peft import LoraConfig

    from poolrunner.core.testing.tiny_models import tiny_model_folder
    from tests.test_lora import make_adapter, normalized, peft_hidden

    base = tiny_model_folder(tmp_path / "base", "bert", "model")
    adapter = make_adapter(base, tmp_path / "a", LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"]))
    texts = ["w1 w2 w3", "w7 w8", "w10 w11 w12 w13"]
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "t.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    expected = np.stack([normalized(out.last_hidden_state[0, 0]) for out in peft_hidden(base, adapter, texts)])
    run_job(str(inputs), str(tmp_path / "api"), model=str(base), runtime_options={"dtype": "float32"},
            lora_modules={"a": str(adapter)}, lora="a")
    assert main(["embed", "--ray", "--model", str(base), "--dtype", "float32", "--lora-modules", f"a={adapter}",
                 "--lora", "a", "--input", str(inputs), "--output", str(tmp_path / "cli")]) == 0
    for out in ("api", "cli"):
        [table] = read_outputs(tmp_path / out).values()
        np.testing.assert_allclose(embeddings(table), expected, atol=1e-4, err_msg=out)
