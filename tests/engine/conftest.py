"""Tiny random HF checkpoints for engine tests (transformers is the reference), and shared checks."""

import pytest
import torch


def _save(tmp_path_factory, name, hf_cls, config):
    torch.manual_seed(0)
    model = hf_cls(config).eval()
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # A large init range makes greedy continuations vary from token to token.
    config = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
                         initializer_range=0.3, eos_token_id=95, bos_token_id=0)
    return _save(tmp_path_factory, "qwen3", Qwen3ForCausalLM, config)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=80, hidden_size=48, intermediate_size=100, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=3, max_position_embeddings=256, tie_word_embeddings=False,
                         initializer_range=0.3, eos_token_id=79, bos_token_id=0)
    return _save(tmp_path_factory, "llama", LlamaForCausalLM, config)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                            tie_word_embeddings=False, initializer_range=0.3, eos_token_id=95, bos_token_id=0)
    return _save(tmp_path_factory, "qwen3_moe", Qwen3MoeForCausalLM, config)


def hf_greedy(hf_model, prompt, max_new_tokens):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_batch_mirrors_block_manager(sched):
    """The running batch's tables are the block manager's, row by row, and its rows are dense."""
    batch = sched.batch
    assert sorted(r.request_id for r in batch.requests) == sorted(r.request_id for r in sched.running)
    for row, request in enumerate(batch.requests):
        assert request.row == row
        n = int(batch.num_pages[row])
        assert batch.block_table[row, :n].tolist() == sched.block_manager.block_table(request.request_id)
        assert (batch.block_table[row, n:] == -1).all()
    assert (batch.block_table[batch.num_rows:] == -1).all()


# ---- checkpoint B for the weight-update tests: A's class and config, another seed

_B_CACHE: dict[str, tuple] = {}


def _checkpoint_b(name: str, hf_a, tmp_path_factory):
    """(folder, HF model) of B: A's class and config, seed 1; saved once per session."""
    if name not in _B_CACHE:
        torch.manual_seed(1)
        hf_b = type(hf_a)(hf_a.config).eval()
        folder = tmp_path_factory.mktemp(f"{name}_b")
        hf_b.save_pretrained(folder)
        _B_CACHE[name] = (folder, hf_b)
    return _B_CACHE[name]


@pytest.fixture
def pair(request, tmp_path_factory):
    """(A's folder, B's folder, B's HF model) for the fixture named by the parameter (default tiny_qwen3)."""
    name = getattr(request, "param", "tiny_qwen3")
    folder_a, hf_a = request.getfixturevalue(name)
    folder_b, hf_b = _checkpoint_b(name, hf_a, tmp_path_factory)
    return folder_a, folder_b, hf_b
