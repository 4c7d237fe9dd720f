"""The per-input character limit (``max_input_chars``), tokenization in pieces under the lock, and
memory handed back after a large request.

Every refused input is checked for its exact message, and the runtime must then still serve.
"""

from __future__ import annotations

import ctypes
import os
import platform
import random
import subprocess
import sys
import threading
import time

import attrs
import pytest

import poolrunner
from poolrunner import InputTooLongError, InvalidRequestError
from poolrunner.core import memory
from poolrunner.core.config import RuntimeConfig, default_max_input_chars
from poolrunner.core.inputs.tokenize import InputProcessor

LIMIT = 8192  # all-MiniLM-L6-v2: 32 characters for each of its 256 tokens


def _message(index: int, length: int, advice: str, limit: int = LIMIT) -> str:
    return (f"input {index} has {length} characters, more than the limit of {limit} per input (max_input_chars, the "
            f"--max-input-chars flag); {advice}")


def test_default_limit_is_32_characters_per_token(runtime):
    assert runtime.inputs.max_input_chars == default_max_input_chars(256) == LIMIT
    assert runtime.inputs.without_length_limit().max_input_chars == LIMIT


def test_text_over_the_limit_is_refused_by_index_and_length_then_the_runtime_serves(runtime, assert_serves):
    text = "word " * 1700  # 8500 characters, about 1700 tokens
    with pytest.raises(InvalidRequestError) as error:
        runtime.embed(["a short text", text])
    assert str(error.value) == _message(
        1, 8500, "shorten it, or pass truncate_prompt_tokens to read only the part kept")
    assert_serves(runtime)
    assert runtime.embed(text[:LIMIT], truncate_prompt_tokens=-1).shape == (384,)  # at the limit: read


@pytest.mark.parametrize(("text", "side"), [
    ("The cat. " + " " * 9000, "right"),
    ("See the attached image: data:image/png;base64," + "iVBORw0KGgo" * 900, "right"),  # a few words, then none
    ("x" * 9000 + " a b c d e f", "left"),
])
def test_truncation_is_not_advised_for_a_text_it_could_not_cut(runtime, text, side, assert_serves):
    """No space in the part truncation would read at which the model's 256 tokens can be cut:
    pointing to truncate_prompt_tokens would only lead to a second refusal."""
    part = "first" if side == "right" else "last"
    advice = (f"shorten it or raise the limit: truncating reads only its {part} 8192 characters, and they have no "
              "space between words at which 256 tokens can be cut exactly")
    with pytest.raises(InputTooLongError) as error:
        runtime.embed(text, truncation_side=side)
    assert (str(error.value), error.value.truncation_helps) == (_message(0, len(text), advice), False)
    with pytest.raises(InputTooLongError) as error:
        runtime.embed(text, truncation_side=side, truncate_prompt_tokens=-1)
    assert str(error.value) == _message(0, len(text), advice)
    assert_serves(runtime)


def test_truncated_text_over_the_limit_is_read_in_a_window(runtime, lee_docs, assert_serves):
    long = " ".join(lee_docs) * 10  # about 330 KB
    vector = runtime.embed(long, truncate_prompt_tokens=-1)
    assert (vector == runtime.embed(long[:5000], truncate_prompt_tokens=-1)).all()  # 5000 characters hold 256 tokens
    left = runtime.embed(long, truncate_prompt_tokens=100, truncation_side="left")
    assert (left == runtime.embed(long[-3000:], truncate_prompt_tokens=100, truncation_side="left")).all()
    assert_serves(runtime)


def test_truncated_chinese_text_over_the_limit_is_read_in_a_window(runtime, hf_tokenizer, assert_serves):
    """No spaces, yet MiniLM's normalizer isolates each ideograph: a cut before one is exact."""
    rng = random.Random(0)
    text = "".join("，" if rng.random() < 0.1 else chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(100_000))
    vector = runtime.embed(text, truncate_prompt_tokens=-1)
    hf_tokenizer.truncation_side = "right"
    assert runtime.inputs.encode([text], truncate_prompt_tokens=-1)[0] == tuple(
        hf_tokenizer(text, truncation=True, max_length=256)["input_ids"])
    assert (vector == runtime.embed(text[:1000], truncate_prompt_tokens=-1)).all()  # 1000 hold 256 tokens
    assert_serves(runtime)


def test_truncated_text_without_spaces_over_the_limit_is_refused(runtime, assert_serves):
    with pytest.raises(InvalidRequestError) as error:
        runtime.embed("x" * 9000, truncate_prompt_tokens=-1)
    assert str(error.value) == _message(
        0, 9000, "shorten it or raise the limit: truncating reads only its first 8192 characters, "
        "and they have no space between words at which 256 tokens can be cut exactly")
    assert isinstance(error.value, InputTooLongError) and error.value.param == "input"
    assert_serves(runtime)


def test_pair_text_over_the_limit_is_refused_unless_its_document_can_be_read_in_a_window(runtime, assert_serves):
    advice = ("shorten it (a pair is read whole unless it is truncated, its query fits in the tokens kept and its "
              "document can be cut at a space)")
    with pytest.raises(InvalidRequestError) as error:
        runtime.inputs.encode_pairs([("query", "a b " * 3000)])
    assert str(error.value) == ("pair 0, text 2 has 12000 characters, more than the limit of 8192 per input "
                                f"(max_input_chars, the --max-input-chars flag); {advice}")
    assert_serves(runtime)
    with pytest.raises(InvalidRequestError) as error:  # 300 query tokens: past the 253 a pair keeps of text
        runtime.inputs.encode_pairs([("q " * 300, "a b " * 3000)], truncate_prompt_tokens=-1)
    assert str(error.value).startswith("pair 0, text 2 has 12000 characters") and str(error.value).endswith(advice)
    assert_serves(runtime)
    (ids, _), = runtime.inputs.encode_pairs([("query", "a b " * 3000)], truncate_prompt_tokens=-1)
    assert len(ids) == 256


def test_max_input_chars_is_an_option_of_the_api_the_command_line_and_the_environment(monkeypatch):
    with pytest.raises(InvalidRequestError, match="^max_input_chars must be a positive integer, got 0$"):
        RuntimeConfig(max_input_chars=0)
    assert RuntimeConfig.from_options(max_input_chars=100).recorded() == {"max_input_chars": 100}
    from poolrunner.core.cli.common import runtime_options
    from poolrunner.core.cli.main import build_parser

    args = build_parser().parse_args(["embed", "--max-input-chars", "500", "text"])
    assert runtime_options(args)["max_input_chars"] == 500
    monkeypatch.setenv("POOLRUNNER_MAX_INPUT_CHARS", "700")
    assert build_parser().parse_args(["serve"]).max_input_chars == 700


def test_default_limit_follows_max_embed_len():
    runtime = poolrunner.Runtime(dtype="float32", max_embed_len=1024)
    assert runtime.inputs.max_input_chars == 32 * 1024
    explicit = poolrunner.Runtime(dtype="float32", max_input_chars=300)
    with pytest.raises(InvalidRequestError, match="^input 0 has 301 characters, more than the limit of 300 "):
        explicit.embed("a" * 301)


def test_a_large_batch_does_not_hold_the_tokenizer_lock_from_small_calls(runtime):
    """A batch of 8 MB of text takes seconds to tokenize; a one-text call meanwhile waits for one
    piece of it (:data:`~poolrunner.core.inputs.tokenize.LOCK_CHARS`), not for the whole batch."""
    inputs = InputProcessor(runtime.inputs.tokenizer, attrs.evolve(runtime.model_config, max_model_len=10**9),
                            max_input_chars=10**9)
    inputs._lock = runtime.inputs._lock  # the same tokenizer: the same lock
    big = ["tokenize this sentence again and again, " * 200] * 1000  # 8 MB
    done = threading.Event()
    took: dict[str, float] = {}

    def batch() -> None:
        began = time.perf_counter()
        inputs.encode(big)
        took["batch"] = time.perf_counter() - began
        done.set()

    thread = threading.Thread(target=batch)
    thread.start()
    time.sleep(0.2)
    waits = []
    while not done.is_set():
        began = time.perf_counter()
        runtime.inputs.encode(["a small request"])
        waits.append(time.perf_counter() - began)
        time.sleep(0.05)
    thread.join()
    assert took["batch"] > 1.0 and len(waits) >= 5, (took, waits)
    assert max(waits) < took["batch"] / 4, f"a small call waited {max(waits):.2f} s behind a batch of " \
                                           f"{took['batch']:.1f} s"


def test_release_memory_calls_glibc_malloc_trim_and_never_fails(monkeypatch):
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert memory._malloc_trim() is not None
        buffers = [ctypes.create_string_buffer(4096) for _ in range(10000)]
        del buffers
        assert memory.release_memory() in (True, False)
    memory._malloc_trim.cache_clear()
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    try:
        assert memory._malloc_trim() is None
        assert memory.release_memory() is False
    finally:
        memory._malloc_trim.cache_clear()


STEP_BUFFERS_SCRIPT = """
import ctypes
import torch
from poolrunner.core import memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size):  # whether glibc maps a block of this size fresh (hblkhd: bytes in mapped blocks)
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    after = libc.mallinfo2().hblkhd
    libc.free(block)
    return after > before

from transformers.pytorch_utils import Conv1D
model = torch.nn.Sequential(torch.nn.Embedding(50000, 8), torch.nn.Linear(8, 512), torch.nn.GELU(),
                            torch.nn.Linear(512, 8))
step = memory.step_block_bytes(model, 4096)
assert step == 4096 * 512 * 4, step  # the widest layer's float32 output for the whole budget, no lookup table's
assert memory.step_block_bytes(torch.nn.Sequential(Conv1D(768, 8)), 2) == 2 * 768 * 4  # GPT-2's [in, out] weight
assert memory.step_block_bytes(torch.nn.Sequential(torch.nn.GELU()), 2) == memory.MAX_STEP_MMAP_THRESHOLD
assert memory.keep_step_buffers(step)
assert memory.keep_step_buffers(step // 4)  # a smaller model loaded later: the larger threshold holds
def tensor_mapped(size):  # torch's own allocation (64-byte aligned), as a step's products get it
    before = libc.mallinfo2().hblkhd
    block = torch.empty(size, dtype=torch.uint8)
    after = libc.mallinfo2().hblkhd
    del block
    return after > before

print(mapped(step - (1 << 20)), tensor_mapped(step), mapped(step + (1 << 20)))
assert memory.keep_step_buffers(1 << 40)  # capped
print(mapped(60 << 20), mapped(70 << 20))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_a_step_s_blocks_stay_on_the_heap_and_larger_ones_are_mapped_fresh():
    """Blocks up to the largest a step within the token budget makes (that one included, as torch
    allocates it) are reused from the heap;
    larger ones (a request longer than the budget) are mapped and unmapped, so that memory grows
    with a long request's length, not faster (core/memory.py's keep_step_buffers)."""
    result = subprocess.run([sys.executable, "-c", STEP_BUFFERS_SCRIPT], capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True", "False", "True"]


ARENAS_SCRIPT = """
import ctypes, sys, threading
from poolrunner.core import memory
assert memory.limit_malloc_arenas(2)
barrier = threading.Barrier(8)
def churn():
    barrier.wait()  # all at once, so that glibc would give each thread an arena of its own
    for _ in range(2000):
        ctypes.create_string_buffer(4096)
threads = [threading.Thread(target=churn) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per arena, on stderr
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt(M_ARENA_MAX) is glibc's")
def test_limit_malloc_arenas_caps_the_arenas_threads_get():
    result = subprocess.run([sys.executable, "-c", ARENAS_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    arenas = [line for line in result.stderr.splitlines() if line.startswith("Arena ")]
    assert 1 <= len(arenas) <= 2, result.stderr


def test_a_token_added_to_the_tokenizer_past_the_embeddings_is_refused_naming_it(tmp_path):
    """A tokenizer saved with an added token and the model's embeddings not resized: transformers
    fails on its id (an index error; a device assert on CUDA), so a text holding it is a 400
    naming the token and the vocabulary, and texts without it are served; tokenizing it answers
    the tokenizer's ids, as vLLM's ``/tokenize``."""
    import transformers

    from poolrunner.core.testing.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path / "added-token")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<ent>"])
    tokenizer.save_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder)
    with pytest.raises(IndexError):
        model(**tokenizer(["a <ent> b"], return_tensors="pt"))
    runtime = poolrunner.Runtime(folder, dtype="float32")
    with pytest.raises(InvalidRequestError) as error:
        runtime.embed(["a b", "a <ent> b"])
    assert str(error.value) == ("input 1: its token '<ent>' has the id 30522, outside the model's vocabulary "
                                "[0, 30522) (config.json vocab_size: a token added to the tokenizer without resizing "
                                "the model's embeddings)")
    assert runtime.embed(["a b"]).shape == (1, 32)
    assert runtime.tokenize(["a <ent> b"]) == [tokenizer("a <ent> b")["input_ids"]]  # the model never runs
