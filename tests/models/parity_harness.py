"""Machinery of the Hugging Face parity tests: tiny random HF models, a paged KV pool, a step runner.

A parity test builds a tiny random model with transformers, saves it (safetensors), loads it
with ``atom_core.models.load_model`` and feeds both the same tokens. HF runs each whole
sequence in one plain forward (no cache): causality makes its logits at position p the
answer for any schedule that has fed tokens 0..p. atom_core runs the schedule under test
(ragged batched prefill, decode steps, prefill chunks, a prefix-cache hit) through a paged
KV pool whose block ids are shuffled and whose unwritten slots hold large finite garbage,
so reading a wrong slot or an unwritten one shows up in the logits.

Legend: T = tokens in a step, V = vocabulary, L = sequence length.
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from atom_core import ops
from atom_core.cache import build_step_layout

# fp32 on CPU: both sides compute the same math in fp32, differing only in summation order
# (fused QKV/gate-up matmuls, per-row attention, the norm kernels). Observed: max |diff| of
# 1.5e-6 .. 7.6e-6 over all cases (the larger where tied heads give logits up to 18).
# 1e-4 absolute + 1e-4 relative leaves room for other BLAS builds while staying far below the
# effect of any real mistake (a wrong position, slot or mask moves logits by O(0.1)).
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}

# bf16 on a GPU against HF in fp32 on the same weights: bf16 keeps 8 significant bits
# (relative step 2**-8 = 0.4%) and rounds after every op, so over two layers the logits drift
# by ~1% of their scale (measured: <= 1.2% of max |logit| for these models in bf16 on CPU).
# "scaled": atol is multiplied by s = max(1, max |reference logit|) of the compared block, and
# argmax must agree wherever HF's top-2 margin exceeds BF16_ARGMAX_MARGIN * s.
BF16_TOL = {"atol": 3e-2, "rtol": 5e-2, "scaled": True}
BF16_ARGMAX_MARGIN = 0.1

# Defaults shared by every tiny config; a case overrides what it varies.
BASE_CONFIG = {
    "vocab_size": 101,
    "hidden_size": 64,
    "intermediate_size": 100,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}

# family -> (transformers config class, model class). "ministral" is Llama with per-layer
# sliding windows; its checkpoints are Llama's tensor for tensor.
_HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "ministral": ("MinistralConfig", "MinistralForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


@dataclass(frozen=True)
class ParityCase:
    """One tiny configuration: the HF family that builds it, the architecture atom_core loads it as."""

    name: str
    hf_family: str                      # key of _HF_CLASSES
    architecture: str                   # written into config.json's "architectures"
    overrides: dict = field(default_factory=dict)
    # keys deleted from the saved config.json, as older releases left out keys equal to the family's
    # defaults: atom_core must then take transformers' defaults (HF's model keeps its config)
    saved_without: tuple[str, ...] = ()

    def hf_config_kwargs(self) -> dict:
        # A deep copy: some transformers configs write into the dicts they are given (e.g.
        # Glm4MoeConfig adds partial_rotary_factor to rope_parameters), which would leak into
        # every later case.
        return copy.deepcopy({**BASE_CONFIG, **self.overrides})


@dataclass
class ModelPair:
    """The HF reference (fp32, CPU, eval) and the folder it was saved to."""

    case: ParityCase
    hf_model: torch.nn.Module
    path: Path

    def hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        """HF's logits [L, V] float32 for every position of one sequence (one forward, no cache)."""
        with torch.no_grad():
            out = self.hf_model(input_ids=torch.tensor([token_ids], dtype=torch.long))
        return out.logits[0].float()

    def load_atom(self, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
        from atom_core.models import load_model

        return load_model(self.path, dtype=dtype, device=device)


@torch.no_grad()
def randomize_weights_(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every part of the model matter.

    HF's own init (normal(0, 0.02), norms at 1, biases at 0) gives near-uniform logits and
    leaves norm weights and biases untested. Here: norm weights 1 + 0.2 N(0,1), biases 0.2 N(0,1),
    embeddings 0.5 N(0,1), matrices N(0,1) / sqrt(fan_in) (unit-scale outputs).
    """
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * noise
        elif param.dim() == 1:
            value = 0.2 * noise
        elif "embed_tokens" in name:
            value = 0.5 * noise
        else:
            value = noise / math.sqrt(param.shape[1])
        param.copy_(value)


def build_pair(case: ParityCase, folder: Path, *, seed: int = 0) -> ModelPair:
    """Build the tiny HF model of ``case``, randomise it, save it to ``folder``; return the pair."""
    import transformers

    if case.hf_family not in _HF_CLASSES:
        raise KeyError(f"unknown hf_family {case.hf_family!r} (known: {', '.join(sorted(_HF_CLASSES))}): add its "
                       f"(config class, model class) names to parity_harness._HF_CLASSES")
    config_name, model_name = _HF_CLASSES[case.hf_family]
    config = getattr(transformers, config_name)(**case.hf_config_kwargs())
    # A family's special-token defaults past the tiny vocabulary (Phi-3: pad and eos 32000) would fail HF's
    # embedding and ModelConfig's check: Llama's ids instead (no padding row).
    for name, small in (("pad_token_id", None), ("bos_token_id", 1), ("eos_token_id", 2)):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= config.vocab_size:
            setattr(config, name, small)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf_model = getattr(transformers, model_name)(config).float().eval()
    randomize_weights_(hf_model, seed)
    save_checkpoint(case, hf_model, folder)
    return ModelPair(case=case, hf_model=hf_model, path=Path(folder))


def save_checkpoint(case: ParityCase, hf_model: torch.nn.Module, folder: Path) -> None:
    """``hf_model.save_pretrained(folder)``, its config.json naming the case's architecture and without the
    case's ``saved_without`` keys."""
    hf_model.save_pretrained(folder)
    config_path = Path(folder) / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [case.architecture]
    for key in case.saved_without:
        del saved[key]
    config_path.write_text(json.dumps(saved, indent=2))


class ShuffledKVPool:
    """Per-layer pool tensors and a block allocator handing out shuffled ids: K and V ``[NB, BS, Hk, D]``
    each, or for an MLA model (``spec.is_mla``) one latent tensor ``[NB, BS, L + R]`` per layer, as
    ``model.kv_cache_spec()`` asks (``kv_caches[i]`` is then ``(k, v)`` or ``(latent,)``).

    A model with ``extra_kv_cache_specs()`` (DSA's indexer keys) gets those too, over the same blocks:
    ``extra_kv_caches[name]`` is one tensor per layer of that cache, bound with ``bind_extra_kv_caches``.

    Every slot starts as 100 * N(0, 1): finite, so masked-out slots multiply to exact zeros,
    but large enough that attending to a slot nothing wrote wrecks the output.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, *, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        spec = model.kv_cache_spec()
        shape = spec.kv_shape(num_blocks, block_size)
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.kv_caches = [
            tuple((100.0 * torch.randn(shape, generator=gen)).to(device=device, dtype=spec.dtype)
                  for _ in range(spec.num_kv_tensors_per_layer))
            for _ in range(spec.num_layers)
        ]
        extra_specs = getattr(model, "extra_kv_cache_specs", dict)()
        self.extra_kv_caches = {
            name: [(100.0 * torch.randn(extra.kv_shape(num_blocks, block_size), generator=gen)).to(
                device=device, dtype=extra.dtype) for _ in range(extra.num_layers)]
            for name, extra in extra_specs.items()
        }
        order = list(range(num_blocks))
        random.Random(seed).shuffle(order)
        self._free = order

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("test pool exhausted; raise num_blocks")
        return self._free.pop()


@dataclass
class _Sequence:
    token_ids: list[int]       # tokens whose KV is in the pool, in order
    block_table: list[int]


class PagedRunner:
    """Runs atom_core steps over a ``ShuffledKVPool``: any mix of prefill chunks and decode rows.

    ``step([(seq_id, new_token_ids), ...])`` appends the tokens to each row's sequence,
    computes them in one batch and returns each row's logits ``[len(new_token_ids), V]``
    (float32, CPU) — every position, not only the last.
    """

    def __init__(self, model: torch.nn.Module, *, block_size: int, num_blocks: int, seed: int = 0,
                 device: str | torch.device = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.pool = ShuffledKVPool(model, num_blocks, block_size, seed=seed, device=device)
        model.bind_kv_cache(self.pool.kv_caches)
        if self.pool.extra_kv_caches:
            model.bind_extra_kv_caches(self.pool.extra_kv_caches)
        self.block_size = block_size
        self.seqs: dict[str, _Sequence] = {}

    def fork_prefix(self, source: str, new: str, num_prefix_tokens: int) -> int:
        """Start ``new`` on the full blocks of ``source``'s first ``num_prefix_tokens`` tokens, as a
        prefix-cache hit does (only whole blocks are shared). Returns the tokens served from cache."""
        src = self.seqs[source]
        shared_blocks = min(num_prefix_tokens, len(src.token_ids)) // self.block_size
        cached = shared_blocks * self.block_size
        self.seqs[new] = _Sequence(token_ids=list(src.token_ids[:cached]),
                                   block_table=list(src.block_table[:shared_blocks]))
        return cached

    @torch.no_grad()
    def step(self, rows: list[tuple[str, list[int]]], *, pad_rows_to: int | None = None) -> list[torch.Tensor]:
        query_lens, cached_lens, tables, input_ids = [], [], [], []
        for seq_id, new_tokens in rows:
            seq = self.seqs.setdefault(seq_id, _Sequence(token_ids=[], block_table=[]))
            total = len(seq.token_ids) + len(new_tokens)
            while len(seq.block_table) * self.block_size < total:
                seq.block_table.append(self.pool.allocate())
            query_lens.append(len(new_tokens))
            cached_lens.append(len(seq.token_ids))
            tables.append(list(seq.block_table))
            input_ids.extend(new_tokens)
        layout = build_step_layout(query_lens, cached_lens, tables, self.block_size, pad_rows_to=pad_rows_to)
        num_pad_tokens = layout.num_tokens - len(input_ids)
        ids = torch.tensor(input_ids + [0] * num_pad_tokens, dtype=torch.long, device=self.device)
        layout = layout.to(self.device)
        hidden = self.model(ids, layout.positions, layout)
        logits = self.model.compute_logits(hidden).float().cpu()
        for seq_id, new_tokens in rows:
            self.seqs[seq_id].token_ids.extend(new_tokens)
        starts = layout.cu_seqlens_q.cpu().tolist()
        return [logits[starts[r]:starts[r + 1]] for r in range(len(rows))]


def random_tokens(n: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_logits_match(actual: torch.Tensor, expected: torch.Tensor, what: str, *, tol: dict = FP32_TOL,
                        argmax_margin: float | None = None) -> None:
    """Logits [L, V] agree within ``tol`` (atol times the logit scale when ``tol["scaled"]``); with
    ``argmax_margin``, also the argmax wherever the reference's top-2 margin exceeds it (times the scale)."""
    scale = max(1.0, expected.abs().max().item()) if tol.get("scaled") else 1.0
    torch.testing.assert_close(actual, expected, atol=tol["atol"] * scale, rtol=tol["rtol"],
                               msg=lambda m: f"{what}: {m}")
    if argmax_margin is not None:
        top2 = expected.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > argmax_margin * scale
        disagree = (actual.argmax(-1) != expected.argmax(-1)) & clear
        assert not disagree.any(), f"{what}: argmax differs at positions {disagree.nonzero().flatten().tolist()}"


@pytest.fixture(scope="module", autouse=True)
def single_thread_torch():
    """Tiny matmuls run ~1000x faster on one thread than on an oversubscribed OpenMP pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the three checks every architecture runs -------------------------------------------------

def check_ragged_prefill(pair: ModelPair, model, *, device="cpu", tol=FP32_TOL, argmax_margin=None,
                         lengths=(1, 7, 13, 4), block_size: int = 4) -> None:
    """One step prefilling prompts of ragged lengths; logits at every position match HF."""
    vocab = pair.case.hf_config_kwargs()["vocab_size"]
    prompts = [random_tokens(n, vocab, seed=10 + i) for i, n in enumerate(lengths)]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    runner = PagedRunner(model, block_size=block_size, num_blocks=num_blocks, seed=1, device=device)
    outs = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)])
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_logits_match(out, pair.hf_logits(prompt), f"prompt {i} (len {len(prompt)})",
                            tol=tol, argmax_margin=argmax_margin)


def check_decode(pair: ModelPair, model, block_size: int, *, device="cpu", tol=FP32_TOL, argmax_margin=None,
                 num_decode_steps: int = 6, pad_rows: int = 1) -> None:
    """Prefill, then decode steps through the paged pool, with a late joiner whose prefill shares a
    step with the others' decodes; padding rows (slot -1) ride along. Every step matches HF."""
    vocab = pair.case.hf_config_kwargs()["vocab_size"]
    full = {name: random_tokens(n + num_decode_steps, vocab, seed=20 + i)
            for i, (name, n) in enumerate([("a", 5), ("b", 9), ("late", 3)])}
    prompt_len = {"a": 5, "b": 9, "late": 3}
    max_len = max(len(t) for t in full.values())
    runner = PagedRunner(model, block_size=block_size, num_blocks=3 * (-(-max_len // block_size)) + 4,
                         seed=2, device=device)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in full}
    fed = {name: 0 for name in full}

    def feed(names_and_counts):
        rows = [(name, full[name][fed[name]: fed[name] + n]) for name, n in names_and_counts]
        outs = runner.step(rows, pad_rows_to=len(rows) + pad_rows)
        for (name, n), out in zip(names_and_counts, outs):
            got[name].append(out)
            fed[name] += n

    feed([("a", prompt_len["a"]), ("b", prompt_len["b"])])
    feed([("a", 1), ("b", 1), ("late", prompt_len["late"])])   # decode rows + a prefill row
    for _ in range(num_decode_steps - 1):
        feed([("a", 1), ("b", 1), ("late", 1)])
    for name, tokens in full.items():
        actual = torch.cat(got[name])
        expected = pair.hf_logits(tokens[: fed[name]])
        assert_logits_match(actual, expected, f"seq {name}, block_size {block_size}",
                            tol=tol, argmax_margin=argmax_margin)


def check_chunked_and_prefix(pair: ModelPair, model, *, device="cpu", tol=FP32_TOL, argmax_margin=None,
                             block_size: int = 4, chunks=(3, 5, 3, 5, 1), prefix_tokens: int = 14) -> None:
    """A prompt prefilled in chunks matches one full prefill; a second request sharing its first
    ``prefix_tokens`` tokens resumes from the first's blocks (cached_len > 0) and matches too."""
    vocab = pair.case.hf_config_kwargs()["vocab_size"]
    prompt = random_tokens(sum(chunks), vocab, seed=30)
    runner = PagedRunner(model, block_size=block_size, num_blocks=3 * (-(-len(prompt) // block_size)) + 8,
                         seed=3, device=device)
    outs, start = [], 0
    for n in chunks:
        outs.append(runner.step([("first", prompt[start:start + n])])[0])
        start += n
    assert_logits_match(torch.cat(outs), pair.hf_logits(prompt), f"chunks {list(chunks)}",
                        tol=tol, argmax_margin=argmax_margin)

    second = prompt[:prefix_tokens] + random_tokens(6, vocab, seed=31)
    cached = runner.fork_prefix("first", "second", prefix_tokens)
    assert cached > 0 and cached % block_size == 0, "the test needs a prefix of at least one full block"
    tail = runner.step([("second", second[cached:])])[0]
    decode = runner.step([("second", [7]), ("first", [9])])
    expected_second = pair.hf_logits(second + [7])
    assert_logits_match(torch.cat([tail, decode[0]]), expected_second[cached:],
                        f"prefix hit ({cached} cached tokens)", tol=tol, argmax_margin=argmax_margin)
    assert_logits_match(decode[1], pair.hf_logits(prompt + [9])[-1:], "first after the fork",
                        tol=tol, argmax_margin=argmax_margin)


def run_all_checks(pair: ModelPair, model, *, device="cpu", tol=FP32_TOL, argmax_margin=None,
                   block_sizes=(1, 4, 16)) -> None:
    check_ragged_prefill(pair, model, device=device, tol=tol, argmax_margin=argmax_margin)
    for bs in block_sizes:
        check_decode(pair, model, bs, device=device, tol=tol, argmax_margin=argmax_margin)
    check_chunked_and_prefix(pair, model, device=device, tol=tol, argmax_margin=argmax_margin)


def backends_used(fn) -> set[tuple[str, str]]:
    """Run ``fn()`` and return the ``(op, backend)`` pairs that served it."""
    with ops.trace_backends() as calls:
        fn()
    return set(calls)


def check_parameter_names(pair: ModelPair, model) -> None:
    """atom_core's parameter names are HF's after the packed mapping (q/k/v -> qkv_proj, gate/up -> gate_up_proj)."""
    expected = set()
    for name, _ in pair.hf_model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
        for ckpt_module, (fused, _shard) in model.packed_modules_mapping.items():
            name = name.replace(f".{ckpt_module}.", f".{fused}.")
        expected.add(name)
    actual = {name for name, _ in model.named_parameters()}
    assert actual == expected, (
        f"only in atom_core: {sorted(actual - expected)}; only in HF: {sorted(expected - actual)}")


class HFParityChecks:
    """The checks every architecture's parity file runs against HF, in fp32 on the torch backend.

    A test file subclasses it (``class TestHFParity(HFParityChecks)``) and provides the ``pair``
    (checkpoint + HF model) and ``model`` (atom_core model loaded from it) fixtures.
    """

    def test_ragged_prefill_matches_hf(self, pair, model):
        with ops.use_backend("torch"):
            check_ragged_prefill(pair, model)

    @pytest.mark.parametrize("block_size", [1, 4, 16])
    def test_decode_through_paged_cache_matches_hf(self, pair, model, block_size):
        with ops.use_backend("torch"):
            check_decode(pair, model, block_size)

    def test_chunked_prefill_and_prefix_hit_match_hf(self, pair, model):
        with ops.use_backend("torch"):
            check_chunked_and_prefix(pair, model)

    def test_layout_of_another_block_size_is_refused_before_any_write(self, pair, model):
        runner = PagedRunner(model, block_size=4, num_blocks=4)
        pools = [t for layer in runner.pool.kv_caches for t in layer]
        pools += [t for tensors in runner.pool.extra_kv_caches.values() for t in tensors]
        before = [t.clone() for t in pools]
        layout = build_step_layout([5], [0], [[0]], 8)  # 5 tokens on one page of 8; the pool's pages hold 4
        with pytest.raises(ValueError, match="built with block_size=8 but .* holds 4 tokens per block"):
            model(torch.zeros(5, dtype=torch.long), layout.positions, layout)
        assert all(torch.equal(a, b) for a, b in zip(pools, before, strict=True))


def parity_pair_fixture(cases: list[ParityCase], build=None):
    """A module-scoped ``pair`` fixture over ``cases``: each case's checkpoint built once
    (``build(case, folder)``, default ``build_pair``). Its ``model`` comes from tests/models/conftest.py."""
    build = build or build_pair

    @pytest.fixture(scope="module", params=cases, ids=[c.name for c in cases], name="pair")
    def pair(request, tmp_path_factory):
        return build(request.param, tmp_path_factory.mktemp(request.param.name))

    return pair
