"""The CPU fast path (``compile="auto"``): prepacked oneDNN linear layers, fused activations and
``dtype="bf16-mixed"``.

References are independent of the fast path: the same transformers modules run before they are
prepacked, ``torch.nn.functional.linear`` in float64, and sentence-transformers in float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel, LlamaConfig, activations
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.modernbert.modeling_modernbert import ModernBertConfig, ModernBertMLP

import poolrunner
from poolrunner.core import precision
from poolrunner.core.errors import ModelLoadError
from poolrunner.core.kernels import onednn
from tests.helpers import MIN_COSINE, ModelSpy, bf16_products, cosine_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN")
BF16_PRODUCTS = bf16_products()
# The layers themselves in bfloat16: only where oneDNN has the kernels (the runtime never packs
# bfloat16 elsewhere; test_bf16_mixed_holds_the_bar_on_single_words proves the refusal there).
needs_bf16_products = pytest.mark.skipif(not BF16_PRODUCTS, reason="this CPU's oneDNN has no bfloat16 products")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_products)]


def _bf16_mixed_refusal(compile: str) -> str:
    return ("dtype 'bf16-mixed' needs the CPU fast path (compile='auto' on a CPU whose oneDNN multiplies bfloat16: "
            f"AVX-512 BW/VL/DQ or AVX-NE-CONVERT); this runtime has device 'cpu', compile={compile!r} and "
            f"{'' if BF16_PRODUCTS else 'no '}oneDNN bfloat16 products")

FUSED = [
    (activations.GELUActivation(), ("gelu", "none")),
    (nn.GELU(), ("gelu", "none")),
    (nn.GELU(approximate="tanh"), ("gelu", "tanh")),
    (activations.GELUTanh(), ("gelu", "tanh")),
    (nn.ReLU(), ("relu", "")),
    (nn.SiLU(), ("swish", "")),
    (activations.SiLUActivation(), ("swish", "")),
]


def _linear(dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(48, 80).to(dtype)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected.double()).norm() / expected.double().norm()).item()


def _name(value: object) -> str | None:
    return type(value).__name__ if isinstance(value, nn.Module) else None


@pytest.mark.parametrize(("activation", "post_op"), FUSED, ids=_name)
def test_a_fused_activation_computes_what_the_module_computes(activation, post_op):
    assert onednn._post_op(activation) == post_op
    linear, x = _linear(), torch.randn(7, 48)
    with torch.inference_mode():
        expected = activation(F.linear(x.double(), linear.weight.double(), linear.bias.double()))
        got = onednn.PackedLinear(linear, post_op)(x)
    assert got.dtype == torch.float32
    assert _relative_error(got, expected) < 1e-6


@pytest.mark.parametrize("activation", [
    activations.NewGELUActivation(), activations.QuickGELUActivation(),
    activations.GELUActivation(use_gelu_python=True), activations.GELUTanh(use_gelu_tanh_python=True),
    nn.Tanh(), nn.Identity(),
], ids=_name)
def test_an_activation_without_an_exact_post_op_is_not_fused(activation):
    assert onednn._post_op(activation) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_linear_takes_any_leading_shape(dtype):
    linear, x = _linear(dtype), torch.randn(2, 5, 48).to(dtype)
    with torch.inference_mode():
        got = onednn.PackedLinear(linear)(x)
        expected = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    assert got.shape == (2, 5, 80) and got.dtype == dtype
    assert _relative_error(got, expected) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_joined_layers_give_each_layers_output_side_by_side(dtype, bias):
    """Query, key and value as one product (BERT's layers): each block of columns is its layer's
    output, and each layer, over views of the joined weights, still computes it alone."""
    torch.manual_seed(0)
    linears = [nn.Linear(48, width, bias=bias).to(dtype) for width in (32, 16, 16)]
    x = torch.randn(7, 48).to(dtype)
    with torch.inference_mode():
        product, parts = onednn.joined_linear([onednn.PackedLinear(linear) for linear in linears])
        got = product(x).split([32, 16, 16], dim=-1)
        alone = [part(x) for part in parts]
    for linear, part, out, out_alone in zip(linears, parts, got, alone, strict=True):
        expected = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
        assert _relative_error(out, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert _relative_error(out_alone, expected) < (1e-6 if dtype == torch.float32 else 1e-2)
        assert torch.equal(part.weight, linear.weight) and (part.bias is None) == (not bias)
        assert part.weight.untyped_storage().data_ptr() == product.weight.untyped_storage().data_ptr()


@needs_bf16_products
def test_bf16_mixed_rounds_the_product_inputs_and_keeps_float32_around_them():
    linear, x = _linear(), torch.randn(9, 48)
    # The product of the bf16-rounded operands, accumulated exactly, plus the float32 bias.
    expected = F.linear(x.bfloat16().double(), linear.weight.bfloat16().double(), linear.bias.double())
    with torch.inference_mode():
        plain = onednn.PackedLinear(linear, matmul_dtype=torch.bfloat16)(x)
        fused = onednn.PackedLinear(linear, ("relu", ""), matmul_dtype=torch.bfloat16)(x)
    # Back in float32 for the residual stream, off by at most the bf16 rounding of the output.
    assert plain.dtype == torch.float32
    assert _relative_error(plain, expected) < 2**-8
    torch.testing.assert_close(plain, plain.bfloat16().float(), rtol=0, atol=0)
    # A fused activation's output feeds the next product: it stays in the matmul dtype.
    assert fused.dtype == torch.bfloat16
    assert _relative_error(fused, expected.relu()) < 1e-2


def _seeded(model_class, config):
    torch.manual_seed(0)
    return model_class(config).eval()


def _small(family: str, **config):
    """A seeded 2-layer model of ``family`` (hidden 32, 4 heads, MLP 64)."""
    shape = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 64, **config}
    return _seeded(getattr(transformers, f"{family}Model"), getattr(transformers, f"{family}Config")(**shape))


# a model -> its gated MLPs, and the activations fused into a product whether gated ones take post-ops or not
PREPACKED = {
    "bert": (lambda: _small("Bert"), 0, 2),
    "distilbert": (lambda: _seeded(DistilBertModel, DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4,
                                                                     hidden_dim=64)), 0, 2),
    "jina-v3": (lambda: _small("JinaEmbeddingsV3"), 0, 2),
    "llama": (lambda: _small("Llama", num_key_value_heads=2), 2, 0),
    "gte": (lambda: _small("Gte"), 2, 0),
    "t5-encoder": (lambda: _seeded(transformers.T5EncoderModel, transformers.T5Config(
        vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)), 0, 2),
}


@pytest.mark.parametrize("kind", PREPACKED)
def test_prepacking_a_model_keeps_its_outputs(kind):
    build, gated, fused_alone = PREPACKED[kind]
    model = build()
    input_ids = torch.randint(5, 99, (3, 11))
    with torch.inference_mode():
        expected = model(input_ids=input_ids).last_hidden_state
        linears = sum(type(m) is nn.Linear for m in model.modules())
        assert onednn.prepack(model) == linears
        got = model(input_ids=input_ids).last_hidden_state
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert sum(type(m) is onednn.GatedMLP for m in model.modules()) == gated
    fused = [m for m in model.modules() if isinstance(m, onednn.PackedLinear) and m.activation != onednn.NO_ACTIVATION]
    # one MLP activation per layer: BERT's, DistilBERT's, Jina's GELU, T5's ReLU; a gated MLP's where post-ops pay
    assert len(fused) == fused_alone + (gated if onednn.GATE_POST_OPS else 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_module_with_known_code_but_an_inexact_activation_keeps_its_activation():
    model = _seeded(BertModel, BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                          intermediate_size=64, hidden_act="gelu_new"))
    input_ids = torch.randint(5, 99, (2, 6))
    with torch.inference_mode():
        expected = model(input_ids=input_ids).last_hidden_state
        onednn.prepack(model)
        got = model(input_ids=input_ids).last_hidden_state
    intermediate = model.encoder.layer[0].intermediate
    assert type(intermediate.intermediate_act_fn) is activations.NewGELUActivation
    assert intermediate.dense.activation == onednn.NO_ACTIVATION
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _mlp(hidden_act: str = "silu", mlp_bias: bool = False, dtype: torch.dtype = torch.float32) -> nn.ModuleDict:
    """A seeded ``LlamaMLP`` (hidden 32, intermediate 64) in a parent, which prepacking replaces it in."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, hidden_act=hidden_act, mlp_bias=mlp_bias)
    return nn.ModuleDict({"mlp": LlamaMLP(config).to(dtype)})


def _modernbert_mlp(mlp_bias: bool = False, dtype: torch.dtype = torch.float32, **config) -> nn.ModuleDict:
    torch.manual_seed(0)
    mlp = ModernBertMLP(ModernBertConfig(hidden_size=32, intermediate_size=48, mlp_bias=mlp_bias, **config))
    return nn.ModuleDict({"mlp": mlp.to(dtype).eval()})


def _gte_mlp(dtype: torch.dtype) -> nn.ModuleDict:
    """GTE's MLP: Llama's with a dropout before down_proj, which carries a bias."""
    torch.manual_seed(0)
    mlp = transformers.models.gte.modeling_gte.GteMLP(transformers.GteConfig(hidden_size=32, intermediate_size=64))
    return nn.ModuleDict({"mlp": mlp.to(dtype).eval()})


GATED = {  # the module (in a parent, bias?, dtype) -> the fused module's type, its activation's post-op
    "silu": (lambda bias, dtype: _mlp("silu", bias, dtype), onednn.GatedMLP, ("swish", "")),
    "gelu-tanh": (lambda bias, dtype: _mlp("gelu_pytorch_tanh", bias, dtype), onednn.GatedMLP, ("gelu", "tanh")),
    "gelu": (lambda bias, dtype: _mlp("gelu", bias, dtype), onednn.GatedMLP, ("gelu", "none")),
    "gte-gelu": (lambda bias, dtype: _gte_mlp(dtype), onednn.GatedMLP, ("gelu", "none")),
    "modernbert-geglu": (_modernbert_mlp, onednn.SplitGatedMLP, ("gelu", "none")),
}


def _activated(mlp: nn.Module) -> nn.Module:
    """The product whose output the activation reads."""
    return mlp.gate_proj if isinstance(mlp, onednn.GatedMLP) else mlp._halves[0]


@pytest.mark.parametrize("kind", GATED)
@pytest.mark.parametrize("post_ops", [True, False], ids=["post-ops", "passes"])
@pytest.mark.parametrize("mlp_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_gated_mlp_computes_what_its_module_computes(dtype, mlp_bias, post_ops, kind, monkeypatch):
    """Llama's MLP with SiLU, GELU-tanh (Gemma's) or GELU, and ModernBERT's GeGLU (Wi's halves as
    two products): the activation one product's post-op and the multiply the other's, or both
    passes; the module's output to the dtype's rounding, at least as close to float64 as the
    module's own, its parameters under their names."""
    build, fused, post_op = GATED[kind]
    monkeypatch.setattr(onednn, "GATE_POST_OPS", post_ops)  # both run on every x86 CPU; the default picks one
    parent, x = build(mlp_bias, dtype), torch.randn(3, 7, 32).to(dtype)
    reference = build(mlp_bias, dtype)["mlp"].double()
    names = [name for name, _ in parent.named_parameters()]
    with torch.inference_mode():
        expected, exact = parent["mlp"](x), reference(x.double())
        assert onednn.prepack(parent) == 3
        got = parent["mlp"](x)
    mlp = parent["mlp"]
    assert type(mlp) is fused and mlp.post_ops is post_ops
    assert _activated(mlp).activation == (post_op if post_ops else onednn.NO_ACTIVATION)
    assert [name for name, _ in parent.named_parameters()] == names
    assert got.shape == expected.shape and got.dtype == dtype
    # bfloat16: the products' outputs are not rounded before the multiply; the module's are
    assert _relative_error(got, expected) < (1e-6 if dtype == torch.float32 else 2**-7)
    assert _relative_error(got, exact) <= 1.05 * _relative_error(expected, exact) + 1e-7


@needs_bf16_products
@pytest.mark.parametrize("kind", ["silu", "modernbert-geglu"])
def test_a_gated_mlp_in_bf16_mixed_rounds_the_product_inputs_and_returns_float32(kind):
    build = GATED[kind][0]
    parent, x = build(True, torch.float32), torch.randn(5, 32)
    # The module in float64 on the bf16-rounded input and weights, with the float32 biases.
    reference = build(True, torch.float32)["mlp"].double()
    for name, layer in reference.named_children():
        if isinstance(layer, nn.Linear):
            layer.weight.data = getattr(parent["mlp"], name).weight.data.bfloat16().double()
    with torch.inference_mode():
        expected = reference(x.bfloat16().double())
        onednn.prepack(parent, torch.bfloat16)
        got = parent["mlp"](x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, got.bfloat16().float(), rtol=0, atol=0)  # the last product's bf16 output
    assert _relative_error(got, expected) < 2**-7


@pytest.mark.parametrize(("config", "matmul_dtype"), [({"hidden_activation": "gelu_new"}, None),
                                                      ({}, torch.int8)], ids=["no-exact-post-op", "int8"])
def test_modernberts_mlp_stays_where_it_cannot_be_split(config, matmul_dtype):
    """An activation without an exact oneDNN post-op, or int8 layers (calibrated by name): the
    module keeps its code, its layers packed one by one."""
    parent = _modernbert_mlp(**config)
    onednn.prepack(parent, matmul_dtype)
    assert type(parent["mlp"]) is ModernBertMLP


@needs_bf16_products
def test_modernbert_in_bf16_on_the_fast_path_holds_the_bar(tmp_path):
    """End to end, its local and global layers: GeGLU split, rotary in the kernel (CPU kernels
    permitting); the vectors as close to transformers' float32 as the module's own bf16 code."""
    from tests.test_attention_rules import _folder

    config = transformers.ModernBertConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=128, bos_token_id=0,
        eos_token_id=2, pad_token_id=2, cls_token_id=0, sep_token_id=2, architectures=["ModernBertModel"])
    folder = _folder(config, tmp_path)
    spy = ModelSpy()
    fast = poolrunner.Runtime(folder, dtype="bfloat16", pooling_type="MEAN", load_entrypoints=False, plugins=[spy])
    eager = poolrunner.Runtime(folder, dtype="bfloat16", pooling_type="MEAN", compile="off", load_entrypoints=False)
    reference = poolrunner.Runtime(folder, dtype="float32", pooling_type="MEAN", compile="off", load_entrypoints=False)
    assert sum(type(m) is onednn.SplitGatedMLP for m in spy.model.modules()) == 3
    texts = ["a b c d e f g h i j k l m n o p q r s t", "b c", "z y x w v u t s r q p o n m l k j i h g f e d c b a"]
    expected = reference.embed(texts)
    got, own = cosine_rows(fast.embed(texts), expected), cosine_rows(eager.embed(texts), expected)
    assert got.min() >= 0.999 and got.min() >= own.min() - 1e-4, (got, own)


class _SwappedMLP(LlamaMLP):
    """The same function as ``LlamaMLP`` in other code: only known code is fused."""

    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


def test_a_gated_mlp_whose_activation_has_no_exact_post_op_is_left_as_it_is():
    parent, x = _mlp("gelu_new"), torch.randn(4, 32)
    with torch.inference_mode():
        expected = parent["mlp"](x)
        assert onednn.prepack(parent) == 3
        got = parent["mlp"](x)
    mlp = parent["mlp"]
    assert type(mlp) is LlamaMLP
    assert mlp.gate_proj.activation == mlp.up_proj.activation == onednn.NO_ACTIVATION
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_an_mlp_with_other_code_is_not_fused():
    parent, x = _mlp(), torch.randn(4, 32)
    parent["mlp"] = _SwappedMLP(parent["mlp"].config)
    with torch.inference_mode():
        expected = parent["mlp"](x)
        assert onednn.prepack(parent) == 3
        got = parent["mlp"](x)
    mlp = parent["mlp"]
    assert type(mlp) is _SwappedMLP and type(mlp.act_fn) is activations.SiLUActivation
    assert all(m.activation == onednn.NO_ACTIVATION for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_compile_auto_prepacks_the_backbone_and_off_leaves_it(model_path, st_model):
    """float32 layers are prepacked where oneDNN's products are the faster (AVX-512), else left
    to torch's; either way the vectors are sentence-transformers'."""
    texts = ["A packed weight changes nothing.", "Bias and GELU run inside the matmul."]
    expected = st_model.encode(texts, convert_to_numpy=True)
    # 6 layers x 4 products (query, key and value joined: core/model/bert_layers.py), and BERT's pooler
    auto = 25 if onednn.PACK_FLOAT32 else 0
    for mode, packed in (("auto", auto), ("off", 0)):
        spy = ModelSpy()  # the model served, as loaded
        runtime = poolrunner.Runtime(model_path, dtype="float32", compile=mode, load_entrypoints=False, plugins=[spy])
        assert sum(isinstance(m, onednn.PackedLinear) for m in spy.model.base_model.modules()) == packed
        torch.testing.assert_close(torch.from_numpy(runtime.embed(texts)), torch.from_numpy(expected),
                                   rtol=0, atol=2e-6)


def test_bf16_mixed_holds_the_bar_on_single_words(model_path, st_model, lee_docs):
    if not BF16_PRODUCTS:  # an AVX2-only CPU: refused at load, never run another way
        with pytest.raises(ModelLoadError) as error:
            poolrunner.Runtime(model_path, dtype="bf16-mixed", load_entrypoints=False)
        assert str(error.value) == _bf16_mixed_refusal("auto")
        return
    runtime = poolrunner.Runtime(model_path, dtype="bf16-mixed", load_entrypoints=False)
    assert (runtime.precision, runtime.dtype) == ("bf16-mixed", torch.float32)
    words = sorted(t for t in runtime.inputs.tokenizer.get_vocab() if t.isalpha() and len(t) >= 2)[::97][:300]
    texts = [*words, *lee_docs[:40]]
    cosines = cosine_rows(runtime.embed(texts), st_model.encode(texts, convert_to_numpy=True))
    assert cosines.min() >= MIN_COSINE


def test_bf16_mixed_is_refused_off_the_fast_path(model_path):
    with pytest.raises(ModelLoadError) as error:
        poolrunner.Runtime(model_path, dtype="bf16-mixed", compile="off", load_entrypoints=False)
    assert str(error.value) == _bf16_mixed_refusal("off")
    if BF16_PRODUCTS:
        assert poolrunner.Runtime(model_path, dtype="bf16-mixed", load_entrypoints=False).embed("next").shape == (384,)


class _FakeEngine:
    """An engine whose outputs are the reference (``output``, default a vector of ones) scaled by
    ``1 + error``."""

    def __init__(self, error: float, built: list[str], name: str, output: torch.Tensor | None = None) -> None:
        self.error = error
        self.output = torch.ones(4) if output is None else output
        self.runner = type("Runner", (), {"poolers": {"embed": None, "classify": None}})()
        built.append(name)

    def run(self, probes):
        return [(probe.request_id, self.output * (1 + self.error)) for probe in probes]


@pytest.mark.parametrize(("error", "chosen"), [(1.9e-4, "bfloat16"), (2.1e-4, "float32")])
def test_auto_judges_a_score_by_its_absolute_error(error, chosen):
    """A cross-encoder's one score near 0.5: 2.1e-4 relative (far inside the vector bar) is 1.05e-4
    absolute, past the score bar of 1e-4, so bf16 is refused."""
    errors = {"float32": 0.0, "bfloat16": error, "bf16-mixed": error}
    params = poolrunner.PoolingParams(task="classify")
    probes = [poolrunner.PoolingRequest(request_id="p", prompt_token_ids=[1, 2], params=params)]
    _, got = precision.choose_cpu_precision(
        lambda p: _FakeEngine(errors[p.name], [], p.name, torch.tensor([0.5])), probes)
    assert got.name == chosen


@pytest.mark.parametrize(("errors", "chosen", "built"), [
    ({"bfloat16": 0.01, "bf16-mixed": 0.001}, "bfloat16", ["float32", "bfloat16"]),
    ({"bfloat16": 0.02, "bf16-mixed": 0.001}, "bf16-mixed", ["float32", "bfloat16", "bf16-mixed"]),
    ({"bfloat16": 0.02, "bf16-mixed": 0.02}, "float32", ["float32", "bfloat16", "bf16-mixed", "float32"]),
])
def test_auto_keeps_the_fastest_candidate_that_holds_the_bar(errors, chosen, built):
    log: list[str] = []
    errors = {"float32": 0.0, **errors}
    params = poolrunner.PoolingParams(task="embed")
    probes = [poolrunner.PoolingRequest(request_id="p", prompt_token_ids=[1, 2], params=params)]
    _, got = precision.choose_cpu_precision(lambda p: _FakeEngine(errors[p.name], log, p.name), probes)
    assert got.name == chosen
    assert log == built


def test_a_decorated_forward_is_known_by_the_code_it_wraps():
    """transformers 5 wraps most attention and layer forwards (``deprecate_kwarg``; each layer's
    gradient-checkpointing wrapper), and a wrapper has the same bytecode and names whatever it
    wraps: keyed by its wrapper, a BERT layer would pass for a Llama decoder layer, and BERT's
    encoder for its self-attention."""
    from transformers.models.bert.modeling_bert import BertEncoder, BertLayer, BertSelfAttention
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.roberta.modeling_roberta import RobertaLayer

    def wrapper_key(kind: type) -> tuple[bytes, tuple[str, ...]]:
        return kind.forward.__code__.co_code, kind.forward.__code__.co_names

    for one, other in ((BertLayer, LlamaDecoderLayer), (BertEncoder, BertSelfAttention)):
        assert wrapper_key(one) == wrapper_key(other)
        assert onednn.code_key(one.forward) != onednn.code_key(other.forward)
    assert onednn.code_key(BertLayer.forward) == onednn.code_key(RobertaLayer.forward)  # a "Copied from" copy
    assert onednn.code_key(None) is None
