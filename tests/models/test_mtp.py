"""The MTP draft module (``atom_core.models.mtp``) against a plain-torch twin of the DeepSeek-V3 report's
equations, and its parameter names against the released checkpoints' MTP tensors.

Transformers does not implement MTP. A tiny checkpoint is made by saving an HF model with N + 1 decoder
layers (the last one becomes the MTP block, checkpoint layer N) and the MTP glue tensors (``enorm``,
``hnorm``, ``eh_proj``, ``shared_head.norm``, and for DeepSeek-V3 the copies ``embed_tokens`` /
``shared_head.head``), with config.json saying N layers and ``num_nextn_predict_layers: 1``. The twin:

    h    = HF's target hidden at p (its first N layers, final norm)
    h'   = eh_proj [RMSNorm_enorm(Emb(t_{p+1})); RMSNorm_hnorm(h)]      (embedding half first, as released)
    h''  = HF's decoder layer N (the checkpoint's MTP block) over h', causal, no cache
    logits = lm_head(RMSNorm_shared_head.norm(h''))

atom_core runs the target and the draft step by step through paged pools (shuffled blocks, block sizes
1 / 4 / 16, a late joiner, chunked prefill, a prefix hit), the draft one position behind as in speculative
decoding: position p's draft token is t_{p+1}, its hidden the target's at p, its slots the target's.
"""

# T tokens, E hidden, V vocabulary, N target layers, L sequence length

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from atom_core import ops  # noqa: E402
from atom_core.cache import build_step_layout  # noqa: E402
from atom_core.models.mtp import MultiTokenPredictor, load_mtp_module  # noqa: E402
from tests.models import parity_harness  # noqa: E402
from tests.models.moe_parity import build_moe_pair  # noqa: E402
from tests.models.parity_harness import (  # noqa: E402,F401  (single_thread_torch is an autouse fixture)
    FP32_TOL,
    ParityCase,
    ShuffledKVPool,
    random_tokens,
    single_thread_torch,
)
from tests.models.test_parity_deepseek import MLA, yarn  # noqa: E402
from tests.models.test_parity_deepseek_v32 import DSA  # noqa: E402  (registers the V3.2 HF classes)

REFERENCE = Path("/work/shared/reference/configs")
V3_CASE = ParityCase("v3_mtp", "deepseek_v3", "DeepseekV3ForCausalLM",
                     {**MLA, "q_lora_rank": 24, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                      "norm_topk_prob": True, "num_hidden_layers": 3, "rope_parameters": yarn(4.0, 1.0, 0.8)})
V32_CASE = ParityCase("v32_mtp", "deepseek_v32", "DeepseekV32ForCausalLM",
                      {**DSA, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "num_hidden_layers": 3})
GLUE = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


class MTPPair:
    """The checkpoint folder, the HF model of N + 1 layers (layer N = the MTP block) and the glue tensors."""

    def __init__(self, case: ParityCase, folder: Path, *, shared_copies: bool) -> None:
        from safetensors.torch import save_file

        pair = build_moe_pair(case, folder)          # N + 1 layers, random weights, saved
        self.hf = pair.hf_model
        self.num_layers = case.overrides["num_hidden_layers"] - 1
        config_path = folder / "config.json"
        config = json.loads(config_path.read_text())
        config["num_hidden_layers"], config["num_nextn_predict_layers"] = self.num_layers, 1
        for key in ("mlp_layer_types", "layer_types", "indexer_types"):  # per-layer lists: the N decoder layers
            if isinstance(config.get(key), list):
                config[key] = config[key][: self.num_layers]
        config_path.write_text(json.dumps(config, indent=2))
        hidden = config["hidden_size"]
        gen = torch.Generator().manual_seed(5)
        self.glue = {"enorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
                     "hnorm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen),
                     "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen) / math.sqrt(2 * hidden),
                     "shared_head.norm.weight": 1 + 0.2 * torch.randn(hidden, generator=gen)}
        tensors = {f"model.layers.{self.num_layers}.{name}": value for name, value in self.glue.items()}
        if shared_copies:  # DeepSeek-V3 ships copies of the embedding and head in the MTP layer
            tensors[f"model.layers.{self.num_layers}.embed_tokens.weight"] = self.hf.model.embed_tokens.weight.detach()
            tensors[f"model.layers.{self.num_layers}.shared_head.head.weight"] = self.hf.lm_head.weight.detach()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "mtp.safetensors"))
        self.path = folder
        self.eps = config["rms_norm_eps"]

    @torch.no_grad()
    def twin_logits(self, tokens: list[int]) -> torch.Tensor:
        """The report's MTP module 1 over t_0 .. t_{L-1} with next tokens t_1 .. t_L: logits [L, V] (fp32)."""
        ids = torch.tensor([tokens[:-1]])
        length = ids.shape[1]
        out = self.hf.model(input_ids=ids, output_hidden_states=True)
        h = self.hf.model.norm(out.hidden_states[self.num_layers])[0]                     # [L, E] target hidden

        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

        emb = self.hf.model.embed_tokens(torch.tensor(tokens[1:]))                        # Emb(t_{p+1})
        x = F.linear(torch.cat([rms(emb, self.glue["enorm.weight"]), rms(h, self.glue["hnorm.weight"])], -1),
                     self.glue["eh_proj.weight"])[None]                                    # [1, L, E]
        positions = torch.arange(length)[None]
        cos_sin = self.hf.model.rotary_emb(x, position_ids=positions)
        mask = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
        y = self.hf.model.layers[self.num_layers](x, attention_mask=mask, position_ids=positions,
                                                  position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        return self.hf.lm_head(rms(y[0], self.glue["shared_head.norm.weight"])).float()

    def hf_target_hidden(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out = self.hf.model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
            return self.hf.model.norm(out.hidden_states[self.num_layers])[0]


class DraftRunner:
    """Target and draft through their own paged pools over the same shuffled block ids; ``step`` runs the
    target on each row's new tokens and the draft on the same positions with the next tokens."""

    def __init__(self, target, draft, *, block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.target, self.draft, self.block_size = target, draft, block_size
        self.target_pool = ShuffledKVPool(target, num_blocks, block_size, seed=seed)
        self.draft_pool = ShuffledKVPool(draft, num_blocks, block_size, seed=seed + 1)
        for model, pool in ((target, self.target_pool), (draft, self.draft_pool)):
            model.bind_kv_cache(pool.kv_caches)
            if pool.extra_kv_caches:
                model.bind_extra_kv_caches(pool.extra_kv_caches)
        self.fed: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}

    def fork(self, source: str, new: str, num_tokens: int) -> int:
        blocks = num_tokens // self.block_size
        self.tables[new], self.fed[new] = self.tables[source][:blocks], blocks * self.block_size
        return self.fed[new]

    @torch.no_grad()
    def step(self, rows: list[tuple[str, list[int], int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """rows: (seq, full token list, how many new tokens) -> per row (target hidden, draft logits)."""
        query_lens, cached_lens, tables, ids, next_ids = [], [], [], [], []
        for seq, tokens, n in rows:
            start = self.fed.setdefault(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < start + n:
                table.append(self.target_pool.allocate())
            query_lens.append(n), cached_lens.append(start), tables.append(list(table))
            ids += tokens[start:start + n]
            next_ids += tokens[start + 1:start + n + 1]
            self.fed[seq] = start + n
        layout = build_step_layout(query_lens, cached_lens, tables, self.block_size, pad_rows_to=len(rows) + 1)
        pad = layout.num_tokens - len(ids)
        ids, next_ids = torch.tensor(ids + [0] * pad), torch.tensor(next_ids + [0] * pad)
        hidden = self.target(ids, layout.positions, layout)
        logits = self.draft.compute_logits(self.draft(next_ids, layout.positions, hidden, layout))
        starts = layout.cu_seqlens_q.tolist()
        return [(hidden[starts[r]:starts[r + 1]], logits[starts[r]:starts[r + 1]]) for r in range(len(rows))]


@pytest.fixture(scope="module", params=[V3_CASE, V32_CASE], ids=lambda c: c.name)
def mtp_pair(request, tmp_path_factory):
    case = request.param
    return MTPPair(case, tmp_path_factory.mktemp(case.name), shared_copies=case is V3_CASE)


@pytest.fixture(scope="module")
def loaded(mtp_pair):
    from atom_core.models import load_model

    target = load_model(mtp_pair.path, dtype=torch.float32, device="cpu")
    return target, load_mtp_module(mtp_pair.path, target)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_draft_logits_through_the_paged_pools_equal_the_report_equations(mtp_pair, loaded, block_size):
    """A prefill of two prompts, a late joiner whose prefill shares a step with decodes, then decode steps."""
    target, draft = loaded
    vocab = mtp_pair.hf.config.vocab_size
    full = {name: random_tokens(n, vocab, seed=40 + i) for i, (name, n) in enumerate([("a", 13), ("b", 21),
                                                                                      ("late", 9)])}
    runner = DraftRunner(target, draft, block_size=block_size, num_blocks=3 * (-(-21 // block_size)) + 4)
    got = {name: [] for name in full}
    schedule = [[("a", 6), ("b", 12)], [("a", 1), ("b", 1), ("late", 4)]] + [[("a", 1), ("b", 1), ("late", 1)]] * 4
    with ops.use_backend("torch"):
        for rows in schedule:
            outs = runner.step([(name, full[name], n) for name, n in rows])
            for (name, _), (_, logits) in zip(rows, outs):
                got[name].append(logits)
    for name, tokens in full.items():
        fed = runner.fed[name]
        parity_harness.assert_logits_match(torch.cat(got[name]), mtp_pair.twin_logits(tokens[:fed + 1]),
                                           f"draft of {name}, block size {block_size}")


def test_chunked_prefill_and_a_prefix_hit_read_the_drafts_own_cached_rows(mtp_pair, loaded):
    """The draft's row at position p depends on the token at p + 1: a prefix hit of c tokens serves the draft only
    when token c matches too (a runner drops the last hit block otherwise, as vLLM does); here it does, and the
    draft of the second request reads the 12 rows the first one cached."""
    target, draft = loaded
    vocab = mtp_pair.hf.config.vocab_size
    first = random_tokens(20, vocab, seed=50)
    second = first[:13] + random_tokens(6, vocab, seed=51)
    runner = DraftRunner(target, draft, block_size=4, num_blocks=24, seed=3)
    with ops.use_backend("torch"):
        chunks = [runner.step([("first", first, n)])[0] for n in (5, 7, 7)]
        hidden = torch.cat([h for h, _ in chunks])
        torch.testing.assert_close(hidden, mtp_pair.hf_target_hidden(first[:19]), **FP32_TOL)  # the draft's input
        parity_harness.assert_logits_match(torch.cat([lg for _, lg in chunks]), mtp_pair.twin_logits(first),
                                           "chunks 5 / 7 / 7")
        cached = runner.fork("first", "second", 12)
        (_, tail), = runner.step([("second", second, len(second) - 1 - cached)])
    assert cached == 12
    parity_harness.assert_logits_match(tail, mtp_pair.twin_logits(second)[cached:], f"prefix hit ({cached} cached)")


def test_the_draft_block_and_glue_really_matter(mtp_pair, loaded):
    """The twin's logits move when the block is skipped or the concat order swapped (else parity is vacuous)."""
    tokens = random_tokens(12, mtp_pair.hf.config.vocab_size, seed=60)
    want = mtp_pair.twin_logits(tokens)
    swapped = dict(mtp_pair.glue)
    hidden = swapped["eh_proj.weight"].shape[0]
    mtp_pair.glue["eh_proj.weight"] = torch.cat([swapped["eh_proj.weight"][:, hidden:],
                                                 swapped["eh_proj.weight"][:, :hidden]], dim=1)
    try:
        assert (mtp_pair.twin_logits(tokens) - want).abs().max() > 1e-2
    finally:
        mtp_pair.glue.update(swapped)


def test_the_module_shares_the_targets_embedding_and_head_and_has_its_own_caches(mtp_pair, loaded):
    target, draft = loaded
    names = {name for name, _ in draft.named_parameters()}
    assert not any("embed_tokens" in n or "lm_head" in n or "shared_head.head" in n for n in names)
    assert draft.target is target
    spec = draft.kv_cache_spec()
    assert spec.num_layers == 1 and spec.head_dim == target.kv_cache_spec().head_dim
    assert set(draft.extra_kv_cache_specs()) == set(target.extra_kv_cache_specs())
    torch.testing.assert_close(draft.layers[0].eh_proj.weight, mtp_pair.glue["eh_proj.weight"])


def test_a_config_without_mtp_layers_is_refused_by_name(loaded):
    target, _ = loaded
    with pytest.raises(ValueError, match="no MTP layers"):
        MultiTokenPredictor(target, num_layers=0)


def _copy_without(mtp_pair, folder, drop) -> None:
    """mtp_pair's checkpoint copied into folder, less the tensors for which drop(name) holds."""
    from safetensors.torch import load_file, save_file

    for file in mtp_pair.path.iterdir():
        if file.suffix == ".safetensors":
            save_file({k: v for k, v in load_file(str(file)).items() if not drop(k)}, str(folder / file.name))
        else:
            (folder / file.name).write_bytes(file.read_bytes())


def test_a_checkpoint_missing_an_mtp_expert_is_refused_naming_its_tensors_as_the_checkpoint_does(mtp_pair, loaded,
                                                                                               tmp_path):
    target, _ = loaded
    prefix = f"model.layers.{mtp_pair.num_layers}.mlp.experts.1."
    _copy_without(mtp_pair, tmp_path, lambda k: k.startswith(prefix + "gate_proj.") or k == prefix + "down_proj.weight")
    with pytest.raises(ValueError) as refused:
        load_mtp_module(tmp_path, target)
    message = str(refused.value)
    assert f"{prefix}gate_proj.weight" in message and f"{prefix}down_proj.weight" in message
    assert "shards" not in message and "w13_weight (" in message


def test_a_checkpoint_missing_an_mtp_tensor_is_refused_naming_it_as_the_checkpoint_does(mtp_pair, loaded, tmp_path):
    target, _ = loaded
    name = f"model.layers.{mtp_pair.num_layers}.hnorm.weight"
    _copy_without(mtp_pair, tmp_path, lambda k: k == name)
    with pytest.raises(ValueError, match=rf"1 MTP tensors not found in checkpoint .*: {re.escape(name)}$"):
        load_mtp_module(tmp_path, target)


def test_a_checkpoint_without_its_mtp_layer_is_refused_as_having_no_draft_layers(mtp_pair, loaded, tmp_path):
    target, _ = loaded
    index = mtp_pair.num_layers
    _copy_without(mtp_pair, tmp_path, lambda k: k.startswith(f"model.layers.{index}."))
    with pytest.raises(ValueError, match=rf"holds no tensor of MTP layer {index} \(model\.layers\.{index}\.\*\), "
                                         r"which config\.json's num_nextn_predict_layers = 1 announces"):
        load_mtp_module(tmp_path, target)


# ---- names against the released checkpoints (atom_core/../shared/reference/mtp_weights.md) ----------------------------

def _release_target(name: str, drop: tuple[str, ...] = ()):
    """The full-size model of a released config.json on the meta device (no memory), quantization_config dropped
    (the fp8 block scales ``*.weight_scale_inv`` are the quantized linear methods' parameters, not listed)."""
    from atom_core.models import ModelConfig, get_model_class

    path = REFERENCE / name
    if not path.is_file():
        pytest.skip(f"{path} not available")
    config = {k: v for k, v in json.loads(path.read_text()).items()
              if not k.startswith("_") and k not in ("quantization_config", *drop)}
    config = ModelConfig.from_dict(config)
    cls = get_model_class(config.architectures[0])
    return cls(config, dtype=torch.bfloat16, device="meta")


def _checkpoint_names(draft: MultiTokenPredictor) -> dict[str, tuple[int, ...]]:
    """The draft's parameters as checkpoint tensor names (gate/up unfused, experts unstacked) with shapes."""
    names = {}
    for name, param in draft.named_parameters():
        ckpt = draft.checkpoint_name(name)
        stacked = re.fullmatch(r"(.*\.experts)\.(w13_weight|w2_weight)", ckpt)
        if stacked:
            prefix, which = stacked.groups()
            parts = ("gate_proj", "up_proj") if which == "w13_weight" else ("down_proj",)
            rows = param.shape[1] // len(parts)
            for e in range(param.shape[0]):
                for part in parts:
                    names[f"{prefix}.{e}.{part}.weight"] = (rows, param.shape[2])
        elif ".gate_up_proj." in ckpt:
            for part in ("gate_proj", "up_proj"):
                names[ckpt.replace("gate_up_proj", part)] = (param.shape[0] // 2, param.shape[1])
        else:
            names[ckpt] = tuple(param.shape)
    return names


def _mtp_listing(layer: int, *, experts: int, shared_copies: bool, indexer: bool) -> set[str]:
    """The MTP layer's tensor names as mtp_weights.md lists them (weight_scale_inv left out)."""
    glue = ["enorm", "hnorm", "eh_proj", "shared_head.norm", "input_layernorm", "post_attention_layernorm"]
    glue += [f"self_attn.{m}" for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                         "q_a_layernorm", "kv_a_layernorm")]
    glue += ["mlp.gate"] + [f"mlp.shared_experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    glue += [f"mlp.experts.{e}.{p}" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")]
    if shared_copies:
        glue += ["embed_tokens", "shared_head.head"]
    if indexer:
        glue += [f"self_attn.indexer.{m}" for m in ("wq_b", "wk", "weights_proj", "k_norm")]
    names = {f"model.layers.{layer}.{m}.weight" for m in glue}
    names.add(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
    if indexer:
        names.add(f"model.layers.{layer}.self_attn.indexer.k_norm.bias")
    return names


def test_deepseek_v3_mtp_parameter_names_are_the_released_layer_61_tensors():
    target = _release_target("deepseek-v3.json")
    draft = MultiTokenPredictor(target)
    names = _checkpoint_names(draft)
    # Read from the target instead (its README: shared with the main model's embedding and head).
    shared = {"model.layers.61.embed_tokens.weight", "model.layers.61.shared_head.head.weight"}
    assert not shared & set(names) and all(draft.checkpoint_renames(n) is None for n in shared)
    assert set(names) | shared == _mtp_listing(61, experts=256, shared_copies=True, indexer=False)
    assert names["model.layers.61.eh_proj.weight"] == (7168, 14336)
    assert names["model.layers.61.mlp.gate.weight"] == (256, 7168)
    assert all(draft.checkpoint_renames(n) is not None for n in names)


def test_glm5_mtp_parameter_names_are_the_released_layer_78_tensors_with_their_shapes():
    target = _release_target("glm-5.json")
    draft = MultiTokenPredictor(target)
    names = _checkpoint_names(draft)
    assert set(names) == _mtp_listing(78, experts=256, shared_copies=False, indexer=True)
    listed_shapes = {"eh_proj": (6144, 12288), "self_attn.q_a_proj": (2048, 6144), "self_attn.q_b_proj": (16384, 2048),
                     "self_attn.kv_a_proj_with_mqa": (576, 6144), "self_attn.kv_b_proj": (28672, 512),
                     "self_attn.o_proj": (6144, 16384), "self_attn.indexer.wq_b": (4096, 2048),
                     "self_attn.indexer.wk": (128, 6144), "self_attn.indexer.weights_proj": (32, 6144),
                     "self_attn.indexer.k_norm": (128,), "mlp.gate": (256, 6144)}
    for module, shape in listed_shapes.items():
        assert names[f"model.layers.78.{module}.weight"] == shape, module
