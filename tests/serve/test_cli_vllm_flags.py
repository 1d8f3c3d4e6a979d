"""The vLLM flags ``atom-core serve`` takes (and, for the engine ones, every command): each parsed into the
setting it names and that setting reaching the engine or the server; the flags for what atom_core does not
do refused by name with exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from atom_core.engine import Engine, SamplingParams
from atom_core.engine.engine import DEMO_MODEL
from atom_core.engine.logprobs import LOGPROBS_MODES
from atom_core.serve import cli
from atom_core.serve.engine_options import build_engine, checkpoint_path


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The commands set torch's thread count (--threads); put the test session's back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


@pytest.fixture
def engine_kwargs(monkeypatch):
    """What build_engine passes Engine.from_pretrained: {"path": ..., **kwargs} of the last call (the engine in
    this process: on a GPU machine serve would otherwise start it in a process of its own)."""
    from atom_core.serve import engine_options

    monkeypatch.setattr(engine_options, "engine_process", lambda args: False)
    seen = {}
    monkeypatch.setattr(Engine, "from_pretrained",
                        classmethod(lambda cls, path, **kwargs: seen.update(path=path, **kwargs)))
    return seen


def one_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# ---- --model PATH


def test_model_flag_is_the_checkpoint_path_and_reaches_the_engine(tmp_path, engine_kwargs):
    args = parse("serve", "--model", str(tmp_path), "--threads", "1")
    assert args.path is None and checkpoint_path(args) == str(tmp_path)
    build_engine(args)
    assert engine_kwargs["path"] == str(tmp_path)


def test_model_flag_and_path_naming_the_same_folder_are_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    args = parse("serve", tmp_path.name, "--model", str(tmp_path))
    assert checkpoint_path(args) == tmp_path.name


def test_model_flag_and_a_different_path_are_a_usage_error(tmp_path, capsys):
    assert cli.main(["serve", str(tmp_path), "--model", "/elsewhere", "--threads", "1"]) == 2
    assert "the checkpoint is given twice" in one_error_line(capsys)


def test_bench_keeps_model_as_the_served_model_name():
    args = parse("bench", "--url", "http://127.0.0.1:9", "--model", "m")
    assert args.model == "m" and checkpoint_path(args) is None


# ---- engine flags


@pytest.mark.parametrize("flags, want", [
    ([], True),
    (["--enable-prefix-caching"], True),
    (["--no-enable-prefix-caching"], False),
    (["--no-prefix-caching"], False),
])
def test_prefix_caching_flags_set_enable_prefix_caching(flags, want, engine_kwargs):
    args = parse("serve", *flags, "--threads", "1")
    assert args.enable_prefix_caching is want
    build_engine(args)
    assert engine_kwargs["enable_prefix_caching"] is want


@pytest.mark.parametrize("flags, want", [([], 20), (["--max-logprobs", "3"], 3), (["--max-logprobs", "0"], 0),
                                         (["--max-logprobs", "-1"], -1)])
def test_max_logprobs_flag_reaches_the_engine(flags, want, engine_kwargs):
    build_engine(parse("generate", *flags, "--threads", "1"))
    assert engine_kwargs["max_logprobs"] == want


def test_max_logprobs_is_the_limit_the_built_engine_enforces():
    engine = build_engine(parse("serve", "--max-logprobs", "2", "--device", "cpu", "--threads", "1"))
    assert engine.max_logprobs == 2
    with pytest.raises(ValueError, match="max_logprobs=2"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, logprobs=3))


def test_max_logprobs_below_minus_one_is_a_usage_error(capsys):
    assert cli.main(["serve", "--max-logprobs", "-2"]) == 2
    assert "--max-logprobs" in one_error_line(capsys)


def test_trust_remote_code_is_accepted_and_changes_nothing(engine_kwargs):
    args = parse("serve", "--trust-remote-code", "--threads", "1")
    assert args.trust_remote_code is True
    build_engine(args)
    with_flag = dict(engine_kwargs)
    build_engine(parse("serve", "--threads", "1"))
    assert with_flag == engine_kwargs


# ---- --generation-config


@pytest.fixture
def generation_folder(tmp_path) -> Path:
    """A folder holding only a generation_config.json: a temperature, a length and two EOS ids of its own."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 7,
                                                                 "eos_token_id": [5, 6]}))
    return tmp_path


def _engine(*flags: str) -> Engine:
    return build_engine(parse("serve", *flags, "--device", "cpu", "--threads", "1"))


def test_generation_config_auto_takes_the_checkpoints_defaults():
    checkpoint = json.loads((Path(DEMO_MODEL) / "generation_config.json").read_text())
    engine = _engine("--generation-config", "auto")
    assert engine.generation_defaults == {k: checkpoint[k] for k in ("temperature", "top_k", "top_p")}
    assert engine.default_sampling_params.temperature == checkpoint["temperature"]


def test_generation_config_vllm_drops_the_sampling_defaults_and_keeps_the_eos_ids(tmp_path):
    shutil.copytree(DEMO_MODEL, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [0, 9]}))
    auto, plain = _engine(str(tmp_path)), _engine(str(tmp_path), "--generation-config", "vllm")
    assert auto.generation_defaults and 9 in auto.eos_token_ids
    assert plain.generation_defaults == {} and plain.default_sampling_params == SamplingParams()
    assert plain.eos_token_ids == auto.eos_token_ids


def test_generation_config_folder_replaces_the_checkpoints_file(generation_folder):
    auto = _engine()
    engine = _engine("--generation-config", str(generation_folder))
    assert engine.generation_defaults == {"temperature": 0.3, "max_tokens": 7}
    assert engine.default_sampling_params.temperature == 0.3 and engine.default_sampling_params.top_p == 1.0
    assert {5, 6} <= engine.eos_token_ids and not {5, 6} & auto.eos_token_ids
    # the same weights: a greedy run gives the same tokens as the checkpoint alone (EOS ids aside)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert engine.generate([[40, 41, 42]], params, use_tqdm=False)[0].token_ids == \
        auto.generate([[40, 41, 42]], params, use_tqdm=False)[0].token_ids


def test_generation_config_reaches_from_pretrained(generation_folder, engine_kwargs):
    build_engine(parse("serve", "--generation-config", str(generation_folder), "--threads", "1"))
    assert engine_kwargs["generation_config"] == str(generation_folder)


@pytest.mark.parametrize("value", ["/no/such/folder", "EMPTY"])
def test_generation_config_without_a_file_is_a_usage_error_naming_the_flag(value, tmp_path, capsys):
    value = str(tmp_path) if value == "EMPTY" else value
    assert cli.main(["serve", "--generation-config", value, "--threads", "1"]) == 2
    assert f"--generation-config={value!r}: expected 'auto', 'vllm' or a folder" in one_error_line(capsys)


# ---- serve's own flags


@pytest.fixture
def served(monkeypatch):
    """run_serve up to uvicorn.run, on the demo model: {"config", "aliases", "run"} it passed on."""
    import uvicorn

    from atom_core.serve import app

    seen = {}
    create_app = app.create_app

    def record_app(async_engine, config):
        seen.update(config=config, aliases=config.model_aliases)
        return create_app(async_engine, config)

    monkeypatch.setattr(app, "create_app", record_app)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: seen.update(run=kwargs))
    return seen


def test_served_model_name_takes_several_names_and_no_path():
    args = parse("serve", "--served-model-name", "a", "b")
    assert args.served_model_name == ["a", "b"] and args.path is None


def test_served_model_name_first_is_the_response_name_and_the_rest_aliases(served):
    assert cli.main(["serve", "--served-model-name", "a", "b", "c", "--device", "cpu", "--threads", "1"]) == 0
    assert served["config"].model_name == "a" and list(served["aliases"]) == ["b", "c"]


def test_without_served_model_name_the_demo_is_served_under_its_name(served):
    assert cli.main(["serve", "--device", "cpu", "--threads", "1"]) == 0
    assert served["config"].model_name == "atom_core-demo" and list(served["aliases"]) == []


@pytest.mark.parametrize("flags, want", [([], True), (["--enable-log-requests"], True),
                                         (["--disable-log-requests"], False)])
def test_log_requests_flags_turn_the_access_log_on_or_off(flags, want, served):
    assert parse("serve", *flags).log_requests is want
    assert cli.main(["serve", *flags, "--device", "cpu", "--threads", "1"]) == 0
    assert served["run"]["access_log"] is want


@pytest.mark.parametrize("argv", [["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"],
                                  ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]])
def test_tool_call_flags_are_refused_saying_tool_call_parsing_is_not_implemented(argv, capsys):
    assert cli.main(["serve", *argv]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: {argv[0]}: tool-call parsing is not implemented")
    assert "unrecognized" not in line


def test_help_says_what_the_no_op_and_refused_flags_do(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--trust-remote-code accepted for vLLM command lines and does nothing" in text
    assert "--enable-auto-tool-choice refused: tool-call parsing is not implemented" in text


@pytest.mark.parametrize("flags, want", [([], False), (["--enable-sleep-mode"], True)])
def test_enable_sleep_mode_flag_reaches_the_engine(flags, want, engine_kwargs):
    build_engine(parse("serve", *flags, "--threads", "1"))
    assert engine_kwargs["enable_sleep_mode"] is want


def test_the_built_engine_sleeps_with_enable_sleep_mode():
    engine = build_engine(parse("generate", "--enable-sleep-mode", "--device", "cpu", "--threads", "1"))
    engine.sleep(level=1)
    assert engine.is_sleeping


# ---- --logprobs-mode


@pytest.mark.parametrize("flags, want", [([], "raw_logprobs")] + [(["--logprobs-mode", m], m) for m in LOGPROBS_MODES])
def test_logprobs_mode_flag_reaches_the_engine(flags, want, engine_kwargs):
    build_engine(cli.build_parser().parse_args(["serve", *flags, "--threads", "1"]))
    assert engine_kwargs["logprobs_mode"] == want


def test_the_built_engine_returns_what_the_flag_names():
    args = cli.build_parser().parse_args(["generate", "--logprobs-mode", "processed_logits", "--device", "cpu",
                                          "--threads", "1"])
    engine = build_engine(args)
    assert engine.logprobs_mode == engine.runner.logprobs_mode == "processed_logits"


def test_an_unknown_logprobs_mode_flag_is_a_usage_error(capsys):
    assert cli.main(["serve", "--logprobs-mode", "processed", "--threads", "1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--logprobs-mode" in lines[0]
    assert "processed_logprobs" in lines[0]  # the choices are named
