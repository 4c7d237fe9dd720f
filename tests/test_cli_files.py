"""Files in and out of the command line (:mod:`poolrunner.core.files`): every input format (text,
JSON Lines, CSV with a header, Parquet) into every output format (JSON Lines, CSV, Parquet,
.npy), ids, bad records (named by line, or skipped and counted), and memory that stays flat with
the input's size.

Outputs are read back independently (json, csv, numpy, pyarrow) and their vectors compared with
``Runtime.embed`` of the same texts in one call on a tiny random BERT (the file plumbing is what
is under test; the model's parity is tested elsewhere).
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import attrs
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from poolrunner.core import InvalidRequestError
from poolrunner.core.cli.main import build_parser, main
from poolrunner.core.files import Fields, read_chunks

pytestmark = pytest.mark.slow

TEXTS = ["A cat sat on the mat.", "Pooling, with commas, \"quotes\" and é ü 中文.", "", "Hello, world!",
         "  spaces kept  ", "the last text"]
IDS = ["doc-0", "doc-1", "doc-2", "007", "doc-4", "doc-5"]
SUFFIXES = {"text": ".txt", "jsonl": ".jsonl", "csv": ".csv", "parquet": ".parquet", "npy": ".npy"}


@pytest.fixture(scope="module")
def tiny(poolrunner_tiny_model) -> str:
    return str(poolrunner_tiny_model())


@pytest.fixture(scope="module")
def tiny_runtime(tiny):
    import poolrunner

    return poolrunner.Runtime(tiny, dtype="float32", load_entrypoints=False)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([argv[0], "--dtype", "float32", "--no-entrypoints", *argv[1:]])
    out, err = capsys.readouterr()
    return code, out, err


def write_input(path: Path, fmt: str, texts: list[str], ids: list[str] | None = None) -> Path:
    """``texts`` (and ``ids``) as ``fmt``: the text under ``body``, the id under ``doc_id``."""
    rows = [{"doc_id": i, "body": t} if ids else {"body": t} for i, t in zip(ids or texts, texts, strict=True)]
    if fmt == "text":
        path.write_text("".join(text + "\n" for text in texts), encoding="utf-8")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    elif fmt == "csv":
        with path.open("w", encoding="utf-8", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def read_output(path: Path, fmt: str) -> tuple[list[int], list[str] | None, np.ndarray]:
    """``(index, ids, vectors)`` of an embed output, read without poolrunner."""
    if fmt == "npy":
        return list(range(len(np.load(path)))), None, np.load(path)
    if fmt == "parquet":
        table = pq.read_table(path)
        assert table.schema.field("embedding").type == pa.list_(pa.float32(), 32)
        ids = table.column("doc_id").to_pylist() if "doc_id" in table.column_names else None
        return table.column("index").to_pylist(), ids, np.array(table.column("embedding").to_pylist(), np.float32)
    if fmt == "csv":
        with path.open(encoding="utf-8", newline="") as file:
            records = list(csv.DictReader(file))
        vectors = np.array([json.loads(record["embedding"]) for record in records], np.float32)
        ids = [record["doc_id"] for record in records] if "doc_id" in records[0] else None
        return [int(record["index"]) for record in records], ids, vectors
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    ids = [record["doc_id"] for record in records] if "doc_id" in records[0] else None
    return [record["index"] for record in records], ids, np.array([r["embedding"] for r in records], np.float32)


@pytest.mark.parametrize("output_format", ["jsonl", "csv", "parquet", "npy"])
@pytest.mark.parametrize("input_format", ["text", "jsonl", "csv", "parquet"])
def test_every_input_format_into_every_output_format(capsys, tmp_path, tiny, tiny_runtime, input_format,
                                                     output_format) -> None:
    with_ids = input_format != "text" and output_format != "npy"
    source = write_input(tmp_path / f"in{SUFFIXES[input_format]}", input_format, TEXTS, IDS if with_ids else None)
    target = tmp_path / f"out{SUFFIXES[output_format]}"
    fields = ["--text-field", "body"] + (["--id-field", "doc_id"] if with_ids else [])
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), *fields, "-o", str(target))
    assert code == 0, err
    assert out == "" and err == f"poolrunner: loading {tiny}...\npoolrunner: running in float32 on cpu\n"
    index, ids, vectors = read_output(target, output_format)
    assert index == list(range(len(TEXTS)))
    assert ids == (IDS if with_ids else None)  # "007" stays a string, from CSV too
    assert vectors.dtype == np.float32 and vectors.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(vectors, tiny_runtime.embed(TEXTS), rtol=0, atol=1e-6)
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([source.name, target.name])


def test_csv_header_quotes_newlines_and_the_format_flags(capsys, tmp_path, tiny, tiny_runtime) -> None:
    texts = ['a "quoted", comma text', "two\nlines in one field", "plain"]
    source = tmp_path / "docs.data"  # no suffix poolrunner knows: --input-format says csv
    source.write_text('id,body,extra\n1,"a ""quoted"", comma text",x\n\n2,"two\nlines in one field",y\n3,plain,z\n',
                      encoding="utf-8")
    target = tmp_path / "vectors.txt"  # nor here: --output-format says jsonl
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "--input-format", "csv",
                       "--text-field", "body", "--id-field", "id", "-o", str(target), "--output-format", "jsonl")
    assert code == 0, err
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [(r["index"], r["id"]) for r in records] == [(0, "1"), (1, "2"), (2, "3")]  # the blank line is no row
    np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(texts), rtol=0, atol=1e-6)


@pytest.mark.parametrize("input_format", ["jsonl", "csv", "parquet"])
def test_an_id_field_is_copied_without_id_field(capsys, tmp_path, tiny, tiny_runtime, input_format) -> None:
    """``id`` is the default id field, as in Ray jobs: copied where the input has it (embed, and
    rerank, which writes its own columns), no error and no column where it has none."""
    rows = [{"text": text, "id": f"doc-{i}"} for i, text in enumerate(TEXTS[:3])]
    source = tmp_path / f"docs{SUFFIXES[input_format]}"
    if input_format == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), source)
    elif input_format == "csv":
        with source.open("w", encoding="utf-8", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=["text", "id"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    target = tmp_path / "vectors.jsonl"
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "-o", str(target))
    assert code == 0, err
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [(r["index"], r["id"]) for r in records] == [(0, "doc-0"), (1, "doc-1"), (2, "doc-2")]
    np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(TEXTS[:3]), atol=1e-6)

    ranked = tmp_path / "ranked.jsonl"
    code, _, err = cli(capsys, "rerank", "--model", tiny, "--query", "a cat", "--input", str(source), "-o", str(ranked))
    assert code == 0, err
    records = [json.loads(line) for line in ranked.read_text(encoding="utf-8").splitlines()]
    assert sorted((r["index"], r["id"]) for r in records) == [(0, "doc-0"), (1, "doc-1"), (2, "doc-2")]

    without = write_input(tmp_path / f"plain{SUFFIXES[input_format]}", input_format, TEXTS[:2])  # "body" only
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(without), "--text-field", "body",
                       "-o", str(target))
    assert code == 0, err
    assert [sorted(json.loads(line)) for line in target.read_text(encoding="utf-8").splitlines()] == [
        ["embedding", "index"]] * 2


def test_default_ids_may_be_missing_or_null_but_not_of_two_types(capsys, tmp_path, tiny, tiny_runtime) -> None:
    """Copied because the file has them, ``id`` s are never asked for: a record without one, or
    with ``null``, has a null id; ids of two types are an error that says what to do."""
    source = tmp_path / "docs.jsonl"
    rows = [{"text": TEXTS[0], "id": "doc-0"}, {"text": TEXTS[1]}, {"text": TEXTS[2], "id": None}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    target = tmp_path / "vectors.jsonl"
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "-o", str(target))
    assert code == 0, err
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [(r["index"], r["id"]) for r in records] == [(0, "doc-0"), (1, None), (2, None)]
    np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(TEXTS[:3]), atol=1e-6)

    source.write_text(json.dumps({"text": TEXTS[0], "id": "a"}) + "\n" + json.dumps({"text": TEXTS[1], "id": 2}) + "\n",
                      encoding="utf-8")
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "-o", str(target))
    assert code == 2
    assert (f"{source}:2: field 'id' is int, but the ids before it are str (ids are copied from 'id' because the "
            "file has it); give every id one type, or name another field with --id-field") in err


def test_a_null_id_of_a_named_id_field_is_written_as_null_as_parquet_writes_it(capsys, tmp_path, tiny,
                                                                               tiny_runtime) -> None:
    rows = [{"text": TEXTS[0], "doc": 7}, {"text": TEXTS[1], "doc": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "docs.parquet")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    for name in ("docs.parquet", "docs.jsonl"):
        target = tmp_path / f"{name}.out.jsonl"
        code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(tmp_path / name), "--id-field", "doc",
                           "-o", str(target))
        assert code == 0, err
        records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
        assert [r["doc"] for r in records] == [7, None], name
        np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(TEXTS[:2]), atol=1e-6)
    (tmp_path / "missing.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n", encoding="utf-8")
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(tmp_path / "missing.jsonl"), "--id-field",
                       "doc")
    assert code == 2 and "missing.jsonl:1: no field 'doc' (fields: 'text'); pick one with --id-field" in err


def test_jsonl_named_txt_with_input_format_embeds_the_field_not_the_line(capsys, tmp_path, tiny,
                                                                          tiny_runtime) -> None:
    source = write_input(tmp_path / "docs.txt", "jsonl", TEXTS[:2])
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "--input-format", "jsonl",
                         "--text-field", "body")
    assert code == 0, err
    vectors = np.array([json.loads(line)["embedding"] for line in out.splitlines()], np.float32)
    np.testing.assert_allclose(vectors, tiny_runtime.embed(TEXTS[:2]), rtol=0, atol=1e-6)


def test_csv_from_stdin(capsys, monkeypatch, tiny, tiny_runtime) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"text\nfirst\nsecond\n"), encoding="utf-8"))
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", "-", "--input-format", "csv")
    assert code == 0, err
    vectors = np.array([json.loads(line)["embedding"] for line in out.splitlines()], np.float32)
    np.testing.assert_allclose(vectors, tiny_runtime.embed(["first", "second"]), rtol=0, atol=1e-6)


def test_an_unknown_output_suffix_is_an_error_before_loading(capsys, tmp_path, tiny) -> None:
    target = tmp_path / "vectors.txt"
    code, out, err = cli(capsys, "embed", "--model", tiny, "x", "-o", str(target))
    assert (code, out) == (2, "")
    assert err == (f"poolrunner: error: cannot tell the format of output file {str(target)!r} from its suffix: "
                   "name it .jsonl, .csv, .parquet, .npy, or pass --output-format\n")
    code, _, err = cli(capsys, "embed", "--model", tiny, "x", "-o", str(tmp_path / "v.npz"))
    assert err == "poolrunner: error: embed does not write npz: write .jsonl, .csv, .parquet, .npy\n"
    code, _, err = cli(capsys, "embed", "--model", tiny, "x", "--output-format", "parquet")
    assert err == "poolrunner: error: parquet output needs a file: pass --output FILE\n"
    assert list(tmp_path.iterdir()) == []


def test_a_malformed_jsonl_line_fails_before_loading_and_keeps_the_old_output(capsys, tmp_path, tiny) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "one"}\n\n{"text": oops}\n{"text": "four"}\n', encoding="utf-8")
    target = tmp_path / "vectors.parquet"
    target.write_bytes(b"the previous output")
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "-o", str(target))
    assert (code, out) == (2, "")
    assert err == f"poolrunner: error: {source}:3: invalid JSON: Expecting value (column 10)\n"  # not loaded
    assert target.read_bytes() == b"the previous output"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["docs.jsonl", "vectors.parquet"]


def test_skip_leaves_bad_records_out_and_counts_them(capsys, tmp_path, tiny, tiny_runtime) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "one", "id": 1}\n{"text": oops}\n{"body": "x", "id": 3}\n{"text": "four", "id": 4}\n'
                      '{"text": "five", "id": "5"}\n', encoding="utf-8")
    target = tmp_path / "vectors.jsonl"
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "--id-field", "id",
                       "--on-error", "skip", "-o", str(target))
    assert code == 0, err
    assert err.splitlines()[2:] == [  # after the loading lines
        f"poolrunner: skipped {source}:2: invalid JSON: Expecting value (column 10)",
        f"poolrunner: skipped {source}:3: no field 'text' (fields: 'body', 'id'); pick one with --text-field",
        f"poolrunner: skipped {source}:5: field 'id' is str, but the ids before it are int; give every id one type",
        "poolrunner: skipped 3 bad records (--on-error skip)",
    ]
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [(r["index"], r["id"]) for r in records] == [(0, 1), (3, 4)]  # index: the record's place in the file
    np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(["one", "four"]), atol=1e-6)


def test_an_output_the_model_overflows_on_is_a_bad_record(capsys, tmp_path, tiny, tiny_runtime) -> None:
    """A record whose output holds NaN (here: the embedding row of one word is NaN, as in a broken
    checkpoint) fails the run naming it, or is skipped and counted with --on-error skip."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    broken = tmp_path / "broken"
    shutil.copytree(tiny, broken)
    weights = load_file(broken / "model.safetensors")
    token = AutoTokenizer.from_pretrained(broken).convert_tokens_to_ids("poison")
    [name] = [name for name in weights if name.endswith("word_embeddings.weight")]
    weights[name][token] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    source = tmp_path / "docs.txt"
    source.write_text("one\nthe poison word\nthree\n", encoding="utf-8")
    target = tmp_path / "vectors.jsonl"
    overflow = ("the model's output holds NaN or infinite values (32 of 32): the model overflowed on an input at its "
                "dtype, or its weights (or a LoRA adapter's) hold such values; the request is refused rather than "
                "answered with values that are not numbers")
    code, out, err = cli(capsys, "embed", "--model", str(broken), "--input", str(source), "-o", str(target))
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == f"poolrunner: error: {source}:2: {overflow}"
    code, _, err = cli(capsys, "embed", "--model", str(broken), "--input", str(source), "-o", str(target),
                       "--on-error", "skip")
    assert code == 0, err
    assert f"poolrunner: skipped {source}:2: {overflow}" in err.splitlines()
    records = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
    assert [r["index"] for r in records] == [0, 2]
    np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(["one", "three"]), atol=1e-6)


def test_a_csv_row_of_the_wrong_width(capsys, tmp_path, tiny, tiny_runtime) -> None:
    source = tmp_path / "docs.csv"
    source.write_text("text,id\nfirst,1\nsecond,2,surplus\nthird,3\n", encoding="utf-8")
    target = tmp_path / "vectors.csv"
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "-o", str(target))
    assert (code, out) == (2, "")
    assert err == f"poolrunner: error: {source}:3: expected 2 fields (as the header has), got 3\n"
    assert not target.exists()
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "-o", str(target),
                       "--on-error", "skip")
    assert code == 0, err
    assert f"poolrunner: skipped {source}:3: expected 2 fields (as the header has), got 3\n" in err
    with target.open(encoding="utf-8", newline="") as file:
        records = list(csv.DictReader(file))
    assert [record["index"] for record in records] == ["0", "2"]
    np.testing.assert_allclose([json.loads(r["embedding"]) for r in records], tiny_runtime.embed(["first", "third"]),
                               atol=1e-6)


@pytest.mark.parametrize(("line", "problem"), [
    ('{"text": "ab\\ud800"}', "field 'text' holds a lone surrogate (U+D800 at character 3), which is not text"),
    ("[" * 100_000 + "]" * 100_000, "invalid JSON: nested too deeply to read"),
    ('{"text": "x", "n": ' + "9" * 5000 + "}", "invalid JSON: a number of more than 4300 digits"),
    ('{"text": "caf\udcff"}', "not UTF-8 text: byte 0xff at column 14"),
], ids=["lone-surrogate", "deep-nesting", "huge-number", "bad-utf8"])
def test_hostile_jsonl_is_a_clear_error(capsys, tmp_path, tiny, line, problem) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_bytes(b'{"text": "fine"}\n' + line.encode("utf-8", "surrogateescape") + b"\n")
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source))
    assert (code, out, err) == (2, "", f"poolrunner: error: {source}:2: {problem}\n")


def test_an_input_the_model_refuses_is_named_by_its_line(capsys, tmp_path, tiny, tiny_runtime) -> None:
    long_text = " ".join(["word"] * 300)  # over the tiny model's 128 positions
    source = write_input(tmp_path / "docs.txt", "text", ["short", "fine", long_text, "last"])
    code, _, err = cli(capsys, "embed", "--model", tiny, "--input", str(source))
    assert code == 2
    assert err.splitlines()[2].startswith(f"poolrunner: error: {source}:3: this input has 302 tokens, more than "
                                          "the maximum of 128")
    assert "poolrunner: hint: pass --truncate -1" in err
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source), "--on-error", "skip")
    assert code == 0, err
    assert err.splitlines()[-1] == "poolrunner: skipped 1 bad record (--on-error skip)"
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in records] == [0, 1, 3]
    np.testing.assert_allclose([r["embedding"] for r in records], tiny_runtime.embed(["short", "fine", "last"]),
                               atol=1e-6)


def test_batch_size_counts_sequences_not_tokens() -> None:
    args = build_parser().parse_args(["embed", "--batch-size", "32", "x"])
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (32, None)


def test_many_inputs_get_a_labelled_bar_after_the_loading_line(capsys, tmp_path, tiny) -> None:
    source = write_input(tmp_path / "many.txt", "text", [f"sentence {i}" for i in range(150)])
    code, out, err = cli(capsys, "embed", "--model", tiny, "--input", str(source))
    assert code == 0, err
    assert err.startswith(f"poolrunner: loading {tiny}...\n")
    assert "embedding: 100%" in err and "150/150" in err
    assert len(out.splitlines()) == 150


def test_other_commands_read_and_write_every_format(capsys, tmp_path, tiny, poolrunner_tiny_model) -> None:
    import poolrunner

    queries, documents = ["a cat", "a dog", "a bird"], ["cats purr", "dogs bark", "birds sing"]
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("q,d,key\n" + "".join(f"{q},{d},k{i}\n" for i, (q, d) in enumerate(zip(queries, documents,
                                                                                              strict=True))))
    scores = tmp_path / "scores.parquet"
    code, _, err = cli(capsys, "score", "--model", tiny, "--input", str(pairs), "--query-field", "q",
                       "--document-field", "d", "--id-field", "key", "-o", str(scores))
    assert code == 0, err
    table = pq.read_table(scores)
    assert table.column_names == ["index", "key", "query", "document", "score"]
    runtime = poolrunner.Runtime(tiny, dtype="float32", load_entrypoints=False)
    np.testing.assert_allclose(table.column("score").to_pylist(), runtime.score(queries, documents), atol=1e-6)

    docs = write_input(tmp_path / "docs.parquet", "parquet", documents, ["d0", "d1", "d2"])
    ranked = tmp_path / "ranked.csv"
    code, _, err = cli(capsys, "rerank", "--model", tiny, "--query", "pets", "--input", str(docs), "--text-field",
                       "body", "--id-field", "doc_id", "-o", str(ranked))
    assert code == 0, err
    with ranked.open(encoding="utf-8", newline="") as file:
        rows = list(csv.DictReader(file))
    expected = runtime.score("pets", documents)
    order = sorted(range(3), key=lambda i: -expected[i])
    assert [(row["rank"], row["index"], row["doc_id"]) for row in rows] == [
        (str(rank), str(i), f"d{i}") for rank, i in enumerate(order, start=1)]
    np.testing.assert_allclose([float(row["score"]) for row in rows], expected[order], atol=1e-6)

    classifier = str(poolrunner_tiny_model("BertForSequenceClassification", num_labels=3))
    labels = tmp_path / "labels.parquet"
    code, _, err = cli(capsys, "classify", "--model", classifier, "--input", str(docs), "--text-field", "body",
                       "-o", str(labels))
    assert code == 0, err
    table = pq.read_table(labels)
    probs = poolrunner.Runtime(classifier, task="classify", dtype="float32", load_entrypoints=False).classify(documents)
    assert table.column("label").to_pylist() == [result.label for result in probs]
    np.testing.assert_allclose([list(row.values()) for row in table.column("probs").to_pylist()],
                               [result.probs for result in probs], atol=1e-6)

    tokens = tmp_path / "tokens.parquet"
    code, _, err = cli(capsys, "encode", "--model", tiny, "--task", "token_embed", "--input", str(docs),
                       "--text-field", "body", "-o", str(tokens))
    assert code == 0, err
    table = pq.read_table(tokens)
    assert table.column("task").to_pylist() == ["token_embed"] * 3
    for row, expected_tokens in zip(table.column("output").to_pylist(), runtime.encode(documents, task="token_embed"),
                                    strict=True):
        np.testing.assert_allclose(row, expected_tokens, atol=1e-6)


# --- the reader on its own --------------------------------------------------------------------


def read_all(data: bytes, fmt: str, fields: Fields | None = None, **options: object) -> list:
    return list(read_chunks(io.BytesIO(data), fmt, fields or Fields(), name="f", **options))


def test_chunks_are_bounded_and_rows_count_records() -> None:
    lines = "".join(json.dumps({"text": f"t{i}"}) + "\n" + ("\n" if i % 3 == 0 else "") for i in range(10))
    chunks = read_all(lines.encode(), "jsonl", size=4)
    assert [len(chunk) for chunk in chunks] == [4, 4, 2]
    assert [row for chunk in chunks for row in chunk.rows] == list(range(10))  # blank lines are no records
    assert chunks[1].places[0] == "f:7"  # record 4 is on line 7, after two blank lines
    assert chunks[0].ids is None


def test_optional_ids_come_from_files_that_have_them() -> None:
    fields = Fields(id=("id", "--id-field"), optional_id=True)
    assert read_all(b'{"text": "a", "id": 7}\n', "jsonl", fields)[0].ids == [7]
    assert read_all(b'{"text": "a"}\n', "jsonl", fields)[0].ids is None
    assert read_all(b"text\na\n", "csv", fields)[0].ids is None
    assert read_all(b"a\n", "text", fields)[0].ids is None
    with pytest.raises(InvalidRequestError, match=r"^f is read as text, one input a line, with no fields: "
                                                  r"--id-field needs jsonl, csv or parquet input"):
        read_all(b"a\n", "text", Fields(id=("id", "--id-field")))


def test_file_level_problems_fail_even_when_skipping(tmp_path) -> None:
    with pytest.raises(InvalidRequestError, match=r"^f:1: no column 'body' \(the header's columns: 'text', 'id'\); "
                                                  "pick one with --text-field$"):
        read_all(b"text,id\na,1\n", "csv", Fields((("body", "--text-field"),)), on_error="skip")
    table = pa.table({"text": pa.array([1, 2])})
    pq.write_table(table, tmp_path / "numbers.parquet")
    with pytest.raises(InvalidRequestError, match=r"numbers.parquet: column 'text' is int64, not text"):
        list(read_chunks(str(tmp_path / "numbers.parquet"), "parquet", Fields(), name=str(tmp_path / "numbers.parquet"),
                         on_error="skip"))
    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "nulls.parquet")
    [chunk] = read_chunks(str(tmp_path / "nulls.parquet"), "parquet", Fields(), name="n", on_error="skip")
    assert (chunk.rows, chunk.skipped) == ([0, 2], [(1, "n row 1: field 'text' is null, not a string")])
    pq.write_table(pa.table({"image": pa.array([b"\x89PNG", None], pa.binary())}), tmp_path / "images.parquet")
    [chunk] = read_chunks(str(tmp_path / "images.parquet"), "parquet", attrs.evolve(
        Fields((("image", "--image-field"),)), images=True), name="i", on_error="skip")
    assert chunk.skipped == [(1, "i row 1: field 'image' is null, not an image")]


# --- memory -----------------------------------------------------------------------------------

# One `embed` run in a fresh interpreter, with a stand-in for the model that keeps nothing (each
# text's vector is its length, 32 times): what is measured is the reading and the writing. The
# peak is the kernel's VmHWM: getrusage's ru_maxrss survives fork and exec, so a child of this
# (large) test process would report at least this process's size.
PEAK_RSS = textwrap.dedent("""
    import json, sys
    import numpy as np
    import poolrunner.core.cli.embed as embed
    from poolrunner.core.cli.main import main

    class StandIn:
        def execute(self, request):
            return [np.full(32, len(text), np.float32) for text in request.inputs]

    embed.load_model = lambda args, **options: StandIn()
    code = main(["embed", "--input", sys.argv[1], "--output", sys.argv[2]])
    with open("/proc/self/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    print(json.dumps({"code": code, "peak_kib": peak}))
""")


def peak_rss_mib(source: Path, target: Path) -> float:
    """Peak resident memory of one ``embed`` run of ``source`` into ``target``, in MiB."""
    done = subprocess.run([sys.executable, "-c", PEAK_RSS, str(source), str(target)], capture_output=True,
                          text=True, timeout=600, check=False)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr
    return result["peak_kib"] / 1024


def write_lines(path: Path, megabytes: int) -> int:
    """Sentences of about 60 characters, one a line, up to ``megabytes`` MiB; returns the count."""
    count = 0
    with path.open("w", encoding="utf-8") as file:
        while file.tell() < megabytes << 20:
            file.write("".join(f"line {count + i}: the quick brown fox jumps over the lazy dog again\n"
                               for i in range(1000)))
            count += 1000
    return count


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from Linux's /proc")
def test_memory_stays_flat_with_the_input_size(tmp_path) -> None:
    """10 MiB and 100 MiB of text (170k and 1.7M lines) into .npy: the same peak RSS (reading the
    input whole would add several hundred MiB)."""
    peaks = {}
    for megabytes in (10, 100):
        source, target = tmp_path / "in.txt", tmp_path / "out.npy"
        lines = write_lines(source, megabytes)
        peaks[megabytes] = peak_rss_mib(source, target)
        vectors = np.load(target, mmap_mode="r")
        assert vectors.shape == (lines, 32) and vectors[-1, 0] == len(f"line {lines - 1}: the quick brown fox "
                                                                         "jumps over the lazy dog again")
        del vectors
        target.unlink()
    print(f"peak RSS: 10 MiB input {peaks[10]:.1f} MiB, 100 MiB input {peaks[100]:.1f} MiB")
    assert peaks[100] - peaks[10] < 5, peaks
