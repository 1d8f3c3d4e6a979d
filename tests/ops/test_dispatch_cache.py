"""The cached backend choice never differs from the uncached rules.

Each op has a nominal call that every backend serves, built feature by feature (layout and device
of each tensor, dtypes, None-ness, flags, sizes next to the limits the rules test); a call varies
some features away from the nominal. Each cached choice (``Op.choose``, one cache kept across all
calls of a test, so most calls are served by an entry an earlier, different call made) is compared
with ``Op.choose_uncached``, which runs every rule afresh:

* every call that varies one or two features (exhaustive): a key that misses a fact its rule
  reads makes such a call collide with one that differs in that fact alone, and get its answer
  (two, because some facts matter only once another one has changed, e.g. AITER's decode limits
  only for a decode batch);
* calls that vary a few more features at random (hypothesis).

Once with the backends of this machine, once with all of them available (AITER: the stand-in
module, verified by a selftest record for every op, and, like every backend in that mode, taking
tensors on any ONE device, so that meta tensors with strides past int32 reach the rules), so that
every backend's key is exercised.
Tensors live on the CPU or the ``meta`` device (no memory behind them); no op runs.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import atom_core.ops as ops_package
from atom_core.ops import dispatch, kv_cache, quant, scaled_mm, torch_scaled_mm
from atom_core.ops.dispatch import BackendUnavailable, Op
from tests.ops import fake_aiter
from tests.ops.test_comm import COMM_DISPATCH_ARGS
from tests.ops.test_dsa import DSA_DISPATCH_ARGS
from tests.ops.test_mla import MLA_DISPATCH_ARGS
from tests.ops.test_penalties import PENALTIES_DISPATCH_ARGS
from tests.ops.test_token_mask import TOKEN_MASK_DISPATCH_ARGS

FP8 = torch.float8_e4m3fn
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _real_ops() -> dict[str, Op]:
    """Every Op defined by a module of atom_core.ops."""
    found = {}
    for info in pkgutil.iter_modules(ops_package.__path__):
        module = importlib.import_module(f"atom_core.ops.{info.name}")
        found.update({op.name: op for op in vars(module).values() if isinstance(op, Op)})
    return found


OPS = _real_ops()


class Call:
    """Builds one call: each feature takes its nominal value unless ``alternative`` picks another."""

    def __init__(self, alternative: Callable[[int, tuple], object | None]):
        self._alternative = alternative
        self.options: list[tuple] = []  # the alternatives of each feature, in order of use
        self._devices = None

    def vary(self, nominal, *others):
        index = len(self.options)
        self.options.append(others)
        pick = self._alternative(index, others) if others else None
        return nominal if pick is None else pick

    def flag(self, nominal: bool) -> bool:
        return self.vary(nominal, not nominal)

    def _device(self) -> str:
        if self._devices is None:  # all on the CPU, all on meta, or the first on the CPU and the rest on meta
            mode = self.vary("cpu", "meta", "mixed")
            self._devices = iter(["cpu"] + ["meta"] * 99) if mode == "mixed" else iter([mode] * 100)
        return next(self._devices)

    def tensor(self, *shape, dtype=FP32):
        """Contiguous, or rows padded (last dim contiguous), or the last dim strided."""
        device = self._device()
        layout = self.vary("contiguous", "padded", "strided")
        if layout == "contiguous" or not shape:
            return torch.empty(shape, dtype=dtype, device=device)
        if layout == "padded":
            return torch.empty(*shape[:-1], shape[-1] + 3, dtype=dtype, device=device)[..., :shape[-1]]
        return torch.empty(*shape[:-1], shape[-1] * 2, dtype=dtype, device=device)[..., ::2]

    def maybe(self, present: bool, make):
        return make() if self.flag(present) else None


def _norm_args(c: Call, layer: bool):
    rows, hidden, dtype = c.vary(3, 1), c.vary(24, 8, 65537), c.vary(BF16, FP16, FP32)
    x, weight = c.tensor(rows, hidden, dtype=dtype), c.tensor(hidden, dtype=dtype)
    residual = c.maybe(False, lambda: c.tensor(rows, hidden, dtype=dtype))
    residual_out = None if residual is None else c.tensor(rows, hidden, dtype=dtype)
    out = c.tensor(rows, hidden, dtype=dtype)
    if layer:
        return x, weight, c.maybe(True, lambda: c.tensor(hidden, dtype=dtype)), 1e-5, residual, out, residual_out
    return x, weight, 1e-6, residual, c.flag(False), out, residual_out


def _activation_args(c: Call, name: str):
    rows, inter, dtype = c.vary(4, 1), c.vary(12, 4), c.vary(BF16, FP16, FP32)
    x, out = c.tensor(rows, 2 * inter, dtype=dtype), c.tensor(rows, inter, dtype=dtype)
    if name == "gelu_and_mul":
        return x, c.vary("none", "tanh"), out
    if name == "swiglu_clamped":
        return x, 1.702, 7.0, out
    return x, out


def _rms_norm_quant_args(c: Call):
    rows, hidden, dtype = c.vary(3, 1), c.vary(200, 96, 65537), c.vary(BF16, FP16, FP32)  # 65537: past one program
    x, weight = c.tensor(rows, hidden, dtype=dtype), c.tensor(hidden, dtype=c.vary(dtype, FP32))
    residual = c.maybe(False, lambda: c.tensor(rows, hidden, dtype=dtype))
    residual_out = None if residual is None else c.tensor(rows, hidden, dtype=dtype)
    group_size = c.vary(128, 64, hidden)
    q = c.tensor(rows, hidden, dtype=c.vary(FP8, torch.int8))
    normed = c.maybe(False, lambda: c.tensor(rows, hidden, dtype=dtype))
    return x, weight, 1e-6, residual, c.flag(False), group_size, q, c.tensor(rows, -(-hidden // group_size)), \
        residual_out, normed


def _silu_and_mul_quant_args(c: Call):
    rows, inter, dtype = c.vary(4, 1), c.vary(200, 96, 65537), c.vary(BF16, FP16, FP32)
    x = c.tensor(rows, 2 * inter, dtype=dtype)
    group_size = c.vary(128, 64, inter)
    q = c.tensor(rows, inter, dtype=c.vary(FP8, torch.int8))
    return x, group_size, q, c.tensor(rows, -(-inter // group_size))


def _rope_args(c: Call):
    tokens, rotary, dtype = c.vary(5, 1), c.vary(8, 2048), c.vary(BF16, FP16, FP32)
    head = rotary + c.vary(0, 8)
    if c.flag(False):  # q spans past int32 offsets (meta: no memory behind it)
        q = torch.empty(1, device="meta", dtype=dtype).as_strided((tokens, 2, head), (2**31, head, 1))
    else:
        q = c.tensor(tokens, c.vary(4, 1), head, dtype=dtype)
    k = c.tensor(tokens, c.vary(2, 1), head, dtype=dtype)
    cache = c.tensor(c.vary(40, 16), rotary, dtype=c.vary(FP32, dtype))
    return q, k, c.tensor(tokens, dtype=torch.int64), cache, c.flag(True)


def _qk_norm_rope_args(c: Call):
    tokens, rotary, dtype = c.vary(5, 1), c.vary(8, 2048), c.vary(BF16, FP16, FP32)
    head = rotary + c.vary(0, 8, 4096)  # 2048 + 4096: past triton's one-tile head
    q = c.tensor(tokens, c.vary(4, 1), head, dtype=dtype)
    k = c.tensor(tokens, c.vary(2, 1), head, dtype=dtype)
    q_weight, k_weight = (c.tensor(head, dtype=c.vary(dtype, FP32)) for _ in range(2))
    cache = c.tensor(c.vary(40, 16), rotary, dtype=c.vary(FP32, dtype))
    return q, k, q_weight, k_weight, c.tensor(tokens, dtype=torch.int64), cache, 1e-6, c.flag(True)


def _store_kv_args(c: Call):
    tokens, heads, head, dtype = c.vary(3, 1), c.vary(2, 1), c.vary(16, 8), c.vary(BF16, FP16, FP32)
    k, v = c.tensor(tokens, heads, head, dtype=dtype), c.tensor(tokens, heads, head, dtype=dtype)
    cache_dtype = c.vary(dtype, FP8)
    scales = c.maybe(False, lambda: (c.tensor(1), c.tensor(1))) or (None, None)
    if c.flag(False):  # one pool [NB, K|V, BS, Hk, D]: the caches' block stride spans two blocks
        pool = torch.empty(4, 2, 8, heads, head, dtype=cache_dtype, device=c._device())
        k_cache, v_cache = pool[:, 0], pool[:, 1]
    else:
        k_cache, v_cache = (c.tensor(4, 8, heads, head, dtype=cache_dtype) for _ in range(2))
    slot_mapping = c.tensor(tokens, dtype=torch.int64)
    return k, v, k_cache, v_cache, slot_mapping, *scales


def _rope_store_kv_args(c: Call):
    q, k, positions, cos_sin_cache, is_neox = _rope_args(c)
    _, v, k_cache, v_cache, slot_mapping, k_scale, v_scale = _store_kv_args(c)
    return q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, is_neox, k_scale, v_scale


def _attention_args(c: Call):
    rows, head, kv_heads, group = c.vary(3, 1), c.vary(128, 64, 96, 264), c.vary(2, 1), c.vary(4, 1, 32)
    max_seqlen_q = c.vary(1, 4)
    tokens = c.vary(rows, rows * max_seqlen_q, rows + 1)  # AITER's decode path needs one token per row
    dtype = c.vary(BF16, FP16, FP32)
    cache_dtype = c.vary(dtype, FP8)
    q = c.tensor(tokens, kv_heads * group, head, dtype=dtype)
    block_size = c.vary(16, 8, 32)
    k_cache, v_cache = (c.tensor(6, block_size, kv_heads, head, dtype=cache_dtype) for _ in range(2))
    block_tables, cu_seqlens_q = c.tensor(rows, 3, dtype=torch.int32), c.tensor(rows + 1, dtype=torch.int32)
    context_lens = c.tensor(rows, dtype=torch.int32)
    sliding_window, softcap = c.vary(None, 16), c.vary(0.0, 30.0)
    sinks = c.maybe(False, lambda: c.tensor(q.shape[1]))
    k_scale = c.maybe(False, lambda: c.tensor(1))
    v_scale = c.maybe(False, lambda: c.tensor(1))
    quantize = c.flag(False)  # paged_attention(quantize=True): fp8 out and a scale a head
    out = c.tensor(*q.shape, dtype=FP8 if quantize else dtype)
    out_scale = c.tensor(*q.shape[:2]) if quantize else None
    row_order = c.maybe(False, lambda: c.tensor(rows, dtype=torch.int32))
    return (q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, c.vary(40, 8), 0.125,
            sliding_window, softcap, sinks, k_scale, v_scale, out, out_scale, row_order)


def _sample_args(c: Call):
    rows = c.vary(3, 1)
    logits = c.tensor(rows, c.vary(50, 16), dtype=c.vary(BF16, FP16, FP32))
    row = lambda dtype: c.tensor(rows, dtype=dtype)  # noqa: E731
    return (logits, row(FP32), c.maybe(False, lambda: row(torch.int64)), c.maybe(False, lambda: row(FP32)),
            c.maybe(False, lambda: row(FP32)), row(torch.int64), row(torch.int64), row(torch.int64),
            c.maybe(False, lambda: row(FP32)))


def _rejection_args(c: Call):
    rows, drafts, vocab, dtype = c.vary(2, 1), c.vary(3, 1), c.vary(50, 16), c.vary(BF16, FP16, FP32)
    if c.flag(False):  # a transposed view: last dim strided, rows contiguous
        target = torch.empty(vocab, rows * (drafts + 1), dtype=dtype, device=c._device()).t()
    else:
        target = c.tensor(rows * (drafts + 1), vocab, dtype=dtype)
    return (c.tensor(rows, drafts, dtype=torch.int64), target, c.tensor(rows, drafts + 1, dtype=torch.int64),
            c.tensor(rows, dtype=torch.int32))


def _routing_args(c: Call, name: str):
    tokens, experts = c.vary(4, 1), c.vary(16, 8, 513)
    logits = c.tensor(tokens, experts, dtype=c.vary(BF16, FP16, FP32))
    outputs = c.tensor(tokens, 2, dtype=FP32), c.tensor(tokens, 2, dtype=torch.int32)
    if name == "topk_softmax":
        return logits, c.flag(True), *outputs
    if name == "gpt_oss_topk":
        return logits, *outputs
    groups = 1 if experts == 513 else c.vary(4, 1)
    bias = c.maybe(True, lambda: c.tensor(experts, dtype=FP32))
    return logits, groups, 1, c.flag(True), c.vary("sigmoid", "softmax"), bias, 1.0, *outputs


def _fused_experts_args(c: Call):
    tokens, hidden, experts, inter, top_k = c.vary(3, 1), 16, 4, 8, 2
    dtype = c.vary(BF16, FP16, FP32)
    hidden_states = c.tensor(tokens, hidden, dtype=dtype)
    w13, w2 = c.tensor(experts, 2 * inter, hidden, dtype=dtype), c.tensor(experts, hidden, inter, dtype=dtype)
    topk_weights = c.tensor(tokens, top_k, dtype=c.vary(FP32, BF16))
    topk_ids = c.tensor(tokens, top_k, dtype=c.vary(torch.int32, torch.int64))
    activation = c.vary("silu", "swiglu_clamped")
    w13_bias = c.maybe(False, lambda: c.tensor(experts, 2 * inter, dtype=dtype))
    w2_bias = c.maybe(False, lambda: c.tensor(experts, hidden, dtype=dtype))
    out = c.tensor(tokens, hidden, dtype=dtype)
    return hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_bias, w2_bias, out


def _fused_experts_quant_args(c: Call):
    tokens, experts, top_k = c.vary(3, 1), 4, 2
    hidden, inter = c.vary(128, 160), c.vary(128, 96)  # on / off the 128 grid (AITER's block fp8 needs it on)
    weight_format = c.vary("fp8_block", "fp8_channel", "mxfp4")
    dtype = c.vary(BF16, FP16, FP32)
    mxfp4 = weight_format == "mxfp4"
    w_dtype, s_dtype = (torch.uint8, torch.uint8) if mxfp4 else (FP8, FP32)

    def weight_and_scale(rows, cols):
        if mxfp4:
            return c.tensor(experts, rows, cols // 2, dtype=w_dtype), c.tensor(experts, rows, cols // 32, dtype=s_dtype)
        if weight_format == "fp8_channel":
            return c.tensor(experts, rows, cols, dtype=w_dtype), c.tensor(experts, rows, 1, dtype=s_dtype)
        return c.tensor(experts, rows, cols, dtype=w_dtype), c.tensor(experts, -(-rows // 128), -(-cols // 128))

    hidden_states = c.tensor(tokens, hidden, dtype=dtype)
    (w13, w13_scale), (w2, w2_scale) = weight_and_scale(2 * inter, hidden), weight_and_scale(hidden, inter)
    topk_weights = c.tensor(tokens, top_k, dtype=c.vary(FP32, BF16))
    topk_ids = c.tensor(tokens, top_k, dtype=c.vary(torch.int32, torch.int64))
    activation = c.vary("silu", "swiglu_clamped")
    w13_bias = c.maybe(False, lambda: c.tensor(experts, 2 * inter, dtype=dtype))
    w2_bias = c.maybe(False, lambda: c.tensor(experts, hidden, dtype=dtype))
    fp8 = not mxfp4
    hidden_q = c.maybe(False, lambda: c.tensor(tokens, hidden, dtype=FP8)) if fp8 else None
    groups = -(-hidden // 128) if weight_format == "fp8_block" else 1
    hidden_scale = None if hidden_q is None else c.tensor(tokens, groups)
    return (hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, weight_format, activation, w13_bias,
            w2_bias, c.tensor(tokens, hidden, dtype=dtype), hidden_q, hidden_scale)


def _quant_args(c: Call, name: str):
    rows, cols = c.vary(3, 1), c.vary(256, 200, 96)
    x = c.tensor(rows, cols, dtype=c.vary(BF16, FP16, FP32))
    q_dtype = c.vary(FP8, torch.int8)
    if name == "per_group_quant":
        group_size = c.vary(128, 64, 96, 256)
        return x, group_size, c.tensor(rows, cols, dtype=q_dtype), c.tensor(rows, -(-cols // group_size))
    scale = c.tensor(rows, 1) if name == "per_token_quant" else c.tensor(1)
    if name == "per_tensor_quant":
        return x, c.maybe(False, lambda: c.tensor(1)), c.tensor(rows, cols, dtype=q_dtype), scale
    return x, c.tensor(rows, cols, dtype=q_dtype), scale


def _scaled_mm_args(c: Call, name: str):
    m, n, k = c.vary(3, 1), c.vary(256, 48, 40), c.vary(256, 160, 100)
    q_dtype = FP8 if name == "scaled_mm_block" else c.vary(FP8, torch.int8)
    a, w = c.tensor(m, k, dtype=q_dtype), c.tensor(n, k, dtype=q_dtype)
    if name == "scaled_mm_block":
        a_scale, w_scale = c.tensor(m, -(-k // 128)), c.tensor(-(-n // 128), -(-k // 128))
    elif name == "scaled_mm_per_token":
        a_scale, w_scale = c.tensor(m, 1), c.tensor(n, 1)
    else:
        a_scale, w_scale = c.tensor(1), c.tensor(1)
    return a, a_scale, w, w_scale, c.maybe(False, lambda: c.tensor(n, dtype=BF16)), c.vary(BF16, FP16, FP32)


ARGS = {
    "rms_norm": lambda c: _norm_args(c, layer=False),
    "layer_norm": lambda c: _norm_args(c, layer=True),
    "silu_and_mul": lambda c: _activation_args(c, "silu_and_mul"),
    "gelu_and_mul": lambda c: _activation_args(c, "gelu_and_mul"),
    "swiglu_clamped": lambda c: _activation_args(c, "swiglu_clamped"),
    "rms_norm_quant": _rms_norm_quant_args,
    "silu_and_mul_quant": _silu_and_mul_quant_args,
    "apply_rope_": _rope_args,
    "qk_norm_rope_": _qk_norm_rope_args,
    "store_kv_": _store_kv_args,
    "rope_store_kv_": _rope_store_kv_args,
    "paged_attention": _attention_args,
    "sample": _sample_args,
    "rejection_sample_greedy": _rejection_args,
    "topk_softmax": lambda c: _routing_args(c, "topk_softmax"),
    "grouped_topk": lambda c: _routing_args(c, "grouped_topk"),
    "gpt_oss_topk": lambda c: _routing_args(c, "gpt_oss_topk"),
    "fused_experts": _fused_experts_args,
    "fused_experts_quant": _fused_experts_quant_args,
    "per_tensor_quant": lambda c: _quant_args(c, "per_tensor_quant"),
    "per_token_quant": lambda c: _quant_args(c, "per_token_quant"),
    "per_group_quant": lambda c: _quant_args(c, "per_group_quant"),
    "scaled_mm_per_tensor": lambda c: _scaled_mm_args(c, "scaled_mm_per_tensor"),
    "scaled_mm_per_token": lambda c: _scaled_mm_args(c, "scaled_mm_per_token"),
    "scaled_mm_block": lambda c: _scaled_mm_args(c, "scaled_mm_block"),
}
ARGS.update(MLA_DISPATCH_ARGS)  # the MLA and DSA ops' nominal calls live beside their tests
ARGS.update(DSA_DISPATCH_ARGS)
ARGS.update(PENALTIES_DISPATCH_ARGS)
ARGS.update(TOKEN_MASK_DISPATCH_ARGS)
ARGS.update(COMM_DISPATCH_ARGS)


def _nominal_options(name: str) -> list[tuple]:
    call = Call(lambda index, others: None)
    ARGS[name](call)
    return call.options


def _if_offered(pick, others):
    """``pick`` if this feature offers it: a present optional tensor brings features of its own, so
    the features after it shift, and a pick meant for one must not land on another."""
    return pick if any(type(o) is type(pick) and o == pick for o in others) else None


def _calls_varying_at_most_two_features(name: str):
    """Argument tuples of the nominal call and of every call that varies one or two of its features."""
    changes = [(feature, pick) for feature, others in enumerate(_nominal_options(name)) for pick in others]
    yield ARGS[name](Call(lambda index, others: None))
    for i, first in enumerate(changes):
        for second in [None, *changes[i + 1:]]:
            if second is not None and second[0] == first[0]:
                continue
            picks = dict([first] if second is None else [first, second])
            yield ARGS[name](Call(lambda index, others, picks=picks: _if_offered(picks.get(index), others)))


def _outcome(choose, *args, **kwargs):
    """The chosen backend, or the refusal's message."""
    try:
        return choose(*args, **kwargs)
    except BackendUnavailable as refusal:
        return f"BackendUnavailable: {refusal}"


def _assert_cached_equals_uncached(op: Op, args: tuple, preference: str | None) -> None:
    with dispatch.use_backend(preference):
        assert _outcome(op.choose, *args) == _outcome(op.choose_uncached, *args)
    for backend in dispatch.BACKENDS:
        assert _outcome(op.choose, *args, backend=backend) == _outcome(op.choose_uncached, *args, backend=backend)


def _on_one_device(backend, *tensors):
    """The device check of the "all backends" mode: any backend takes tensors on one device."""
    devices = {t.device.type for t in tensors if t is not None}
    return None if len(devices) <= 1 else f"mixed devices {sorted(devices)}"


@pytest.fixture(params=["this machine", "all backends"])
def availability(request, monkeypatch):
    """Fresh caches; with "all backends", every backend counts as available (AITER: the stand-in module)."""
    saved_targets = {name: {b: impl.target for b, impl in op._impls.items()} for name, op in OPS.items()}
    if request.param == "all backends":
        # A record in which AITER passed every op on both devices, so that auto chooses it too.
        write_record = request.getfixturevalue("selftest_record")
        passed = {"passed": True, "cases": 1, "refused": 0, "failures": []}
        for device in ("cpu", "meta"):
            write_record({name: {"aiter": passed} for name in OPS}, device=device)
        fake_aiter.install(monkeypatch, {})
        monkeypatch.setattr(dispatch, "backend_available", lambda name: True)
        monkeypatch.setattr(dispatch, "on_device_for", _on_one_device)
        monkeypatch.setattr(kv_cache, "_aiter_fp8_is_e4m3fn", lambda device: False)  # an fp8 pool refuses AITER
        for module in (quant, scaled_mm, torch_scaled_mm):  # fp8 GEMMs and quantization: every rule reached
            monkeypatch.setattr(module, "fp8_e4m3fn_native", lambda device: True)
        monkeypatch.setattr(torch_scaled_mm, "_is_nvidia_sm90", lambda device: True)
    for op in OPS.values():
        op.clear_cache()
    yield request.param
    for name, op in OPS.items():  # adapters loaded against the stand-in must not outlive it
        for backend, target in saved_targets[name].items():
            op._impls[backend].target = target
        op.clear_cache()


def test_every_op_has_a_nominal_call():
    assert set(OPS) == set(ARGS)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_cached_choice_equals_uncached_for_every_change_of_one_or_two_features(availability, name):
    for preference in (None, "aiter"):
        for args in _calls_varying_at_most_two_features(name):
            _assert_cached_equals_uncached(OPS[name], args, preference)


@pytest.mark.parametrize("name", sorted(ARGS))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cached_choice_equals_uncached_for_random_feature_changes(availability, name, data):
    deviations = data.draw(st.sets(st.integers(0, len(_nominal_options(name)) - 1), max_size=4), label="features")
    args = ARGS[name](Call(lambda index, others: data.draw(st.sampled_from(others)) if index in deviations else None))
    _assert_cached_equals_uncached(OPS[name], args, data.draw(st.sampled_from([None, *dispatch.BACKENDS])))


def test_in_the_all_backends_mode_auto_chooses_the_verified_aiter(availability):
    args = ARGS["rms_norm"](Call(lambda index, others: None))
    # the nominal call's tensors are on the CPU: Triton serves them only in its interpreter
    here = "triton" if dispatch.backend_available("triton") and dispatch.triton_interpret() else "torch"
    assert OPS["rms_norm"].choose(*args) == ("aiter" if availability == "all backends" else here)
