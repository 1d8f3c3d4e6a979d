"""MoE routing: hand-computed anchors (ties, eliminated groups, a bias that moves the choice but not
the weights), the twins against HF transformers' own routers, Triton against the twins, the AITER
argument mapping, validation and torch.compile."""

# T tokens, E experts, K top-k, H hidden, I intermediate

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from atom_core.ops import moe_routing
from atom_core.ops.dispatch import BackendUnavailable
from atom_core.ops.moe_routing import gpt_oss_topk, grouped_topk, topk_softmax
from atom_core.ops.reference import moe as reference
from tests.ops import fake_aiter
from tests.ops.conftest import DEVICE, ON_GPU, needs_gpu, needs_triton, non_contiguous_rows, rand

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
WEIGHT_TOL = {"atol": 1e-6, "rtol": 1e-5}  # fp32 weights: different exp/sigmoid/sum rounding only


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def logits_of(*rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype, device=DEVICE)


def assert_routing(got, weights, ids):
    got_weights, got_ids = got
    assert got_weights.dtype == torch.float32 and got_ids.dtype == torch.int32
    assert got_ids.cpu().tolist() == ids
    torch.testing.assert_close(got_weights.cpu(), torch.tensor(weights), **WEIGHT_TOL)


def by_expert(weights, ids):
    """Rows reordered by expert id: compares routings whose order within a row is unspecified (HF's sorted=False)."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


def assert_same_choice(got, want, choice, tol=1e-6):
    """``got`` chose experts as good as ``want``'s (equal choice values, up to near-ties of ``tol``),
    and where both chose the same experts the weights agree."""
    (got_w, got_i), (want_w, want_i) = got, want
    torch.testing.assert_close(choice.gather(1, got_i.long()), choice.gather(1, want_i.long()), atol=tol, rtol=0)
    same = (got_i == want_i).all(dim=1)
    assert same.float().mean() > 0.95, "more than a few rows differ: not near-ties"
    torch.testing.assert_close(got_w[same], want_w[same], **WEIGHT_TOL)


# ----------------------------------------------------------------------------------------------- anchors

@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_softmax_anchors(backend):
    # logits = log([1, 3, 2, 4]) → probs [0.1, 0.3, 0.2, 0.4]; top-2 = experts 3, 1.
    logits = logits_of([math.log(v) for v in (1, 3, 2, 4)])
    assert_routing(topk_softmax(logits, 2, renormalize=False, backend=backend), [[0.4, 0.3]], [[3, 1]])
    # renormalised: 0.4 / 0.7, 0.3 / 0.7
    assert_routing(topk_softmax(logits, 2, renormalize=True, backend=backend), [[4 / 7, 3 / 7]], [[3, 1]])
    # ties go to the lower index: logits [1, 3, 3, 0] → experts 1 then 2, renormalised weights 1/2 each.
    tied = logits_of([1.0, 3.0, 3.0, 0.0])
    assert_routing(topk_softmax(tied, 2, renormalize=True, backend=backend), [[0.5, 0.5]], [[1, 2]])
    # all equal: the K lowest indices.
    _, ids = topk_softmax(torch.zeros(1, 6, device=DEVICE), 3, renormalize=True, backend=backend)
    assert ids.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_topk_groups_eliminate_experts(backend):
    # E = 8 in G = 4 groups of 2: logits [5, 4 | 3.5, 0 | 3, 3 | -1, 0], keep 2 groups, K = 3.
    logits = logits_of([5.0, 4.0, 3.5, 0.0, 3.0, 3.0, -1.0, 0.0])
    # No bias: a group scores its best logit: 5, 3.5, 3, 0 → groups 0 and 1 → experts 0, 1, 2.
    # Weights = sigmoid scores, renormalised, times 2.5.
    s = [sigmoid(5), sigmoid(4), sigmoid(3.5)]
    got = grouped_topk(logits, 3, num_expert_group=4, topk_group=2, renormalize=True, scoring="sigmoid",
                       routed_scaling_factor=2.5, backend=backend)
    assert_routing(got, [[2.5 * v / sum(s) for v in s]], [[0, 1, 2]])
    # A (zero) bias switches to "sum of the group's two best": σ5+σ4 = 1.975, σ3.5+σ0 = 1.471,
    # σ3+σ3 = 1.905, σ(-1)+σ0 = 0.769 → groups 0 and 2 → experts 0, 1, then 4 (tied with 5: lower index).
    s = [sigmoid(5), sigmoid(4), sigmoid(3)]
    got = grouped_topk(logits, 3, num_expert_group=4, topk_group=2, renormalize=True, scoring="sigmoid",
                       e_score_correction_bias=torch.zeros(8, device=DEVICE), routed_scaling_factor=2.5,
                       backend=backend)
    assert_routing(got, [[2.5 * v / sum(s) for v in s]], [[0, 1, 4]])
    # Softmax scoring, no renormalisation: weights are the probs over all 8 experts.
    z = sum(math.exp(v) for v in (5.0, 4.0, 3.5, 0.0, 3.0, 3.0, -1.0, 0.0))
    got = grouped_topk(logits, 3, num_expert_group=4, topk_group=2, renormalize=False, scoring="softmax",
                       backend=backend)
    assert_routing(got, [[math.exp(5) / z, math.exp(4) / z, math.exp(3.5) / z]], [[0, 1, 2]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_moves_the_choice_not_the_weights(backend):
    # logits [2, 1, 0, -1], bias [0, 0, 0, 5]: choice σ2 = .88, σ1 = .73, .5, σ(-1) + 5 = 5.27 → experts 3, 0.
    # Weights are the unbiased scores σ(-1), σ2.
    logits = logits_of([2.0, 1.0, 0.0, -1.0])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0], device=DEVICE)
    got = grouped_topk(logits, 2, num_expert_group=1, topk_group=1, renormalize=False, scoring="sigmoid",
                       e_score_correction_bias=bias, backend=backend)
    assert_routing(got, [[sigmoid(-1), sigmoid(2)]], [[3, 0]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_oss_topk_anchor(backend):
    # top-2 logits of [1, 3, 2, 0] are 3 (expert 1) and 2 (expert 2): softmax([3, 2]) = [e/(e+1), 1/(e+1)].
    got = gpt_oss_topk(logits_of([1.0, 3.0, 2.0, 0.0]), 2, backend=backend)
    assert_routing(got, [[math.e / (math.e + 1), 1 / (math.e + 1)]], [[1, 2]])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    weights, ids = topk_softmax(torch.empty(0, 8, device=DEVICE), 2, renormalize=True, backend=backend)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


# ------------------------------------------------------------------------------------ HF transformers

def hf_router(module_path: str, class_name: str, config_name: str, **config):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, config_name)(hidden_size=16, num_attention_heads=4, num_key_value_heads=4, **config)
    router = getattr(importlib.import_module(module_path), class_name)(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if getattr(router, "bias", None) is not None:
            router.bias.copy_(torch.randn(router.bias.shape, generator=g))
        if getattr(router, "e_score_correction_bias", None) is not None:
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.e_score_correction_bias.shape, generator=g))
    return router, torch.randn(19 if ON_GPU else 5, 16, generator=g)  # the interpreter pays per token


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_matches_hf_qwen3_moe_router(backend, norm_topk_prob):
    router, h = hf_router("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeConfig",
                          num_experts=32, num_experts_per_tok=4, norm_topk_prob=norm_topk_prob)
    logits, weights, ids = router(h)
    got_w, got_i = topk_softmax(logits.detach().to(DEVICE), 4, renormalize=norm_topk_prob, backend=backend)
    assert got_i.cpu().tolist() == ids.tolist()
    torch.testing.assert_close(got_w.cpu(), weights.detach(), **WEIGHT_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_hf_mixtral_router(backend):
    router, h = hf_router("transformers.models.mixtral.modeling_mixtral", "MixtralTopKRouter", "MixtralConfig",
                          num_local_experts=8, num_experts_per_tok=2)
    logits, weights, ids = router(h)
    got_w, got_i = topk_softmax(logits.detach().to(DEVICE), 2, renormalize=True, backend=backend)
    assert got_i.cpu().tolist() == ids.tolist()
    torch.testing.assert_close(got_w.cpu(), weights.detach(), **WEIGHT_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_hf_gpt_oss_router(backend):
    router, h = hf_router("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssTopKRouter", "GptOssConfig",
                          num_local_experts=32, num_experts_per_tok=4)
    logits, weights, ids = router(h)  # logits include the router's bias
    got_w, got_i = gpt_oss_topk(logits.detach().to(DEVICE), 4, backend=backend)
    assert got_i.cpu().tolist() == ids.tolist()
    torch.testing.assert_close(got_w.cpu(), weights.detach(), **WEIGHT_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_matches_hf_sigmoid_grouped_routers(backend, family, norm_topk_prob):
    module, cls, cfg = {
        "deepseek_v3": ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3TopkRouter",
                        "DeepseekV3Config"),
        "glm4_moe": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeTopkRouter", "Glm4MoeConfig"),
    }[family]
    router, h = hf_router(module, cls, cfg, n_routed_experts=32, num_experts_per_tok=6, n_group=8, topk_group=3,
                          norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    logits, weights, ids = router(h)
    got = grouped_topk(logits.detach().to(DEVICE), 6, num_expert_group=8, topk_group=3, renormalize=norm_topk_prob,
                       scoring="sigmoid", e_score_correction_bias=router.e_score_correction_bias.to(DEVICE),
                       routed_scaling_factor=2.5, backend=backend)
    got_w, got_i = by_expert(got[0].cpu(), got[1].cpu())
    want_w, want_i = by_expert(weights.detach(), ids)  # HF's top-k is unsorted
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, **WEIGHT_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_hf_deepseek_v2_group_limited_greedy(backend):
    router, h = hf_router("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2TopkRouter",
                          "DeepseekV2Config", n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                          topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    logits, weights, ids = router(h)
    got = grouped_topk(logits.detach().to(DEVICE), 4, num_expert_group=4, topk_group=2, renormalize=False,
                       scoring="softmax", routed_scaling_factor=1.5, backend=backend)
    got_w, got_i = by_expert(got[0].cpu(), got[1].cpu())
    want_w, want_i = by_expert(weights.detach(), ids)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, **WEIGHT_TOL)


# ------------------------------------------------------------------------------------- Triton vs twin

TRITON_CASES = [  # (tokens, experts, top_k, groups, topk_group); E = 160 has groups of 20 (not a power of 2)
    (7, 8, 2, 1, 1), (3, 60, 4, 1, 1), (2, 160, 6, 8, 3), (2, 256, 8, 8, 4),
]
if ON_GPU:
    TRITON_CASES += [(989, 128, 8, 1, 1), (4099, 256, 8, 8, 4), (129, 512, 8, 16, 2), (99, 64, 6, 1, 1)]


@needs_triton
@pytest.mark.parametrize("tokens, experts, top_k, groups, topk_group", TRITON_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_topk_softmax_and_gpt_oss_match_twin(tokens, experts, top_k, groups, topk_group, dtype):
    # bf16 logits tie often: both sides choose by the logits themselves, ties to the lower index.
    logits = rand(tokens, experts, dtype=dtype, generator=torch.Generator().manual_seed(tokens + experts))
    for renormalize in (False, True):
        got = topk_softmax(logits, top_k, renormalize=renormalize, backend="triton")
        want = reference.topk_softmax(logits, top_k, renormalize)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], **WEIGHT_TOL)
    got = gpt_oss_topk(logits, top_k, backend="triton")
    want = reference.gpt_oss_topk(logits, top_k)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], **WEIGHT_TOL)


@needs_triton
@pytest.mark.parametrize("tokens, experts, top_k, groups, topk_group", TRITON_CASES)
@pytest.mark.parametrize("scoring, with_bias", [("sigmoid", True), ("sigmoid", False), ("softmax", False)])
def test_triton_grouped_topk_matches_twin(tokens, experts, top_k, groups, topk_group, scoring, with_bias):
    g = torch.Generator().manual_seed(tokens * experts)
    logits = rand(tokens, experts, generator=g)
    bias = 0.5 * rand(experts, generator=g) if with_bias else None
    kwargs = dict(num_expert_group=groups, topk_group=topk_group, renormalize=True, scoring=scoring,
                  e_score_correction_bias=bias, routed_scaling_factor=2.5)
    got = grouped_topk(logits, top_k, backend="triton", **kwargs)
    want = reference.grouped_topk(logits, top_k, groups, topk_group, True, scoring, bias, 2.5)
    if bias is None:  # the choice is on the logits: exact
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(got[0], want[0], **WEIGHT_TOL)
    else:  # the choice is sigmoid + bias: one ulp of sigmoid can swap a near-tie
        assert_same_choice(got, want, torch.sigmoid(logits.float()) + bias)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_strided_correction_bias_routes_as_its_contiguous_copy(backend):
    g = torch.Generator().manual_seed(11)
    logits, bias = rand(6, 16, generator=g), 0.5 * rand(16, generator=g)
    strided = torch.stack([bias, -bias], dim=1)[:, 0]  # every other element of a buffer
    kwargs = dict(num_expert_group=4, topk_group=2, renormalize=True, scoring="sigmoid", routed_scaling_factor=1.0)
    got = grouped_topk(logits, 4, e_score_correction_bias=strided, backend=backend, **kwargs)
    want = grouped_topk(logits, 4, e_score_correction_bias=bias, backend=backend, **kwargs)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy sees NaN - NaN
def test_triton_strided_logits_and_nan_rows_stay_in_range():
    logits = non_contiguous_rows(rand(5, 24))
    torch.testing.assert_close(topk_softmax(logits, 3, renormalize=True, backend="triton"),
                               reference.topk_softmax(logits, 3, True))
    logits[2] = float("nan")
    _, ids = topk_softmax(logits, 3, renormalize=True, backend="triton")
    assert ((ids >= 0) & (ids < 24)).all() and all(len(set(row)) == 3 for row in ids.tolist())


def test_more_than_512_experts_fall_back_to_torch_unless_triton_named():
    from atom_core import ops
    logits = torch.randn(2, 600, device=DEVICE)
    if ops.backend_available("triton"):
        with pytest.raises(BackendUnavailable, match="E=600 > 512"):
            topk_softmax(logits, 2, renormalize=True, backend="triton")
    with ops.use_backend("triton"), ops.trace_backends() as calls:
        topk_softmax(logits, 2, renormalize=True)
    assert calls == [("topk_softmax", "torch")]


@needs_gpu
def test_gpu_routing_under_cuda_graph():
    logits = rand(64, 256)
    bias = 0.1 * rand(256)
    static = {}

    def step():
        static["out"] = grouped_topk(logits, 8, num_expert_group=8, topk_group=4, renormalize=True, scoring="sigmoid",
                                     e_score_correction_bias=bias, routed_scaling_factor=2.5, backend="triton")

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    logits.copy_(rand(64, 256))
    graph.replay()
    want = reference.grouped_topk(logits, 8, 8, 4, True, "sigmoid", bias, 2.5)
    assert_same_choice(static["out"], want, torch.sigmoid(logits.float()) + bias)


# ----------------------------------------------------------------------------- compile, AITER, errors

def test_compiles_in_one_graph():
    def route(logits, bias):
        a = topk_softmax(logits, 2, renormalize=True, backend="torch")
        b = grouped_topk(logits, 2, num_expert_group=2, topk_group=1, renormalize=True, scoring="sigmoid",
                         e_score_correction_bias=bias, backend="torch")
        return a + b + gpt_oss_topk(logits, 2, backend="torch")

    logits, bias = torch.randn(5, 8), torch.randn(8)
    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(logits, bias), route(logits, bias)):
        torch.testing.assert_close(got, want)


def test_custom_ops_pass_opcheck():
    logits, bias = torch.randn(5, 8), torch.randn(8)

    def outputs():
        return torch.empty(5, 2), torch.empty(5, 2, dtype=torch.int32)

    torch.library.opcheck(torch.ops.atom_core.topk_softmax.default, (logits, True, *outputs(), "torch"))
    torch.library.opcheck(torch.ops.atom_core.grouped_topk.default,
                          (logits, 2, 1, True, "sigmoid", bias, 2.5, *outputs(), "torch"))
    torch.library.opcheck(torch.ops.atom_core.gpt_oss_topk.default, (logits, *outputs(), "torch"))


def _aiter_topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output, need_renorm):
    w, i = reference.topk_softmax(gating_output, topk_weights.shape[1], need_renorm)
    topk_weights.copy_(w)
    topk_indices.copy_(i)


def _aiter_grouped_topk(gating_output, topk_weights, topk_ids, num_expert_group, topk_group, need_renorm,
                        is_softmax, routed_scaling_factor):
    w, i = reference.grouped_topk(gating_output, topk_ids.shape[1], num_expert_group, topk_group, need_renorm,
                                  "softmax" if is_softmax else "sigmoid", None, routed_scaling_factor)
    topk_weights.copy_(w)
    topk_ids.copy_(i)


def _aiter_biased_grouped_topk(gating_output, correction_bias, topk_weights, topk_ids, num_expert_group, topk_group,
                               need_renorm, routed_scaling_factor):
    w, i = reference.grouped_topk(gating_output, topk_ids.shape[1], num_expert_group, topk_group, need_renorm,
                                  "sigmoid", correction_bias, routed_scaling_factor)
    topk_weights.copy_(w)
    topk_ids.copy_(i)


def test_aiter_adapter_argument_mapping(monkeypatch):
    fake = fake_aiter.install(monkeypatch, {"topk_softmax": _aiter_topk_softmax, "grouped_topk": _aiter_grouped_topk,
                                            "biased_grouped_topk": _aiter_biased_grouped_topk})
    aiter_moe = importlib.import_module("atom_core.ops.aiter.moe")  # fresh: bound to this fake
    logits = torch.randn(5, 16, dtype=torch.bfloat16)
    bias = torch.randn(16)
    w, i = torch.empty(5, 4), torch.empty(5, 4, dtype=torch.int32)

    aiter_moe.topk_softmax(logits, True, w, i)
    torch.testing.assert_close((w, i), reference.topk_softmax(logits, 4, True))
    name, args = fake.calls[-1]
    assert name == "topk_softmax" and args["gating_output"] is logits and args["need_renorm"] is True
    assert args["topk_weights"] is w and args["topk_indices"] is i
    assert args["token_expert_indices"].shape == (5, 4) and args["token_expert_indices"].dtype == torch.int32

    aiter_moe.gpt_oss_topk(logits, w, i)
    torch.testing.assert_close((w, i), reference.gpt_oss_topk(logits, 4))
    assert fake.calls[-1][0] == "topk_softmax" and fake.calls[-1][1]["need_renorm"] is True

    aiter_moe.grouped_topk(logits, 4, 2, False, "softmax", None, 1.5, w, i)
    torch.testing.assert_close((w, i), reference.grouped_topk(logits, 4, 4, 2, False, "softmax", None, 1.5))
    name, args = fake.calls[-1]
    assert name == "grouped_topk" and args["is_softmax"] is True and args["num_expert_group"] == 4
    assert args["topk_group"] == 2 and args["routed_scaling_factor"] == 1.5

    aiter_moe.grouped_topk(logits, 4, 2, True, "sigmoid", bias, 2.5, w, i)
    name, args = fake.calls[-1]
    assert name == "biased_grouped_topk" and args["need_renorm"] is True and args["routed_scaling_factor"] == 2.5
    assert args["correction_bias"].dtype == logits.dtype  # AITER reads the bias in the logits' dtype
    torch.testing.assert_close((w, i), reference.grouped_topk(logits, 4, 4, 2, True, "sigmoid",
                                                              bias.to(logits.dtype), 2.5))


def test_aiter_refusals():
    logits = torch.randn(4, 16)
    assert moe_routing._aiter_grouped_supports(logits, 4, 2, True, "sigmoid", torch.zeros(16)) is None
    assert "sigmoid only" in moe_routing._aiter_grouped_supports(logits, 4, 2, True, "softmax", torch.zeros(16))
    assert "contiguous" in moe_routing._aiter_contiguous(logits.t())


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: topk_softmax(torch.randn(8), 2, renormalize=True), "router_logits must have 2 dims"),
        (lambda: topk_softmax(torch.randn(2, 8).int(), 2, renormalize=True), "router_logits dtype"),
        (lambda: topk_softmax(torch.randn(2, 8), 9, renormalize=True), "top_k must be in"),
        (lambda: topk_softmax(torch.randn(2, 8), 2.0, renormalize=True), "top_k must be an int"),
        (lambda: gpt_oss_topk(torch.randn(2, 8), 0), "top_k must be in"),
        (lambda: grouped_topk(torch.randn(2, 8), 2, num_expert_group=3, topk_group=1, renormalize=True),
         "num_expert_group must be"),
        (lambda: grouped_topk(torch.randn(2, 8), 2, num_expert_group=4, topk_group=5, renormalize=True),
         "topk_group must be in"),
        (lambda: grouped_topk(torch.randn(2, 8), 5, num_expert_group=4, topk_group=2, renormalize=True),
         "top_k=5 exceeds"),
        (lambda: grouped_topk(torch.randn(2, 8), 2, num_expert_group=4, topk_group=2, renormalize=True,
                              scoring="relu"), "scoring must be"),
        (lambda: grouped_topk(torch.randn(2, 8), 2, num_expert_group=4, topk_group=2, renormalize=True,
                              e_score_correction_bias=torch.zeros(7)), "e_score_correction_bias must have shape"),
        (lambda: grouped_topk(torch.randn(2, 8), 2, num_expert_group=8, topk_group=2, renormalize=True,
                              e_score_correction_bias=torch.zeros(8)), "groups need >= 2 experts"),
        (lambda: topk_softmax(torch.randn(2, 8), 2, renormalize=True, backend="cuda"), "unknown backend"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_twin_matches_plain_softmax_topk_on_untied_rows():
    # An independent definition: torch.topk of the fp32 softmax (untied random rows, so its tie order is moot).
    logits = torch.randn(33, 40, generator=torch.Generator().manual_seed(3))
    probs = F.softmax(logits, dim=-1)
    values, ids = probs.topk(5, dim=-1)
    got_w, got_i = reference.topk_softmax(logits, 5, False)
    assert torch.equal(got_i.long(), ids)
    torch.testing.assert_close(got_w, values)
