"""What the MoE parity tests add to ``parity_harness``: the HF MoE families, persistent buffers
randomised too, a parameter-name check against the checkpoint's tensor names, an engine check.

Expected parameter names are derived here by explicit renaming rules on the tensor names HF
saved (per-expert tensors stacked, q/k/v and gate/up fused), not by the loader's mapping.
"""

# T tokens, E experts, K top-k, H hidden, I intermediate

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import torch

from atom_core import ops

from tests.models import parity_harness
from tests.models.parity_harness import (
    BF16_ARGMAX_MARGIN,
    BF16_TOL,
    HFParityChecks,
    backends_used,
    check_decode,
    ModelPair,
    PagedRunner,
    ParityCase,
    build_pair,
    random_tokens,
    run_all_checks,
    save_checkpoint,
)

# family -> (transformers config class, model class), added to the harness's table.
HF_MOE_CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
for _family, _classes in HF_MOE_CLASSES.items():
    parity_harness._HF_CLASSES.setdefault(_family, _classes)


def build_moe_pair(case: ParityCase, folder: Path, *, seed: int = 0) -> ModelPair:
    """``build_pair`` on a deep copy of the case's config, then persistent float buffers (GLM-4-MoE's
    ``e_score_correction_bias``, which HF keeps as a buffer and saves) set to 0.2 N(0, 1) as well,
    and the model saved again.

    The copy matters: ``Glm4MoeConfig`` writes ``partial_rotary_factor`` into the
    ``rope_parameters`` dict it is given, which would otherwise be the harness's shared
    ``BASE_CONFIG`` entry and change every model built after it in the session.
    """
    isolated = dataclasses.replace(case, overrides=copy.deepcopy(case.hf_config_kwargs()))
    pair = build_pair(isolated, folder, seed=seed)
    hf_model = pair.hf_model
    persistent = set(hf_model.state_dict())
    gen = torch.Generator().manual_seed(seed + 1)
    changed = False
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name in persistent and buf.is_floating_point():
                buf.copy_(0.2 * torch.randn(buf.shape, generator=gen))
                changed = True
    if changed:
        save_checkpoint(case, hf_model, folder)
    return pair


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def every_expert_case(case: ParityCase) -> ParityCase:
    """``case`` with every token routed to every expert (K = E; with groups, every group kept).

    For bf16 against HF's fp32: wherever two router logits lie within bf16 rounding of each other
    (a few percent of tokens), the two sides can choose different experts and that token's output
    jumps by O(1), so a tolerance check fails for reasons that are no bug. With K = E the choice is
    fixed and the bf16 error stays continuous; the choice itself is pinned by the fp32 cases.
    """
    overrides = dict(case.overrides)
    num_experts = next(overrides[k] for k in _EXPERT_COUNT_KEYS if k in overrides)
    overrides["num_experts_per_tok"] = num_experts
    if "n_group" in overrides:
        overrides["topk_group"] = overrides["n_group"]
    return dataclasses.replace(case, name=f"{case.name}_all_experts", overrides=overrides)


def positions_off(actual: torch.Tensor, expected: torch.Tensor, tol: dict) -> torch.Tensor:
    """Bool [L]: the positions whose logits [L, V] miss ``tol`` (scaled as in ``assert_logits_match``)."""
    scale = max(1.0, expected.abs().max().item()) if tol.get("scaled") else 1.0
    return ((actual - expected).abs() > tol["atol"] * scale + tol["rtol"] * expected.abs()).any(-1)


# How many positions bf16 atom_core may get off against HF fp32 with the real top-k (see
# check_real_top_k_bf16): twice as many as HF's own bf16 model, and never fewer than 5% of them.
OFF_POSITIONS_PER_HF_BF16 = 2
OFF_POSITIONS_FLOOR = 0.05


def check_real_top_k_bf16(pair: ModelPair, model, *, device: str = "cuda", lengths=(96, 41, 1, 120),
                          tol: dict = BF16_TOL) -> None:
    """bf16 atom_core with the config's real top-k against HF fp32: the positions whose logits miss
    ``tol`` number at most ``max(2 x HF-bf16's count, 5% of all positions)``, where HF-bf16's
    count is that of HF's own model cast to bf16 on the same device and prompts.

    Why a count and not a tolerance: a router logit within bf16 rounding of the k-th largest can
    pick a different expert, which moves that position's logits by O(1). Why twice HF's count and
    not at most HF's: atom_core and HF round at different places (fused q/k/v and gate/up
    matmuls, fused experts, other accumulation orders), so each flips its own random subset of the
    near-ties; HF's count is one draw of a number of the same size, not a ceiling. Why the 5%
    floor: with a handful of near-ties among these 258 positions, HF's count can be 0 or 1 by
    chance, and twice that would fail flips of the very same origin. A real mistake (a wrong
    expert, weight or routing weight) puts nearly every position off, far above either bound.
    """
    vocab = pair.hf_model.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=50 + i) for i, n in enumerate(lengths)]
    block_size = 16
    runner = PagedRunner(model, block_size=block_size, num_blocks=sum(-(-n // block_size) for n in lengths) + 4,
                         seed=5, device=device)
    outs = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)])
    hf_bf16 = copy.deepcopy(pair.hf_model).to(device=device, dtype=torch.bfloat16)
    if hasattr(hf_bf16, "set_experts_implementation"):
        # the expert loop: grouped_mm needs 16-byte-aligned strides, which tiny bf16 experts lack
        hf_bf16.set_experts_implementation("eager")
    atom_off = hf_off = total = 0
    for prompt, out in zip(prompts, outs):
        expected = pair.hf_logits(prompt)
        with torch.no_grad():
            hf_out = hf_bf16(input_ids=torch.tensor([prompt], device=device)).logits[0].float().cpu()
        atom_off += int(positions_off(out, expected, tol).sum())
        hf_off += int(positions_off(hf_out, expected, tol).sum())
        total += len(prompt)
    allowed = max(OFF_POSITIONS_PER_HF_BF16 * hf_off, int(OFF_POSITIONS_FLOOR * total))
    assert atom_off <= allowed, (
        f"{atom_off} of {total} positions off against HF fp32 (HF in bf16: {hf_off}; allowed "
        f"max({OFF_POSITIONS_PER_HF_BF16} x {hf_off}, {OFF_POSITIONS_FLOOR:.0%} of {total}) = {allowed})")


def checkpoint_tensor_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return names


# (pattern, replacement) applied in order to every checkpoint tensor name.
_RENAMES = [
    (r"\.block_sparse_moe\.", ".mlp."),                                   # Mixtral's block name
    (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.(weight|bias)$", r".experts.w13_\2"),  # per-expert
    (r"\.experts\.\d+\.(down_proj|w2)\.(weight|bias)$", r".experts.w2_\2"),
    (r"\.experts\.gate_up_proj$", ".experts.w13_weight"),                # already stacked (GPT-OSS)
    (r"\.experts\.gate_up_proj_bias$", ".experts.w13_bias"),
    (r"\.experts\.down_proj$", ".experts.w2_weight"),
    (r"\.experts\.down_proj_bias$", ".experts.w2_bias"),
    (r"\.(q_proj|k_proj|v_proj)\.", ".qkv_proj."),                        # fused attention input
    (r"\.(gate_proj|up_proj)\.", ".gate_up_proj."),                       # fused dense / shared MLP
]


def check_moe_parameter_names(pair: ModelPair, model) -> None:
    """atom_core's parameter names are the checkpoint's after stacking experts and fusing q/k/v, gate/up."""
    expected = set()
    for name in checkpoint_tensor_names(pair.path):
        for pattern, replacement in _RENAMES:
            name = re.sub(pattern, replacement, name)
        expected.add(name)
    if pair.hf_model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")  # the head is the embedding, listed once under its name
    actual = {name for name, _ in model.named_parameters()}
    assert actual == expected, (
        f"only in atom_core: {sorted(actual - expected)}; only in the checkpoint: {sorted(expected - actual)}")


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF ``generate``, greedy. The explicit all-ones mask keeps HF from masking prompt tokens that
    equal the pad id."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check_engine_greedy(pair: ModelPair, *, lengths=(6, 1, 11), max_tokens: int = 6) -> None:
    """Greedy tokens through ``Engine`` (CPU, fp32, torch backend; chunked prefill, small blocks) equal HF
    ``generate`` for each prompt."""
    from atom_core.engine import Engine, SamplingParams

    vocab = pair.hf_model.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=40 + i) for i, n in enumerate(lengths)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(pair.path, device="cpu", dtype=torch.float32, block_size=4,
                                        max_num_batched_tokens=8)
        outs = engine.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(pair.hf_model, prompt, max_tokens), f"prompt of {len(prompt)} tokens"


def assert_triton_served(run, required_ops: set[str]) -> None:
    """Run ``run()``; every op call in it must have been served by Triton, ``required_ops`` among
    them. (``use_backend("triton")`` alone is a preference: a call Triton cannot serve falls back
    to another backend silently.)"""
    used = backends_used(run)
    not_triton = sorted((op, backend) for op, backend in used if backend != "triton")
    assert not not_triton, f"ops not served by triton: {not_triton} (all: {sorted(used)})"
    missing = required_ops - {op for op, _ in used}
    assert not missing, f"ops never called: {sorted(missing)} (all: {sorted(used)})"


# The ops a dense decoder layer (Llama's, Qwen2's) calls.
DENSE_LAYER_OPS = {"paged_attention", "rope_store_kv_", "rms_norm", "silu_and_mul"}


def check_bf16_triton_matches_hf_fp32(pair: ModelPair, required_ops: set[str]) -> None:
    """The model in bf16 on the GPU, every op served by Triton (``required_ops`` among them), through
    ``run_all_checks`` against HF in fp32 (``BF16_TOL``; argmax where HF's top-2 margin exceeds
    ``BF16_ARGMAX_MARGIN``)."""
    model = pair.load_atom(dtype=torch.bfloat16, device="cuda")

    def run():
        with ops.use_backend("triton"):  # a preference: a case Triton cannot serve would fall back silently
            run_all_checks(pair, model, device="cuda", tol=BF16_TOL, argmax_margin=BF16_ARGMAX_MARGIN)

    assert_triton_served(run, required_ops)


def check_triton_serves_every_op(pair: ModelPair, routing_op: str) -> None:
    """A two-row prefill, a mixed step and a decode step (CPU, fp32, Triton in the interpreter) match HF,
    every op served by Triton, the routing by ``routing_op``."""
    model = pair.load_atom(dtype=torch.float32, device="cpu")

    def run():
        with ops.use_backend("triton"):
            check_decode(pair, model, 4, num_decode_steps=2, pad_rows=0)

    assert_triton_served(run, {routing_op, "fused_experts", "paged_attention"})


class MoEParityChecks(HFParityChecks):
    """The shared HF checks plus parameter names derived from the checkpoint's own tensor names and
    greedy tokens through ``Engine``."""

    def test_parameter_names_mirror_the_checkpoint(self, pair, model):
        check_moe_parameter_names(pair, model)

    def test_engine_greedy_equals_hf_generate(self, pair):
        check_engine_greedy(pair)
