"""The DeepSeek family in bf16 with the Triton backend on a GPU, on the configs of the CPU parity files,
against HF in fp32: DeepSeek-V2 without ``q_lora_rank`` (V2-Lite's q path) and with it, DeepSeek-V3,
DeepSeek-V3.2 and GLM-5 (DSA). Every op call must be served by Triton; the DSA models' attention must be
the sparse kernel (``ops/triton/dsa_sparse.py``), never the dense MLA kernels.

- Fixed choices (every expert chosen, ``moe_parity.every_expert_case``; for DSA an ``index_topk`` above
  every context): the routing and the selection cannot flip on a bf16 near-tie, so the whole parity
  suite (ragged prefill, paged decode at block sizes 1 / 4 / 16 with shuffled blocks and a late joiner,
  chunked prefill, a prefix hit) holds within the bf16 tolerance.
- The real top-k (routing, and for DSA the indexer's top-k well below the contexts): a near-tie can
  choose another expert or another position and move a position's logits by O(1), so the positions off
  the tolerance are counted against HF's own model cast to bf16, as ``moe_parity.check_real_top_k_bf16``
  does (why: its docstring): one ragged prefill, and paged decode at block sizes 1 / 4 / 16.
- ``Engine`` on the GPU (CUDA graphs, Triton): greedy tokens in fp32 equal HF ``generate``; in bf16
  (fixed choices) each greedy token is within 5% of max |logit| of HF's fp32 argmax, as
  ``tests/engine/test_engine_gpu.py`` checks for the dense models.
"""

# T tokens, V vocabulary, K top-k

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from atom_core import ops
from tests.models import test_parity_deepseek, test_parity_deepseek_v32
from tests.models.moe_parity import (
    OFF_POSITIONS_FLOOR,
    OFF_POSITIONS_PER_HF_BF16,
    build_moe_pair,
    check_real_top_k_bf16,
    every_expert_case,
    hf_greedy,
    positions_off,
)
from tests.models.parity_harness import (
    BF16_ARGMAX_MARGIN,
    BF16_TOL,
    PagedRunner,
    ParityCase,
    backends_used,
    random_tokens,
    run_all_checks,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_V2_CASES = {case.name: case for case in test_parity_deepseek.CASES}
_DSA_CASES = {case.name: case for case in test_parity_deepseek_v32.CASES}
CASES = [_V2_CASES["v2_lite_like"], _V2_CASES["v2_group_limited_bias"], _V2_CASES["v3_like"],
         _DSA_CASES["v32_sparse"], _DSA_CASES["glm5_shared_topk"]]
IDS = [case.name for case in CASES]

MLA_OPS = {"store_mla_", "fused_experts"}
DSA_OPS = {"store_mla_", "store_indexer_k_", "indexer_topk", "mla_sparse_attention", "fused_experts"}
# An index_topk above every context of the fixed-choice checks (at most 21 tokens there, 50 in the engine's).
COVERING_TOPK = 64


def is_dsa(case: ParityCase) -> bool:
    return "index_topk" in case.overrides


def fixed_choice_case(case: ParityCase) -> ParityCase:
    """``case`` with every expert chosen and, for DSA, every visible position selected."""
    fixed = every_expert_case(case)
    if not is_dsa(case):
        return fixed
    return dataclasses.replace(fixed, overrides={**fixed.overrides, "index_topk": COVERING_TOPK})


def triton_served(case: ParityCase, run, *, decodes: bool = True, expands: bool = True) -> None:
    """``run()`` under ``use_backend("triton")``: every op by Triton, the family's ops among them; DSA
    through the sparse kernel alone (the Triton module's kernel launched, neither dense MLA op called).
    ``decodes``: ``run`` has steps of few queries per row, so MLA's absorbed form (the decode kernel) runs.
    ``expands``: ``run`` has a prefill step whose block table spans few slots per query token, so the
    expanded form runs too (an engine's CUDA graphs hold max_model_len pages per row: every step they
    serve runs the absorbed form, ``layers.mla.EXPANDED_MAX_SLOTS_PER_TOKEN``)."""
    from atom_core.ops.triton import dsa_sparse, mla_decode

    launches = {"sparse": 0, "dense": 0}

    class Counted:
        def __init__(self, kernel, key):
            self.kernel, self.key = kernel, key

        def __getitem__(self, grid):
            launches[self.key] += 1
            return self.kernel[grid]

    def traced():
        with ops.use_backend("triton"):
            run()

    sparse_kernel, dense_kernel = dsa_sparse._mla_sparse_kernel, mla_decode._mla_attention_kernel
    dsa_sparse._mla_sparse_kernel = Counted(sparse_kernel, "sparse")
    mla_decode._mla_attention_kernel = Counted(dense_kernel, "dense")
    try:
        used = backends_used(traced)
    finally:
        dsa_sparse._mla_sparse_kernel, mla_decode._mla_attention_kernel = sparse_kernel, dense_kernel
    not_triton = sorted(pair for pair in used if pair[1] != "triton")
    assert not not_triton, f"ops not served by triton: {not_triton}"
    names = {op for op, _ in used}
    if is_dsa(case):
        assert DSA_OPS <= names, f"never called: {sorted(DSA_OPS - names)}"
        assert not names & {"mla_decode_attention", "mla_prefill_attention"}, sorted(names)
        assert launches["sparse"] > 0 and launches["dense"] == 0, launches
    else:
        wanted = MLA_OPS | ({"mla_prefill_attention"} if expands else set()) | (
            {"mla_decode_attention"} if decodes else set())
        assert wanted <= names, f"never called: {sorted(wanted - names)}"
        assert launches["sparse"] == 0 and (launches["dense"] > 0 or not decodes), launches


# ---- fixed choices: the whole parity suite within the bf16 tolerance ----------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_bf16_triton_with_fixed_choices_matches_hf_fp32_prefill_paged_decode_chunked_prefix(case, tmp_path):
    pair = build_moe_pair(fixed_choice_case(case), tmp_path)
    model = pair.load_atom(dtype=torch.bfloat16, device="cuda")
    triton_served(case, lambda: run_all_checks(pair, model, device="cuda", tol=BF16_TOL,
                                               argmax_margin=BF16_ARGMAX_MARGIN, block_sizes=(1, 4, 16)))


# ---- the real top-k: positions off counted against HF's own bf16 model --------------------------

def decode_schedule(pair, model, block_size: int, *, device: str = "cuda", prompt_lens=(30, 45, 12),
                    num_decode_steps: int = 8) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Two prompts prefilled, then decode steps through the paged pool with a late joiner whose prefill shares
    a step with the others' decodes (``parity_harness.check_decode``'s schedule, with contexts well past a
    DSA top-k of 8). Returns each sequence's tokens fed and atom_core's logits at every position [L, V]."""
    vocab = pair.hf_model.config.vocab_size
    names = ("a", "b", "late")
    full = {name: random_tokens(n + num_decode_steps, vocab, seed=60 + i)
            for i, (name, n) in enumerate(zip(names, prompt_lens))}
    prompt = dict(zip(names, prompt_lens))
    runner = PagedRunner(model, block_size=block_size, seed=6, device=device,
                         num_blocks=3 * -(-max(map(len, full.values())) // block_size) + 4)
    got = {name: [] for name in names}
    fed = dict.fromkeys(names, 0)

    def feed(names_and_counts):
        rows = [(name, full[name][fed[name]:fed[name] + n]) for name, n in names_and_counts]
        for (name, n), out in zip(names_and_counts, runner.step(rows, pad_rows_to=len(rows) + 1)):
            got[name].append(out)
            fed[name] += n

    feed([("a", prompt["a"]), ("b", prompt["b"])])
    feed([("a", 1), ("b", 1), ("late", prompt["late"])])
    for _ in range(num_decode_steps - 1):
        feed([("a", 1), ("b", 1), ("late", 1)])
    return {name: (full[name][:fed[name]], torch.cat(got[name])) for name in names}


def assert_off_within_hf_bf16_bound(pair, outputs, *, device: str = "cuda", tol: dict = BF16_TOL) -> None:
    """The positions of ``outputs`` ({name: (tokens, logits)}) off ``tol`` against HF fp32 number at most
    ``max(2 x HF-bf16's count, 5% of them)`` (``moe_parity.check_real_top_k_bf16``'s bound)."""
    hf_bf16 = copy.deepcopy(pair.hf_model).to(device=device, dtype=torch.bfloat16)
    if hasattr(hf_bf16, "set_experts_implementation"):
        hf_bf16.set_experts_implementation("eager")  # grouped_mm needs 16-byte-aligned strides
    atom_off = hf_off = total = 0
    for tokens, logits in outputs.values():
        expected = pair.hf_logits(tokens)
        with torch.no_grad():
            hf_out = hf_bf16(input_ids=torch.tensor([tokens], device=device)).logits[0].float().cpu()
        atom_off += int(positions_off(logits, expected, tol).sum())
        hf_off += int(positions_off(hf_out, expected, tol).sum())
        total += len(tokens)
    allowed = max(OFF_POSITIONS_PER_HF_BF16 * hf_off, int(OFF_POSITIONS_FLOOR * total))
    assert atom_off <= allowed, (f"{atom_off} of {total} positions off against HF fp32 (HF in bf16: {hf_off}; "
                                 f"allowed {allowed})")


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def real_pair(request, tmp_path_factory):
    return build_moe_pair(request.param, tmp_path_factory.mktemp(request.param.name))


def test_bf16_triton_with_real_top_k_prefill_is_off_at_no_more_positions_than_twice_hf_bf16(real_pair):
    """Ragged prefill (96, 41, 1, 120 tokens; DSA top-k 8 or 6: most positions dropped)."""
    model = real_pair.load_atom(dtype=torch.bfloat16, device="cuda")
    triton_served(real_pair.case, lambda: check_real_top_k_bf16(real_pair, model), decodes=False)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_bf16_triton_with_real_top_k_paged_decode_is_off_at_no_more_positions_than_twice_hf_bf16(
        real_pair, block_size):
    model = real_pair.load_atom(dtype=torch.bfloat16, device="cuda")
    outputs = {}
    triton_served(real_pair.case, lambda: outputs.update(decode_schedule(real_pair, model, block_size)))
    assert_off_within_hf_bf16_bound(real_pair, outputs)


# ---- the engine on the GPU ---------------------------------------------------------------------

ENGINE_ARGS = {"block_size": 16, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 128,
               "num_kv_blocks": 64}
ENGINE_PROMPT_LENS = (30, 1, 41)


def engine_greedy(pair, dtype: torch.dtype, max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the engine's greedy tokens (CUDA graphs, Triton, chunked prefill under a 64-token budget;
    every step is served by a graph, so MLA runs its absorbed form throughout)."""
    from atom_core.engine import Engine, SamplingParams

    vocab = pair.hf_model.config.vocab_size
    prompts = [random_tokens(n, vocab, seed=70 + i) for i, n in enumerate(ENGINE_PROMPT_LENS)]
    outs = []

    def run():
        engine = Engine.from_pretrained(pair.path, device="cuda", dtype=dtype, **ENGINE_ARGS)
        assert engine.runner.graphs is not None
        outs.extend(engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                    use_tqdm=False))

    triton_served(pair.case, run, expands=False)
    return prompts, [out.token_ids for out in outs]


def test_engine_fp32_greedy_equals_hf_generate(real_pair):
    prompts, tokens = engine_greedy(real_pair, torch.float32, max_tokens=8)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(real_pair.hf_model, prompt, 8), f"prompt of {len(prompt)} tokens"


# How far below HF's best fp32 logit a bf16 greedy token may lie, as a share of max |logit|
# (tests/engine/test_engine_gpu.py's ARGMAX_GAP_TOL and why).
ARGMAX_GAP_TOL = 0.05


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_engine_bf16_greedy_tokens_with_fixed_choices_are_within_5_percent_of_hf_argmax(case, tmp_path):
    pair = build_moe_pair(fixed_choice_case(case), tmp_path)
    prompts, tokens = engine_greedy(pair, torch.bfloat16, max_tokens=10)
    for prompt, got in zip(prompts, tokens):
        assert len(got) == 10
        logits = pair.hf_logits(prompt + got)[len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        gap = logits.max(-1).values - chosen
        assert (gap <= ARGMAX_GAP_TOL * logits.abs().max(-1).values).all(), gap
