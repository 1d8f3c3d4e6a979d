import importlib
import math

import pytest
import torch

from atom_core.ops.dispatch import BackendUnavailable, backend_available, trace_backends
from atom_core.ops.reference import rope as reference
from atom_core.ops.rope import apply_rope_, rope_cos_sin_cache
from atom_core.ops.tolerances import tolerance
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, DTYPES, ON_GPU, needs_triton, rand

# ---------------------------------------------------------------- the cos/sin cache


def test_default_cache_by_hand():
    # R = 4, base 100: inv_freq = [100**0, 100**(-2/4)] = [1, 0.1]. Row p = [cos p, cos 0.1p, sin p, sin 0.1p].
    cache, scale = rope_cos_sin_cache(4, 3, 100.0)
    want = torch.tensor([[math.cos(p), math.cos(0.1 * p), math.sin(p), math.sin(0.1 * p)] for p in range(3)])
    torch.testing.assert_close(cache, want)
    assert scale == 1.0


def test_linear_scaling_divides_positions_by_hand():
    # factor 2: position 2 of the scaled table is position 1 of the plain one.
    plain, _ = rope_cos_sin_cache(4, 3, 100.0)
    scaled, _ = rope_cos_sin_cache(4, 3, 100.0, {"rope_type": "linear", "factor": 2.0})
    torch.testing.assert_close(scaled[2], plain[1])


def test_yarn_attention_scale_by_hand():
    # factor 4: 0.1 * ln 4 + 1; with mscale 1 and mscale_all_dim 0.5: (0.1 ln4 + 1) / (0.05 ln4 + 1).
    base = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    _, scale = rope_cos_sin_cache(8, 4, 10000.0, base)
    assert scale == pytest.approx(0.1 * math.log(4) + 1)
    _, ratio = rope_cos_sin_cache(8, 4, 10000.0, {**base, "mscale": 1.0, "mscale_all_dim": 0.5})
    assert ratio == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    cache, _ = rope_cos_sin_cache(8, 4, 10000.0, base)
    assert cache[0, :4].tolist() == pytest.approx([scale] * 4)  # cos(0) * scale: the scale is folded in


HF_SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"type": "linear", "factor": 2.5},  # the older key
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "attention_factor": 1.25},
]


@pytest.mark.parametrize("scaling", HF_SCALINGS, ids=lambda s: "default" if s is None else str(s))
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_cache_matches_hf_rotary_embedding(scaling, rotary_dim):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    base, max_position = 50000.0, 1024
    rope_parameters = {"rope_type": "default", "rope_theta": base}
    if scaling is not None:
        rope_parameters = {**{k: v for k, v in scaling.items() if k != "type"},
                           "rope_type": scaling.get("rope_type", scaling.get("type")), "rope_theta": base}
    # HF derives its rotary dim from head_dim (x partial_rotary_factor); rotary_dim plays head_dim here.
    config = transformers.LlamaConfig(hidden_size=4 * rotary_dim, num_attention_heads=4, head_dim=rotary_dim,
                                      max_position_embeddings=max_position, rope_parameters=rope_parameters)
    hf = LlamaRotaryEmbedding(config)
    positions = torch.arange(max_position)[None]
    hf_cos, hf_sin = hf(torch.zeros(1, max_position, rotary_dim), positions)  # [1, P, R], halves repeated

    cache, attention_scale = rope_cos_sin_cache(rotary_dim, max_position, base, scaling)
    half = rotary_dim // 2
    assert attention_scale == pytest.approx(hf.attention_scaling)
    torch.testing.assert_close(cache[:, :half], hf_cos[0, :, :half])
    torch.testing.assert_close(cache[:, half:], hf_sin[0, :, :half])
    torch.testing.assert_close(hf_cos[0, :, half:], hf_cos[0, :, :half])  # HF's layout: the halves repeat


@pytest.mark.parametrize("original", [1024, 256], ids=["short_factors", "long_factors"])
@pytest.mark.parametrize("attention_factor", [None, 1.25])
def test_longrope_cache_matches_hf_phi3_rotary_embedding_over_a_forward_of_every_position(original, attention_factor):
    """transformers picks a forward's factors by its longest position: over all 1,024 positions of the table,
    long when the table passes the pretraining length, short when it does not, as the table's rule."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rotary_dim, max_position, base = 32, 1024, 10000.0
    gen = torch.Generator().manual_seed(0)
    short, long = (1 + 3 * torch.rand(rotary_dim // 2, generator=gen)).tolist(), \
        (1 + 30 * torch.rand(rotary_dim // 2, generator=gen)).tolist()
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": original,
               **({} if attention_factor is None else {"attention_factor": attention_factor})}
    config = transformers.Phi3Config(hidden_size=4 * rotary_dim, num_attention_heads=4, vocab_size=64,
                                     max_position_embeddings=max_position, original_max_position_embeddings=original,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     rope_parameters={**scaling, "rope_theta": base})
    hf = Phi3RotaryEmbedding(config)
    hf_cos, hf_sin = hf(torch.zeros(1, max_position, rotary_dim), torch.arange(max_position)[None])

    cache, attention_scale = rope_cos_sin_cache(rotary_dim, max_position, base, scaling)
    half = rotary_dim // 2
    assert attention_scale == pytest.approx(hf.attention_scaling)
    assert (attention_scale == 1.25) if attention_factor else (attention_scale > 1.0) == (original < max_position)
    torch.testing.assert_close(cache[:, :half], hf_cos[0, :, :half])
    torch.testing.assert_close(cache[:, half:], hf_sin[0, :, :half])


def test_cache_dtype_and_device():
    cache, _ = rope_cos_sin_cache(8, 5, 10000.0, dtype=torch.bfloat16, device=DEVICE)
    assert cache.dtype == torch.bfloat16 and cache.device.type == torch.device(DEVICE).type
    assert cache.shape == (5, 8)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rotary_dim=7, max_position=4, base=1e4), "rotary_dim must be a positive even int"),
        (dict(rotary_dim=8, max_position=0, base=1e4), "max_position must be a positive int"),
        (dict(rotary_dim=8, max_position=4, base=1.0), "base must be a number > 1"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling=[("factor", 2)]), "scaling must be a dict"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "dynamic", "factor": 2.0}),
         "unsupported rope_type 'dynamic'"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "linear"}), r"scaling\['factor'\]"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "llama3", "factor": 8.0}),
         r"scaling\['low_freq_factor'\]"),
        (dict(rotary_dim=8, max_position=4, base=1e4, dtype=torch.int32), "dtype must be a floating"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "linear", "factor": 0}),
         r"scaling\['factor'\] must be a finite number > 0 for rope_type 'linear', got 0"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "yarn", "factor": -2.0,
                                                                 "original_max_position_embeddings": 2}),
         r"scaling\['factor'\] must be a finite number > 0"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "yarn", "factor": 2.0,
                                                                 "original_max_position_embeddings": 0}),
         r"scaling\['original_max_position_embeddings'\] must be a finite number > 0"),
        (dict(rotary_dim=8, max_position=4, base=1e4, scaling={"rope_type": "longrope", "long_factor": [1.0] * 4,
                                                                 "short_factor": [1.0, 0.0, 1.0, 1.0],
                                                                 "original_max_position_embeddings": 8}),
         r"scaling\['short_factor'\] must hold finite numbers > 0"),
    ],
)
def test_cache_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        rope_cos_sin_cache(**kwargs)


# ---------------------------------------------------------------- the rotation: twin


def test_twin_rotation_by_hand():
    # One head, D = 6, R = 4, position 1 of a table with inv_freq [1, 0.1] (R = 4, base 100).
    cache, _ = rope_cos_sin_cache(4, 2, 100.0)
    c0, s0, c1, s1 = math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]]])
    pos = torch.tensor([1])
    # NeoX pairs (x0, x2) at angle 1 and (x1, x3) at angle 0.1; (a, b) -> (a c - b s, b c + a s).
    q, k = x.clone(), x.clone()
    reference.apply_rope_(q, k, pos, cache, is_neox=True)
    want = [1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0, 4 * c1 + 2 * s1, 5.0, 6.0]
    torch.testing.assert_close(q[0, 0], torch.tensor(want))
    torch.testing.assert_close(k, q)
    # GPT-J pairs (x0, x1) at angle 1 and (x2, x3) at angle 0.1.
    q = x.clone()
    reference.apply_rope_(q, x.clone(), pos, cache, is_neox=False)
    want = [1 * c0 - 2 * s0, 2 * c0 + 1 * s0, 3 * c1 - 4 * s1, 4 * c1 + 3 * s1, 5.0, 6.0]
    torch.testing.assert_close(q[0, 0], torch.tensor(want))


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_twin_matches_hf_apply_rotary_pos_emb_neox(rotary_dim):
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    num_tokens, hq, hk, head_size = 11, 4, 2, 64
    cache, _ = rope_cos_sin_cache(rotary_dim, 300, 10000.0)
    positions = torch.randint(0, 300, (num_tokens,), generator=g)
    q, k = torch.randn(num_tokens, hq, head_size, generator=g), torch.randn(num_tokens, hk, head_size, generator=g)
    # HF: q, k [B, H, S, R]; cos, sin [B, S, R] with the halves repeated.
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    hf_q, hf_k = apply_rotary_pos_emb(q[..., :rotary_dim].transpose(0, 1)[None],
                                      k[..., :rotary_dim].transpose(0, 1)[None], cos, sin)
    want_q = torch.cat([hf_q[0].transpose(0, 1), q[..., rotary_dim:]], -1)
    want_k = torch.cat([hf_k[0].transpose(0, 1), k[..., rotary_dim:]], -1)
    reference.apply_rope_(q, k, positions, cache, is_neox=True)
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)


def test_twin_matches_hf_gptj_rotary():
    pytest.importorskip("transformers")
    from transformers.models.gptj import modeling_gptj

    g = torch.Generator().manual_seed(1)
    num_tokens, heads, head_size, rotary_dim, max_position = 9, 3, 32, 16, 100
    sincos = modeling_gptj.create_sinusoidal_positions(max_position, rotary_dim)  # [P, R]: sin | cos, base 1e4
    positions = torch.randint(0, max_position, (num_tokens,), generator=g)
    x = torch.randn(num_tokens, heads, head_size, generator=g)
    sin, cos = sincos[positions].chunk(2, dim=-1)  # [T, R/2]
    # HF GPT-J: tensor [B, S, H, R], sin / cos [B, S, R/2].
    hf = modeling_gptj.apply_rotary_pos_emb(x[None, :, :, :rotary_dim], sin[None], cos[None])[0]
    cache, _ = rope_cos_sin_cache(rotary_dim, max_position, 10000.0)
    q, k = x.clone(), x[:, :1].clone()
    reference.apply_rope_(q, k, positions, cache, is_neox=False)
    torch.testing.assert_close(q[..., :rotary_dim], hf)
    torch.testing.assert_close(q[..., rotary_dim:], x[..., rotary_dim:])


# ---------------------------------------------------------------- Triton kernel vs twin

# (tokens, q heads, kv heads, head size, rotary dim): decode, odd sizes, partial rotary, GQA shapes.
# The last CPU shape has more query heads than one tile holds at R = 512, so the head loop runs twice.
SHAPES = [(1, 4, 2, 64, 64), (19, 3, 1, 48, 32), (99, 2, 2, 111, 56), (3, 12, 2, 512, 512)]
if ON_GPU:
    SHAPES += [(989, 32, 8, 128, 128), (4096, 32, 8, 128, 128), (257, 16, 2, 256, 64), (33, 64, 4, 128, 128)]


def _q_k_views(qkv, hq, hk, head_size):
    """q and k as head views of a fused qkv buffer [T, (Hq + 2 Hk) D + pad]: strided token rows."""
    num_tokens = qkv.shape[0]
    q = qkv[:, : hq * head_size].view(num_tokens, hq, head_size)
    k = qkv[:, hq * head_size: (hq + hk) * head_size].view(num_tokens, hk, head_size)
    return q, k


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("is_neox", [True, False])
def test_triton_matches_twin_on_fused_qkv_views(dtype, shape, is_neox):
    num_tokens, hq, hk, head_size, rotary_dim = shape
    g = torch.Generator().manual_seed(num_tokens * head_size + rotary_dim)
    qkv = rand(num_tokens, (hq + 2 * hk) * head_size + 8, dtype=dtype, generator=g)
    cache, _ = rope_cos_sin_cache(rotary_dim, 5000, 10000.0, device=DEVICE)
    positions = torch.randint(0, 5000, (num_tokens,), generator=g).to(DEVICE)
    want = qkv.clone()
    reference.apply_rope_(*_q_k_views(want, hq, hk, head_size), positions, cache, is_neox=is_neox)
    with trace_backends() as calls:
        apply_rope_(*_q_k_views(qkv, hq, hk, head_size), positions, cache, is_neox=is_neox, backend="triton")
    assert calls == [("apply_rope_", "triton")]
    torch.testing.assert_close(qkv, want, **tolerance(dtype))  # v and the padding are untouched too


@needs_triton
def test_triton_strided_heads_and_bf16_cache():
    # Heads strided inside a token (head stride D + 6), a bf16 table, positions at the table's ends
    # read through a strided view.
    g = torch.Generator().manual_seed(3)
    q = rand(5, 3, 70, generator=g)[..., :64]
    k = rand(5, 2, 64, generator=g)
    cache, _ = rope_cos_sin_cache(64, 77, 10000.0, dtype=torch.bfloat16, device=DEVICE)
    positions = torch.tensor([0, 9, 76, 9, 1, 9, 75, 9, 38], device=DEVICE)[::2]
    want_q, want_k = q.clone(), k.clone()
    reference.apply_rope_(want_q, want_k, positions, cache)
    apply_rope_(q, k, positions, cache, backend="triton")
    torch.testing.assert_close(q, want_q, **tolerance(torch.float32))
    torch.testing.assert_close(k, want_k, **tolerance(torch.float32))


@pytest.mark.parametrize("backend", [b for b in ("torch", "triton") if backend_available(b)])
def test_empty_batch_is_a_no_op(backend):
    # q and k: zero-token views into a fused qkv buffer, so a write anywhere near them would show.
    cache, _ = rope_cos_sin_cache(8, 4, 10000.0, device=DEVICE)
    qkv = rand(3, (2 + 2 * 1) * 8, generator=torch.Generator().manual_seed(0))
    before, cache_before = qkv.clone(), cache.clone()
    q, k = _q_k_views(qkv[:0], 2, 1, 8)
    with trace_backends() as calls:
        result = apply_rope_(q, k, torch.empty(0, dtype=torch.int64, device=DEVICE), cache, backend=backend)
    assert calls == [("apply_rope_", backend)] and result is None
    assert torch.equal(qkv, before) and torch.equal(cache, cache_before)


def test_non_contiguous_head_dim_falls_back_to_torch_unless_triton_named():
    cache, _ = rope_cos_sin_cache(8, 4, 10000.0, device=DEVICE)
    q = torch.randn(3, 2, 16, device=DEVICE)[..., ::2]  # head dim stride 2
    k = torch.randn(3, 1, 8, device=DEVICE)
    positions = torch.tensor([0, 1, 3], device=DEVICE)
    want_q, want_k = q.clone(), k.clone()
    reference.apply_rope_(want_q, want_k, positions, cache)
    with trace_backends() as calls:
        apply_rope_(q, k, positions, cache)
    assert calls == [("apply_rope_", "torch")]
    torch.testing.assert_close(q, want_q)
    if backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="head dim of q and k contiguous"):
            apply_rope_(q, k, positions, cache, backend="triton")


def test_compiles_with_fullgraph_on_fused_qkv_views():
    cache, _ = rope_cos_sin_cache(8, 16, 10000.0)
    positions = torch.tensor([3, 15])

    def step(qkv):
        apply_rope_(*_q_k_views(qkv, 2, 1, 8), positions, cache, backend="torch")  # q, k alias one buffer
        return qkv * 1.0

    qkv = torch.randn(2, 32)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(qkv.clone())
    torch.testing.assert_close(got, step(qkv.clone()))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: apply_rope_(torch.randn(2, 8), torch.randn(2, 1, 8), torch.arange(2), c), "q must have 3 dims"),
        (lambda c: apply_rope_(torch.randn(2, 2, 8), torch.randn(2, 1, 8).half(), torch.arange(2), c), "k dtype"),
        (lambda c: apply_rope_(torch.randn(2, 2, 8), torch.randn(3, 1, 8), torch.arange(2), c), "k must have shape"),
        (lambda c: apply_rope_(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.arange(2).int(), c),
         "positions dtype"),
        (lambda c: apply_rope_(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.arange(3), c),
         "positions must have shape"),
        (lambda c: apply_rope_(torch.randn(2, 2, 4), torch.randn(2, 1, 4), torch.arange(2), c),
         "cos_sin_cache must have an even number of columns"),
        (lambda c: apply_rope_(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.arange(2), c[:, :5]),
         "cos_sin_cache must have an even number of columns"),
        (lambda c: apply_rope_(torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.arange(2), c, backend="gpu"),
         "unknown backend"),
    ],
)
def test_bad_arguments_are_named(call, match):
    cache, _ = rope_cos_sin_cache(8, 4, 10000.0)
    with pytest.raises((ValueError, TypeError), match=match):
        call(cache)


# ---------------------------------------------------------------- AITER adapter


def _aiter_rope_semantics(input_x, input_y, cos, sin, positions, rotate_style, reuse_freqs_front_part, nope_first):
    """AITER's documented behaviour on sbhd tensors, with cos/sin read as packed [rows, d/2] tables."""
    assert reuse_freqs_front_part and not nope_first
    assert positions.dtype == torch.int64 and positions.dim() == 2 and positions.stride(1) == 1
    assert cos.is_contiguous() and sin.is_contiguous() and cos.dim() == sin.dim() == 4
    c = cos.reshape(cos.shape[0], -1)[positions][:, :, None, :]  # [s, b, 1, d/2]
    s = sin.reshape(sin.shape[0], -1)[positions][:, :, None, :]
    for x in (input_x, input_y):
        if rotate_style == 0:
            a, b = x.float().chunk(2, dim=-1)
            x.copy_(torch.cat([a * c - b * s, b * c + a * s], dim=-1))
        else:
            a, b = x[..., 0::2].float(), x[..., 1::2].float()
            rotated = torch.empty_like(x, dtype=torch.float32)
            rotated[..., 0::2], rotated[..., 1::2] = a * c - b * s, b * c + a * s
            x.copy_(rotated)


@pytest.mark.parametrize("is_neox", [True, False])
def test_aiter_adapter_argument_mapping(monkeypatch, is_neox):
    fake = fake_aiter.install(monkeypatch, {"rope_cached_positions_2c_fwd_inplace": _aiter_rope_semantics})
    aiter_rope = importlib.import_module("atom_core.ops.aiter.rope")  # fresh: bound to this fake

    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(6, (4 + 2 * 2) * 32, generator=g)
    q, k = qkv[:, :128].view(6, 4, 32), qkv[:, 128:192].view(6, 2, 32)
    cache, _ = rope_cos_sin_cache(16, 50, 10000.0)  # partial rotary: 16 of 32 dims
    positions = torch.tensor([0, 49, 7, 7, 20, 1])
    want = qkv.clone()
    reference.apply_rope_(want[:, :128].view(6, 4, 32), want[:, 128:192].view(6, 2, 32), positions, cache,
                          is_neox=is_neox)
    aiter_rope.apply_rope_(q, k, positions, cache, is_neox)
    torch.testing.assert_close(qkv, want)
    (name, args), = fake.calls
    assert args["rotate_style"] == (0 if is_neox else 1)
    assert args["input_x"].shape == (1, 6, 4, 16) and args["input_y"].shape == (1, 6, 2, 16)
    assert args["cos"].data_ptr() == cache.data_ptr()  # the table is viewed, not copied


def test_aiter_refuses_what_it_cannot_index():
    from atom_core.ops import rope as rope_module

    cache, _ = rope_cos_sin_cache(8, 4, 10000.0)
    q, k, positions = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.arange(2)
    assert rope_module._aiter_supports(q, k, positions, cache, True) is None
    assert "contiguous cos_sin_cache" in rope_module._aiter_supports(q, k, positions, cache[::2], True)
    assert "head dim" in rope_module._aiter_supports(torch.randn(2, 2, 16)[..., ::2], k, positions, cache, True)
