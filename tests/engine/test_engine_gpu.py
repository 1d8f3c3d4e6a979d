"""On a GPU: bf16 greedy tokens are HF's argmax up to bf16 near-ties; CUDA graphs on/off and async scheduling
on/off giving the same tokens; after warm-up, generating compiles no kernel and captures no graph."""

import random

import pytest
import torch

from atom_core.engine import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompts(vocab, n, seed=0, max_len=40):
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(1, max_len))] for _ in range(n)]


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama", "tiny_qwen3_moe"])
def test_cuda_graphs_and_async_scheduling_on_off_same_tokens(request, fixture):
    folder, hf_model = request.getfixturevalue(fixture)
    prompts = _prompts(hf_model.config.vocab_size, 37)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = {}
    # A small token budget makes chunked prefills and mixed steps (replayed from mixed graphs).
    for eager, async_scheduling in ((True, False), (False, False), (False, True)):
        engine = Engine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, block_size=16, max_num_seqs=64,
                                        max_num_batched_tokens=96, num_kv_blocks=512, enforce_eager=eager,
                                        async_scheduling=async_scheduling)
        assert (engine.runner.graphs is None) == eager
        outs[eager, async_scheduling] = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert outs[True, False] == outs[False, False] == outs[False, True]


def test_an_engine_built_preferring_the_reference_ops_runs_eagerly_and_gives_the_reference_tokens(tiny_qwen3):
    """The reference ops read values on the host, which a CUDA graph cannot capture: inside
    use_backend("torch") the engine runs without graphs (instead of failing in the capture)."""
    from atom_core import ops

    folder, hf_model = tiny_qwen3
    prompts = _prompts(hf_model.config.vocab_size, 9)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    args = dict(device="cuda", dtype=torch.float32, max_num_seqs=16, num_kv_blocks=256)
    with ops.use_backend("torch"):
        engine = Engine.from_pretrained(folder, **args)
        assert engine.runner.graphs is None
        got = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        want = [o.token_ids for o in Engine.from_pretrained(folder, enforce_eager=True, **args).generate(
            prompts, params, use_tqdm=False)]
    assert got == want


def test_after_warmup_generate_compiles_no_kernel_and_captures_no_graph(tiny_qwen3):
    triton = pytest.importorskip("triton")
    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook")
    folder, hf_model = tiny_qwen3
    engine = Engine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, max_num_seqs=32,
                                    max_num_batched_tokens=256, num_kv_blocks=512)
    graphs = engine.runner.graphs
    assert graphs.num_captured == len(graphs.buckets())
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(kwargs.get("fn", args))
    try:
        vocab = hf_model.config.vocab_size
        params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_k=5, max_tokens=7, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, max_tokens=5, logprobs=0)]
        for n in (1, 3, 17, 32):  # row counts of several graph sizes, prompts up to two chunks
            prompts = _prompts(vocab, n, seed=n, max_len=200)
            engine.generate(prompts, [params[i % 3] for i in range(n)], use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == [] and graphs.num_captured == len(graphs.buckets())


# How far below HF's best fp32 logit the engine's bf16 greedy token may lie, as a share of the
# position's max |logit|. If every logit were within e of the exact one on both sides, the gap
# would be at most 2e; for these fixtures (init range 0.3) bf16 on CPU puts single logits up to
# e = 5.4% of max |logit| off, but the gap only nears 2e on a near-tie whose two logits err in
# opposite directions. Measured on the engine's own path (bf16 on CPU, this test's prompts with
# seeds 1-3, 12 tokens each): worst gap 1.9%. 5% is 2.5x that, room for the GPU kernels rounding
# at other places, and still far below the O(max |logit|) gap of a wrong token.
ARGMAX_GAP_TOL = 0.05


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_bf16_greedy_tokens_are_within_5_percent_of_hf_argmax(request, fixture):
    """Each of the engine's 12 greedy tokens (bf16) has, in HF's fp32 logits on the same prefix, a
    logit at most ARGMAX_GAP_TOL x max |logit| below HF's best (the comment above says why 5%)."""
    folder, hf_model = request.getfixturevalue(fixture)
    prompts = _prompts(hf_model.config.vocab_size, 8, seed=1)
    engine = Engine.from_pretrained(folder, device="cuda", dtype=torch.bfloat16, num_kv_blocks=512)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    home = next(hf_model.parameters())
    home_device, home_dtype = home.device, home.dtype
    hf = hf_model.to("cuda", torch.float32)  # the session fixture, moved in place: restored below, whatever happens
    try:
        for prompt, out in zip(prompts, outs):
            assert len(out.token_ids) == 12
            # Token by token on the engine's own path.
            ids = torch.tensor([prompt + out.token_ids], device="cuda")
            with torch.no_grad():
                logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
            chosen = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
            gap = logits.max(-1).values - chosen
            assert (gap <= ARGMAX_GAP_TOL * logits.abs().max(-1).values).all(), gap
    finally:
        hf_model.to(home_device, home_dtype)
