"""Loading safetensors checkpoints into small models built from the parallel layers.

Checkpoints are written here in the Hugging Face naming (separate q/k/v and gate/up tensors);
the expected fused parameters are assembled with torch.cat / torch.chunk in the tests.
"""

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import atom_core.models.checkpoint_files as checkpoint_files_module
from atom_core.models import ModelConfig, build_model, load_model, register_model, supported_architectures
from atom_core.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_core.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom_core.models.checkpoint_files import read_safetensors_header
from atom_core.models.loader import load_weights
from atom_core.models.registry import get_model_class

# V = vocab, D = hidden, H/K = query/KV heads, hd = head dim, I = intermediate
V, D, H, K, HD, I, LAYERS = 10, 8, 4, 2, 2, 6, 2


def tiny_config(**overrides) -> ModelConfig:
    d = dict(architectures=["AtomTinyTestForCausalLM"], model_type="tiny_test", vocab_size=V, hidden_size=D,
             intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=H, num_key_value_heads=K,
             head_dim=HD, tie_word_embeddings=False)
    d.update(overrides)
    return d


class RMSNormWeight(nn.Module):
    def __init__(self, dim, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)


class TinyLayer(nn.Module):
    def __init__(self, tp_rank, tp_size, dtype):
        super().__init__()
        tp = dict(tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = QKVParallelLinear(D, HD, H, K, **tp)
        self.self_attn.o_proj = RowParallelLinear(H * HD, D, **tp)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = MergedColumnParallelLinear(D, [I, I], **tp)
        self.mlp.down_proj = RowParallelLinear(I, D, **tp)
        self.input_layernorm = RMSNormWeight(D, dtype)


@register_model("AtomTinyTestForCausalLM")
class TinyModel(nn.Module):
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, *, dtype=None, device=None, tp_rank=0, tp_size=1):
        super().__init__()
        self.config = config
        self.processed = 0
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(V, D, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.model.layers = nn.ModuleList(TinyLayer(tp_rank, tp_size, dtype) for _ in range(config.num_hidden_layers))
        self.model.norm = RMSNormWeight(D, dtype)
        self.lm_head = ParallelLMHead(V, D, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def process_weights_after_loading(self):
        self.processed += 1


def hf_tensors(seed=0, layers=LAYERS, lm_head=True):
    """A full, unsharded checkpoint in HF names."""
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(V, D, generator=g), "model.norm.weight": torch.randn(D, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = torch.randn(H * HD, D, generator=g)
        t[p + "self_attn.k_proj.weight"] = torch.randn(K * HD, D, generator=g)
        t[p + "self_attn.v_proj.weight"] = torch.randn(K * HD, D, generator=g)
        t[p + "self_attn.o_proj.weight"] = torch.randn(D, H * HD, generator=g)
        t[p + "mlp.gate_proj.weight"] = torch.randn(I, D, generator=g)
        t[p + "mlp.up_proj.weight"] = torch.randn(I, D, generator=g)
        t[p + "mlp.down_proj.weight"] = torch.randn(D, I, generator=g)
        t[p + "input_layernorm.weight"] = torch.randn(D, generator=g)
    if lm_head:
        t["lm_head.weight"] = torch.randn(V, D, generator=g)
    return t


def write_single(folder, tensors):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def write_sharded(folder, groups: dict[str, dict]):
    """groups: file name -> tensors; writes the files and an index naming them."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file_name, tensors in groups.items():
        save_file(tensors, str(folder / file_name))
        weight_map.update({name: file_name for name in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def model_of(dtype=torch.float32, **overrides):
    return TinyModel(ModelConfig.from_dict(tiny_config(**overrides)), dtype=dtype)


def assert_matches_checkpoint(model, t, layers=LAYERS):
    sd = dict(model.named_parameters())
    assert torch.equal(sd["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([t[p + "self_attn.q_proj.weight"], t[p + "self_attn.k_proj.weight"],
                         t[p + "self_attn.v_proj.weight"]])
        assert torch.equal(sd[p + "self_attn.qkv_proj.weight"], qkv)
        gate_up = torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]])
        assert torch.equal(sd[p + "mlp.gate_up_proj.weight"], gate_up)
        assert torch.equal(sd[p + "mlp.down_proj.weight"], t[p + "mlp.down_proj.weight"])


def test_single_file_loads_every_parameter(tmp_path):
    t = hf_tensors()
    folder = write_single(tmp_path / "ckpt", t)
    model = model_of()
    report = load_weights(model, folder)
    assert_matches_checkpoint(model, t)
    assert torch.equal(model.lm_head.weight, t["lm_head.weight"])
    assert sorted(report.loaded) == sorted(n for n, _ in model.named_parameters())
    assert report.missing == [] and report.unused == [] and report.skipped == {}
    assert model.processed == 1  # process_weights_after_loading ran once


def test_tensor_parallel_rank_loads_its_shard(tmp_path):
    t = hf_tensors()
    folder = write_single(tmp_path / "ckpt", t)
    cfg = ModelConfig.from_dict(tiny_config())
    model = TinyModel(cfg, tp_rank=1, tp_size=2)
    load_weights(model, folder)
    p = "model.layers.0."
    sd = dict(model.named_parameters())
    # rank 1 of 2: query heads 2, 3 -> rows 4..7 of q; KV head 1 -> rows 2..3 of k and v
    expected_qkv = torch.cat([t[p + "self_attn.q_proj.weight"][4:8], t[p + "self_attn.k_proj.weight"][2:4],
                              t[p + "self_attn.v_proj.weight"][2:4]])
    assert torch.equal(sd[p + "self_attn.qkv_proj.weight"], expected_qkv)
    assert torch.equal(sd[p + "mlp.down_proj.weight"], t[p + "mlp.down_proj.weight"][:, 3:6])
    assert torch.equal(sd["model.embed_tokens.weight"], t["model.embed_tokens.weight"][5:10])


def test_dtype_cast_to_parameter_dtype(tmp_path):
    t = hf_tensors()
    folder = write_single(tmp_path / "ckpt", t)
    model = model_of(dtype=torch.bfloat16)
    load_weights(model, folder)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"].to(torch.bfloat16))


def test_sharded_index_skips_shards_holding_nothing_wanted(tmp_path, monkeypatch):
    t = hf_tensors(layers=LAYERS + 1)  # layer 2 lies beyond num_hidden_layers = 2
    layer2 = {k: v for k, v in t.items() if k.startswith("model.layers.2.")}
    layer2["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(1)
    rest = {k: v for k, v in t.items() if k not in layer2}
    first = dict(list(rest.items())[: len(rest) // 2])
    second = {k: v for k, v in rest.items() if k not in first}
    folder = write_sharded(tmp_path / "ckpt", {"a.safetensors": first, "b.safetensors": second,
                                                 "mtp.safetensors": layer2})
    save_file({"model.norm.weight": torch.zeros(D)}, str(folder / "stray.safetensors"))  # not in the index
    opened = []
    real_safe_open = checkpoint_files_module.safe_open

    def spy(path, *args, **kwargs):
        opened.append(path)
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files_module, "safe_open", spy)
    model = model_of()
    report = load_weights(model, folder)
    assert_matches_checkpoint(model, t)
    assert sorted(p.rsplit("/", 1)[-1] for p in opened) == ["a.safetensors", "b.safetensors"]
    assert report.files_read == opened
    assert all("num_hidden_layers" in report.skipped[k] for k in layer2 if "layers.2." in k)
    assert "rotary" in report.skipped["model.layers.0.self_attn.rotary_emb.inv_freq"]


def test_extra_layers_loaded_when_asked(tmp_path):
    t = hf_tensors(layers=LAYERS + 1)
    folder = write_single(tmp_path / "ckpt", t)
    report = load_weights(model_of(), folder, load_extra_layers=True)
    # The model has no layer 2, so its tensors are now unused rather than skipped.
    assert "model.layers.2.mlp.down_proj.weight" in report.unused
    assert not any("layers.2." in k for k in report.skipped)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors"])
def test_index_entry_outside_folder_refused(tmp_path, entry):
    folder = write_single(tmp_path / "ckpt", hf_tensors())
    save_file({"x": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    index = {"weight_map": {"model.embed_tokens.weight": "model.safetensors", "x": entry}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="refusing"):
        load_weights(model_of(), folder)


def test_duplicate_index_entries_keep_the_first(tmp_path):
    t = hf_tensors()
    folder = write_single(tmp_path / "ckpt", t)
    save_file({"model.norm.weight": torch.zeros(D)}, str(folder / "other.safetensors"))
    pairs = [f'"{name}": "model.safetensors"' for name in t] + ['"model.norm.weight": "other.safetensors"']
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {' + ", ".join(pairs) + "}}")
    model = model_of()
    load_weights(model, folder)
    assert torch.equal(model.model.norm.weight, t["model.norm.weight"])


def test_missing_tensors_are_named(tmp_path):
    t = hf_tensors()
    del t["model.layers.1.mlp.down_proj.weight"]
    del t["model.layers.0.self_attn.v_proj.weight"]
    folder = write_single(tmp_path / "ckpt", t)
    with pytest.raises(ValueError) as err:
        load_weights(model_of(), folder)
    msg = str(err.value)
    assert "2 parameters not found" in msg
    assert "model.layers.1.mlp.down_proj.weight" in msg
    assert "model.layers.0.self_attn.qkv_proj.weight (shards ['v'] missing)" in msg
    report = load_weights(model_of(), folder, strict=False)
    assert len(report.missing) == 2


def test_expected_missing_patterns_are_not_errors(tmp_path):
    t = {k: v for k, v in hf_tensors().items() if "input_layernorm" not in k}
    folder = write_single(tmp_path / "ckpt", t)
    model = model_of()
    model.expected_missing = {"model.layers.*.input_layernorm.weight"}
    report = load_weights(model, folder)
    assert sorted(report.expected_missing) == [f"model.layers.{i}.input_layernorm.weight" for i in range(LAYERS)]
    assert report.missing == []


def test_unexpected_tensors_reported_and_logged(tmp_path, caplog):
    t = hf_tensors()
    t["model.vision_tower.proj.weight"] = torch.zeros(2, 2)
    folder = write_single(tmp_path / "ckpt", t)
    with caplog.at_level(logging.WARNING, logger="atom_core.models.loader"):
        report = load_weights(model_of(), folder)
    assert report.unused == ["model.vision_tower.proj.weight"]
    assert "model.vision_tower.proj.weight" in caplog.text


def test_shape_mismatch_names_the_tensor_and_shapes(tmp_path):
    t = hf_tensors()
    t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(K * HD + 1, D)
    folder = write_single(tmp_path / "ckpt", t)
    with pytest.raises(ValueError) as err:
        load_weights(model_of(), folder)
    msg = str(err.value)
    assert "'model.layers.1.self_attn.k_proj.weight'" in msg
    assert "model.layers.1.self_attn.qkv_proj.weight" in msg
    assert f"({K * HD + 1}, {D})" in msg and f"({K * HD}, {D})" in msg


def test_tied_embeddings_absent_or_ignored(tmp_path):
    t = hf_tensors(lm_head=False)
    model = model_of(tie_word_embeddings=True)
    load_weights(model, write_single(tmp_path / "a", t))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, t["model.embed_tokens.weight"])
    t2 = hf_tensors(lm_head=True)  # a checkpoint that also stores the head: ignored when tied
    model = model_of(tie_word_embeddings=True)
    report = load_weights(model, write_single(tmp_path / "b", t2))
    assert torch.equal(model.lm_head.weight, t2["model.embed_tokens.weight"])
    assert "tied" in report.skipped["lm_head.weight"]


class ScaledModel(nn.Module):
    """A block-FP8-like layer: weight plus a weight_scale parameter."""

    def __init__(self):
        super().__init__()
        self.proj = ReplicatedLinear(4, 4)
        self.proj.weight_scale = nn.Parameter(torch.empty(2, 2), requires_grad=False)


def test_weight_scale_inv_renamed(tmp_path):
    scale = torch.arange(4.0).reshape(2, 2)
    folder = write_single(tmp_path / "ckpt", {"proj.weight": torch.eye(4), "proj.weight_scale_inv": scale})
    model = ScaledModel()
    report = load_weights(model, folder)
    assert torch.equal(model.proj.weight_scale, scale)
    assert sorted(report.loaded) == ["proj.weight", "proj.weight_scale"]


class SplitModel(nn.Module):
    """Keeps q/k/v apart while the checkpoint stores one fused 'qkv' tensor (list form of the mapping)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Module()
        self.attn.q_proj = ReplicatedLinear(3, 4)
        self.attn.k_proj = ReplicatedLinear(3, 2)
        self.attn.v_proj = ReplicatedLinear(3, 2)
        self.packed_modules_mapping = {"qkv": [("q_proj", 4), ("k_proj", 2), ("v_proj", 2)]}

    def checkpoint_renames(self, name):
        if name.startswith("vision."):
            return None
        return name.replace("transformer.", "")


def test_list_mapping_splits_a_fused_tensor_and_renames(tmp_path):
    fused = torch.arange(24.0).reshape(8, 3)
    folder = write_single(tmp_path / "ckpt", {"transformer.attn.qkv.weight": fused, "vision.x": torch.zeros(1)})
    model = SplitModel()
    report = load_weights(model, folder)
    assert torch.equal(model.attn.q_proj.weight, fused[0:4])
    assert torch.equal(model.attn.k_proj.weight, fused[4:6])
    assert torch.equal(model.attn.v_proj.weight, fused[6:8])
    assert report.skipped == {"vision.x": "dropped by checkpoint_renames"}


def test_duplicate_tensor_across_files_without_index_keeps_first(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"proj.weight": torch.ones(4, 4), "proj.weight_scale": torch.ones(2, 2)}, str(folder / "a.safetensors"))
    save_file({"proj.weight": torch.zeros(4, 4)}, str(folder / "b.safetensors"))
    model = ScaledModel()
    with caplog.at_level(logging.WARNING, logger="atom_core.models.loader"):
        load_weights(model, folder)
    assert torch.equal(model.proj.weight, torch.ones(4, 4))
    assert "more than one shard" in caplog.text


def test_header_reader_and_corrupt_files(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(2, 3)}, str(path))
    header = read_safetensors_header(path)
    assert list(header) == ["a"] and header["a"]["shape"] == [2, 3]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="corrupt"):
        read_safetensors_header(bad)


# --- load_model / build_model -------------------------------------------------------------


def write_model_folder(folder, tensors, **config_overrides):
    write_single(folder, tensors)
    (folder / "config.json").write_text(json.dumps(tiny_config(**config_overrides)))
    return folder


def test_load_model_end_to_end(tmp_path):
    t = hf_tensors()
    folder = write_model_folder(tmp_path / "m", t)
    model = load_model(folder, device="cpu")
    assert not model.training
    assert model.model.embed_tokens.weight.dtype == torch.float32  # CPU default
    assert_matches_checkpoint(model, t)
    assert load_model(folder, device="cpu", dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found") as missing:
        load_model(tmp_path / "nope")
    assert "huggingface-cli" not in str(missing.value)  # a path, not a Hub id
    with pytest.raises(FileNotFoundError, match=r"model folder not found: Org/Model-0\.6B \(atom_core loads local "
                       r"folders only; .* `huggingface-cli download Org/Model-0\.6B --local-dir Model-0\.6B`"):
        load_model("Org/Model-0.6B")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty")
    (tmp_path / "noshards").mkdir()
    (tmp_path / "noshards" / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(tmp_path / "noshards", device="cpu")
    assert load_model(tmp_path / "noshards", device="cpu", load_format="dummy") is not None
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps(tiny_config(architectures=["NopeForCausalLM"])))
    with pytest.raises(ValueError, match="unsupported architecture.*AtomTinyTestForCausalLM"):
        load_model(tmp_path / "unknown", device="cpu")
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path / "noshards", load_format="pickle")


def test_quantised_checkpoint_the_architecture_cannot_load_is_refused_by_name(tmp_path):
    folder = write_single(tmp_path / "awq", hf_tensors())
    config = tiny_config(quantization_config={"quant_method": "awq", "bits": 4})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='awq'.*unquantised"):
        load_model(folder, device="cpu")
    assert load_model(folder, device="cpu", load_format="dummy") is not None  # shapes only: fine


def test_build_model_dummy_is_seeded_and_zeros_are_zero():
    a = build_model(tiny_config(), device="cpu", seed=1)
    b = build_model(ModelConfig.from_dict(tiny_config()), device="cpu", seed=1)
    c = build_model(tiny_config(), device="cpu", seed=2)
    wa, wb, wc = (m.model.layers[0].self_attn.qkv_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert 0.01 < wa.std().item() < 0.04  # normal(0, 0.02)
    assert torch.equal(a.model.norm.weight, torch.ones(D))  # vectors (norm scales) set to 1
    assert a.processed == 1
    z = build_model(tiny_config(), device="cpu", load_format="zeros")
    assert all(torch.count_nonzero(p) == 0 for p in z.parameters())
    with pytest.raises(ValueError, match="load_format"):
        build_model(tiny_config(), load_format="auto")


def test_registry_lists_builtin_and_registered():
    names = supported_architectures()
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "AtomTinyTestForCausalLM"} <= set(names)
    with pytest.raises(ValueError, match="already registered"):
        register_model("AtomTinyTestForCausalLM")(ScaledModel)


def test_an_installed_packages_entry_point_registers_its_architecture_in_a_fresh_process(tmp_path):
    """What worker ranks, the server's engine process and the CLI start: interpreters that never import the user's
    module. A package's ``atom_core.models`` entry point reaches them (here a .dist-info on the path)."""
    (tmp_path / "tinyarch.py").write_text(
        "from atom_core.models.llama import LlamaForCausalLM\n\nclass TinyArch(LlamaForCausalLM):\n    pass\n")
    dist = tmp_path / "tinyarch_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tinyarch-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[atom_core.models]\nTinyArchForCausalLM = tinyarch:TinyArch\n")
    code = ("import sys; from atom_core.models import supported_architectures; "
            "from atom_core.models.registry import resolve_architecture; "
            "name, cls = resolve_architecture(['TinyArchForCausalLM']); "
            "print(cls.__module__, cls.__name__, 'TinyArchForCausalLM' in supported_architectures(), "
            "'tinyarch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["tinyarch", "TinyArch", "True", "True"], out.stderr


def test_one_class_file_imported_under_two_module_names_registers_without_error_and_the_latest_serves(
        tmp_path, monkeypatch):
    (tmp_path / "twice.py").write_text(
        "from atom_core.models import register_model\nfrom atom_core.models.llama import LlamaForCausalLM\n\n"
        "@register_model('AtomTwiceImportedForCausalLM')\nclass Twice(LlamaForCausalLM):\n    pass\n")
    classes = []
    for name in ("twice", "pkg.twice"):
        spec = importlib.util.spec_from_file_location(name, tmp_path / "twice.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # as an import does
        spec.loader.exec_module(module)  # the second registration sees another module name, the same file
        classes.append(module.Twice)
    # the latest definition serves, as after a module reload
    assert classes[0] is not classes[1] and get_model_class("AtomTwiceImportedForCausalLM") is classes[1]


@pytest.mark.parametrize("looked_up_first", [False, True])
def test_a_class_registered_under_a_shipped_name_replaces_it_whatever_was_looked_up_before(monkeypatch, caplog,
                                                                                          looked_up_first):
    """It used to work in a fresh process and raise once a checkpoint of that architecture had loaded."""
    from atom_core.models import registry
    from atom_core.models.llama import LlamaForCausalLM

    monkeypatch.setattr(registry, "_registered", dict(registry._registered))  # (undone after the test)
    if looked_up_first:
        assert registry.get_model_class("MistralForCausalLM") is LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):
        pass

    with caplog.at_level("WARNING", logger="atom_core.models.registry"):
        register_model("MistralForCausalLM")(MyLlama)
    assert registry.get_model_class("MistralForCausalLM") is MyLlama
    assert "replaces atom_core's atom_core.models.llama:LlamaForCausalLM" in caplog.text
    register_model("MistralForCausalLM")(LlamaForCausalLM)  # the shipped class again (its module re-imported)
    assert registry.get_model_class("MistralForCausalLM") is MyLlama

    class Other(LlamaForCausalLM):
        pass

    with pytest.raises(ValueError, match="already registered to .*MyLlama"):
        register_model("MistralForCausalLM")(Other)
