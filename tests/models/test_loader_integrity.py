"""What the loader refuses or warns about, each naming the file and tensor: corrupt and truncated
shards, dtype changes other than float casts, NaN/Inf, a tied head that differs from the embedding,
and links out of the folder (with a Hugging Face cache snapshot's links into its blobs allowed)."""

import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import atom_core.models.checkpoint_files as checkpoint_files_module
import atom_core.models.loader as loader_module
from atom_core.models import load_model
from atom_core.models.checkpoint_files import read_safetensors_header
from atom_core.models.loader import count_non_finite, load_weights, max_abs_difference
from tests.models.test_loader import (
    assert_matches_checkpoint,
    hf_tensors,
    model_of,
    tiny_config,
    write_sharded,
    write_single,
)


def header_and_body(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def write_raw(path, header, body):
    """A safetensors file with this header (padded to 8 bytes, as the format does) and data bytes."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


def spy_on_safe_open(monkeypatch):
    opened = []
    real = checkpoint_files_module.safe_open

    def spy(path, *args, **kwargs):
        opened.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files_module, "safe_open", spy)
    return opened


# --- corrupt and truncated shards ---------------------------------------------------------


def test_truncated_shard_is_named_before_any_shard_is_opened_for_data(tmp_path, monkeypatch):
    t = hf_tensors()
    names = list(t)
    folder = write_sharded(tmp_path / "ckpt", {"model-00001-of-00002.safetensors": {k: t[k] for k in names[:5]},
                                                "model-00002-of-00002.safetensors": {k: t[k] for k in names[5:]}})
    second = folder / "model-00002-of-00002.safetensors"
    second.write_bytes(second.read_bytes()[:-100])  # an interrupted download
    opened = spy_on_safe_open(monkeypatch)
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors: truncated") as err:
        load_weights(model_of(), folder)
    assert str(second) in str(err.value)
    assert opened == []  # the first shard's data was not read either


def corrupt(header, body):
    """(name, header, body) variants of one good file that safetensors refuses."""
    a, b = header["a"], header["b"]
    yield "unknown dtype", {**header, "a": {**a, "dtype": "Q9"}}, body
    yield "shape that does not match the offsets", {**header, "a": {**a, "shape": [4, 5]}}, body
    yield "bad entry", {**header, "a": {**a, "data_offsets": "0-64"}}, body
    yield "gap between tensors", {**header, "b": {**b, "data_offsets": [b["data_offsets"][0] + 8,
                                                                     b["data_offsets"][1] + 8]}}, body + bytes(8)
    yield "bytes after the last tensor", header, body + bytes(8)


@pytest.mark.parametrize("case", ["unknown dtype", "shape that does not match the offsets", "bad entry",
                                  "gap between tensors", "bytes after the last tensor"])
def test_corrupt_header_is_refused_naming_the_file(tmp_path, case):
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.ones(8)}, str(good))
    header, body = header_and_body(good)
    bad = tmp_path / "model.safetensors"
    _, bad_header, bad_body = next(c for c in corrupt(header, body) if c[0] == case)
    write_raw(bad, bad_header, bad_body)
    with pytest.raises(ValueError, match="corrupt") as err:
        read_safetensors_header(bad)
    assert str(bad) in str(err.value)


@pytest.mark.parametrize("head", [b"\xff\xfe not json", b"[1, 2]", b"{not json"])
def test_unparsable_header_is_refused_naming_the_file(tmp_path, head):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(len(head).to_bytes(8, "little") + head)
    with pytest.raises(ValueError, match="corrupt safetensors header") as err:
        load_weights(model_of(), tmp_path)
    assert str(bad) in str(err.value)


def test_safetensors_library_error_is_reraised_naming_the_file_and_tensor(tmp_path):
    # F6_E2M3 is a valid safetensors dtype that torch cannot hold: the library refuses it on reading.
    bad = tmp_path / "model.safetensors"
    write_raw(bad, {"model.norm.weight": {"dtype": "F6_E2M3", "shape": [8], "data_offsets": [0, 6]}}, bytes(6))

    class NormOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.norm = nn.Module()
            self.model.norm.weight = nn.Parameter(torch.ones(8), requires_grad=False)

    with pytest.raises(ValueError, match="cannot read tensor 'model.norm.weight'") as err:
        load_weights(NormOnly(), tmp_path)
    assert str(bad) in str(err.value)


def test_index_naming_a_missing_shard_is_refused_naming_both(tmp_path):
    t = hf_tensors()
    folder = write_sharded(tmp_path / "ckpt", {"model-00001-of-00002.safetensors": t})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"model.safetensors.index.json names "
                                                r"model-00002-of-00002.safetensors, which does not exist"):
        load_weights(model_of(), folder)


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"{broken"])
def test_index_that_is_not_json_text_is_refused_naming_it(tmp_path, content):
    folder = write_single(tmp_path / "ckpt", hf_tensors())
    (folder / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: not valid JSON"):
        load_weights(model_of(), folder)


# --- dtypes ------------------------------------------------------------------------------------


class IntParamModel(nn.Module):
    """One float weight and one int32 parameter (a stand-in for integer data a model keeps)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.proj.codes = nn.Parameter(torch.zeros(4, dtype=torch.int32), requires_grad=False)


@pytest.mark.parametrize("name,stored,param_dtype", [
    ("proj.weight", torch.zeros(2, 3, dtype=torch.int32), "torch.float32"),   # int data into a float weight
    ("proj.weight", torch.zeros(2, 3, dtype=torch.bool), "torch.float32"),
    ("proj.codes", torch.zeros(4, dtype=torch.float32), "torch.int32"),       # float data into an int parameter
    ("proj.codes", torch.zeros(4, dtype=torch.int64), "torch.int32"),         # int to another int: not a cast either
])
def test_dtype_other_than_a_float_cast_is_refused_naming_tensor_both_dtypes_and_file(tmp_path, name, stored,
                                                                                     param_dtype):
    t = {"proj.weight": torch.zeros(2, 3), "proj.codes": torch.zeros(4, dtype=torch.int32), name: stored}
    folder = write_single(tmp_path / "ckpt", t)
    with pytest.raises(ValueError) as err:
        load_weights(IntParamModel(), folder)
    msg = str(err.value)
    assert f"'{name}'" in msg and str(stored.dtype) in msg and param_dtype in msg
    assert str(folder / "model.safetensors") in msg


def test_int32_stored_for_a_fused_float_weight_is_refused(tmp_path):
    t = hf_tensors()
    t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"].to(torch.int32)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight'.*torch.int32.*"
                                         r"'model.layers.0.self_attn.qkv_proj.weight' is torch.float32"):
        load_weights(model_of(), write_single(tmp_path / "ckpt", t))


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16, torch.float64])
def test_float_to_float_casts_load(tmp_path, stored):
    t = {k: v.to(stored) for k, v in hf_tensors().items()}
    model = model_of()
    load_weights(model, write_single(tmp_path / "ckpt", t))
    assert_matches_checkpoint(model, {k: v.float() for k, v in t.items()})


def test_matching_integer_dtype_loads(tmp_path):
    codes = torch.arange(4, dtype=torch.int32)
    model = IntParamModel()
    load_weights(model, write_single(tmp_path / "ckpt", {"proj.weight": torch.ones(2, 3), "proj.codes": codes}))
    assert torch.equal(model.proj.codes, codes)


# --- NaN / Inf ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_weight_is_refused_naming_tensor_and_file(tmp_path, bad, dtype):
    t = {k: v.to(dtype) for k, v in hf_tensors().items()}
    t["model.layers.1.self_attn.v_proj.weight"][1, 2] = bad
    folder = write_single(tmp_path / "ckpt", t)
    with pytest.raises(ValueError, match="1 of 32 values are NaN or Inf") as err:
        load_weights(model_of(), folder)
    msg = str(err.value)
    assert "'model.layers.1.self_attn.v_proj.weight'" in msg and str(folder / "model.safetensors") in msg
    assert "check_finite=False" in msg


def test_check_finite_false_loads_non_finite_weights(tmp_path):
    t = hf_tensors()
    t["model.norm.weight"][0] = float("nan")
    folder = write_single(tmp_path / "ckpt", t)
    model = model_of()
    load_weights(model, folder, check_finite=False)
    assert torch.isnan(model.model.norm.weight[0])


def test_load_model_checks_finite_by_default_and_passes_the_option(tmp_path):
    t = hf_tensors()
    t["lm_head.weight"][3, 3] = float("inf")
    folder = write_single(tmp_path / "m", t)
    (folder / "config.json").write_text(json.dumps(tiny_config()))
    with pytest.raises(ValueError, match="'lm_head.weight'.*NaN or Inf"):
        load_model(folder, device="cpu")
    assert torch.isinf(load_model(folder, device="cpu", check_finite=False).lm_head.weight[3, 3])


def test_count_non_finite_counts_exactly_across_chunks_and_overflowing_sums(monkeypatch):
    monkeypatch.setattr(loader_module, "_FINITE_CHUNK", 7)
    huge = torch.full((30,), torch.finfo(torch.float32).max)  # finite, but every chunk's sum overflows
    assert count_non_finite(huge) == 0
    huge[[3, 20]] = float("nan")
    huge[29] = float("-inf")
    assert count_non_finite(huge) == 3
    assert count_non_finite(torch.tensor([1.0, float("nan")]).to(torch.float8_e4m3fn)) == 1
    assert count_non_finite(torch.arange(5)) == 0  # integers hold no NaN


def test_max_abs_difference_is_chunked_and_keeps_nan(monkeypatch):
    monkeypatch.setattr(loader_module, "_FINITE_CHUNK", 3)
    a = torch.zeros(4, 5)
    b = a.clone()
    b[3, 4] = -0.25
    assert max_abs_difference(a, b) == 0.25
    b[0, 0] = float("nan")
    assert max_abs_difference(a, b) != max_abs_difference(a, b)  # NaN


# --- tied embeddings ---------------------------------------------------------------------------

LOADER = "atom_core.models.loader"  # (the tiny config's made-up model_type makes ModelConfig warn too)


def test_tied_head_that_differs_from_the_embedding_warns_naming_it_and_the_max_difference(tmp_path, caplog):
    t = hf_tensors()
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    t["lm_head.weight"][4, 1] += 0.5
    model = model_of(tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING, logger="atom_core.models.loader"):
        report = load_weights(model, write_single(tmp_path / "ckpt", t))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == LOADER]
    assert len(warnings) == 1
    assert "'lm_head.weight'" in warnings[0] and "'model.embed_tokens.weight'" in warnings[0]
    assert "max |difference| 0.5" in warnings[0]
    assert "differs" in report.skipped["lm_head.weight"]
    assert torch.equal(model.lm_head.weight, t["model.embed_tokens.weight"])  # the embedding is what is used


def test_tied_head_of_another_shape_warns_with_both_shapes(tmp_path, caplog):
    t = hf_tensors()
    t["lm_head.weight"] = torch.zeros(3, 3)
    with caplog.at_level(logging.WARNING, logger="atom_core.models.loader"):
        load_weights(model_of(tie_word_embeddings=True), write_single(tmp_path / "ckpt", t))
    assert "shape (3, 3) vs (10, 8)" in caplog.text


def test_tied_head_identical_to_the_embedding_is_silent(tmp_path, caplog):
    t = hf_tensors()
    t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    with caplog.at_level(logging.DEBUG, logger="atom_core.models.loader"):
        report = load_weights(model_of(tie_word_embeddings=True), write_single(tmp_path / "ckpt", t))
    assert [r for r in caplog.records if r.name == LOADER] == []
    assert report.skipped["lm_head.weight"] == "tied to the input embedding"


# --- links: a Hugging Face cache snapshot --------------------------------------------------------


def hf_cache_snapshot(hub, tensors, *, with_index, repo="models--org--tiny", revision="0123abcd"):
    """The layout huggingface_hub writes: ``<hub>/<repo>/blobs/<hash>`` files and
    ``<hub>/<repo>/snapshots/<revision>/<file>`` links to ``../../blobs/<hash>``; returns the snapshot."""
    staging = hub / "staging"
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": {k: tensors[k] for k in names[: len(names) // 2]},
              "model-00002-of-00002.safetensors": {k: tensors[k] for k in names[len(names) // 2:]}}
    if with_index:
        write_sharded(staging, shards)
    else:
        staging.mkdir(parents=True)
        for file_name, part in shards.items():
            save_file(part, str(staging / file_name))
    (staging / "config.json").write_text(json.dumps(tiny_config()))
    blobs, snapshot = hub / repo / "blobs", hub / repo / "snapshots" / revision
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(staging.iterdir())):
        blob = f"{i:040x}"  # stands for the file's sha256 / git hash
        file.rename(blobs / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / file.name)
    staging.rmdir()
    return snapshot


@pytest.mark.parametrize("with_index", [True, False])
def test_hf_cache_snapshot_links_into_its_blobs_load(tmp_path, with_index):
    t = hf_tensors()
    snapshot = hf_cache_snapshot(tmp_path / "hub", t, with_index=with_index)
    assert (snapshot / "model.safetensors.index.json").is_symlink() == with_index
    model = load_model(snapshot, device="cpu")
    assert_matches_checkpoint(model, t)
    report = load_weights(model_of(), snapshot)
    assert sorted(os.path.basename(p) for p in report.files_read) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]  # named as the snapshot names them


@pytest.mark.parametrize("target", ["../../../models--other--repo/blobs/stolen", "../../../../outside.safetensors"])
def test_hf_cache_snapshot_link_leaving_its_repository_is_refused(tmp_path, target):
    snapshot = hf_cache_snapshot(tmp_path / "hub", hf_tensors(), with_index=True)
    outside = (snapshot / target).resolve()
    outside.parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(1)}, str(outside))
    link = snapshot / "model-00002-of-00002.safetensors"
    link.unlink()
    os.symlink(target, link)
    with pytest.raises(ValueError, match=r"refusing shard path 'model-00002-of-00002.safetensors' that resolves "
                                         r"outside .*models--org--tiny"):
        load_weights(model_of(), snapshot)


def test_snapshot_folder_outside_a_models_repository_gets_no_wider_root(tmp_path):
    snapshot = hf_cache_snapshot(tmp_path / "hub", hf_tensors(), with_index=True, repo="not-a-cache-repo")
    with pytest.raises(ValueError, match="refusing shard path"):
        load_weights(model_of(), snapshot)


def test_plain_folder_link_out_is_still_refused_with_an_index(tmp_path):
    t = hf_tensors()
    elsewhere = write_sharded(tmp_path / "elsewhere", {"a.safetensors": t})
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(elsewhere / "a.safetensors", folder / "a.safetensors")
    (folder / "model.safetensors.index.json").write_text((elsewhere / "model.safetensors.index.json").read_text())
    with pytest.raises(ValueError, match="refusing shard path 'a.safetensors' that resolves outside"):
        load_weights(model_of(), folder)


def test_hf_cache_link_to_a_missing_blob_names_the_shard_and_the_link(tmp_path):
    snapshot = hf_cache_snapshot(tmp_path / "hub", hf_tensors(), with_index=True)
    (snapshot / "model-00002-of-00002.safetensors").resolve().unlink()  # a blob lost to a cache cleanup
    with pytest.raises(FileNotFoundError, match=r"names model-00002-of-00002.safetensors, which does not exist "
                                                r"\(a link to .*blobs.*, which is missing\)"):
        load_weights(model_of(), snapshot)
