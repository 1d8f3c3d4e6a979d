"""``atom-core``: generate, chat over stdin (answers equal ``Engine.chat``), bench offline and online
(against the live test server), one-line user errors, and the base install (no FastAPI, uvicorn,
prometheus_client, pydantic) running everything but ``serve``, which names the extra to install."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from atom_core.engine import SamplingParams
from atom_core.serve import cli
from atom_core.serve.engine_options import FALLBACK_CHAT_TEMPLATE, model_folder
from tests.serve.conftest import API_KEY, demo_engine

ROOT = Path(__file__).resolve().parents[2]
SERVE_ONLY = ("fastapi", "uvicorn", "starlette", "prometheus_client", "pydantic", "openai")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """The commands set torch's thread count (--threads); put the test session's back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_generate_prints_every_prompt_and_the_token_rate(capsys):
    prompts = ["Return the number of", "Create a new"]
    # --device cpu: the reference is demo_engine(), the demo on the CPU in fp32 (the default: a GPU where present)
    assert cli.main(["generate", "--device", "cpu", "--max-tokens", "5", "--threads", "1", "--prompt", prompts[0],
                     "--prompt", prompts[1], "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    want = demo_engine().generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    for prompt, ref in zip(prompts, want):
        assert f"--- {prompt!r}\n{prompt}{ref.text}\n" in out
    assert "tokens/s (2 prompts, device cpu)" in out


def test_generate_over_two_data_parallel_replicas_prints_the_one_engine_text(capsys):
    prompts = ["Return the number of", "Create a new", "Open the"]
    argv = ["generate", "--device", "cpu", "--max-tokens", "5", "--threads", "1", "--temperature", "0",
            "--data-parallel-size", "2"]
    assert cli.main(argv + [arg for prompt in prompts for arg in ("--prompt", prompt)]) == 0
    out = capsys.readouterr().out
    want = demo_engine().generate(prompts, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    for prompt, ref in zip(prompts, want):
        assert f"--- {prompt!r}\n{prompt}{ref.text}\n" in out


FRONT_PROMPTS = ["Return the number of", "Create a new"]


def _served_texts(front) -> list[str]:
    """The completions of FRONT_PROMPTS (greedy, 5 tokens) from a live server over ``front``, in prompt order."""
    from tests.serve.conftest import LiveServer

    live = LiveServer(front).start()
    try:
        got = live.client().completions.create(model="demo", prompt=FRONT_PROMPTS, max_tokens=5, temperature=0)
    finally:
        live.stop()
    return [choice.text for choice in sorted(got.choices, key=lambda c: c.index)]


def test_a_server_over_two_data_parallel_replicas_answers_as_one_engine(monkeypatch):
    from atom_core.engine import DataParallelEngine

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    want = demo_engine().generate(FRONT_PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    with DataParallelEngine(None, data_parallel_size=2, device="cpu", step_timeout=60) as front:
        got = _served_texts(front)
    assert got == [ref.text for ref in want]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_server_over_a_data_parallel_front_on_cuda_answers_as_one_engine():
    """The front's device is plain "cuda" (its replica owns the GPU): the step thread selects no GPU."""
    from atom_core.engine import DataParallelEngine

    with DataParallelEngine(None, data_parallel_size=1, device="cuda", step_timeout=120) as front:
        want = front.generate(FRONT_PROMPTS, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
        got = _served_texts(front)
    assert got == [ref.text for ref in want]


def test_chat_answers_each_stdin_line_as_engine_chat_does_and_stops_at_exit(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Open a file\n\n/reset\nClose it\n/exit\nnever read\n"))
    assert cli.main(["chat", "--device", "cpu", "--threads", "1", "--max-tokens", "12", "--temperature", "0",
                     "--system", "You write docstrings."]) == 0
    out = capsys.readouterr().out
    engine = demo_engine()
    params = SamplingParams(temperature=0, max_tokens=12, stop=["\nuser:"])
    system = {"role": "system", "content": "You write docstrings."}
    want = [engine.chat([system, {"role": "user", "content": text}], params, chat_template=FALLBACK_CHAT_TEMPLATE,
                        use_tqdm=False)[0].text
            for text in ("Open a file", "Close it")]  # /reset: each is a fresh conversation
    assert out == "".join(f"assistant: {w}\n" for w in want)


def test_chat_goes_on_past_undecodable_bytes_and_trims_whole_exchanges(tmp_path, monkeypatch, capsys):
    """A line of bytes that are not UTF-8 is read with U+FFFD in their place; a long chat drops its oldest
    exchange whole, so a template that requires alternating roles keeps rendering."""
    strict = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
              "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    template = tmp_path / "strict.jinja"
    template.write_text(strict)
    lines = b"hello\n\xff bad\n" + b"".join(b"open the file number %d please\n" % i for i in range(8))
    stdin = tmp_path / "stdin"
    stdin.write_bytes(lines)
    with stdin.open("rb") as raw:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw))
        assert cli.main(["chat", "--threads", "1", "--max-tokens", "12", "--temperature", "0", "--max-model-len",
                         "96", "--chat-template", str(template)]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant:") == 10


def test_generate_and_the_demo_fit_a_run_whose_context_holds_one_output_token(capsys):
    from atom_core import demo

    args = ["--prompt", "Return the number of", "--max-tokens", "1", "--max-model-len", "6", "--threads", "1",
            "--temperature", "0", "--dtype", "auto"]
    assert cli.main(["generate", *args]) == 0 and demo.main(args) == 0
    assert capsys.readouterr().out.count("1 tokens in") == 2


def test_a_served_checkpoint_is_named_after_its_folder_even_given_as_dot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli._model_name(".") == tmp_path.name
    (tmp_path / "config.json").write_text("{}")
    assert cli._model_name("config.json") == "config"


def test_bench_offline_reports_throughput(tmp_path, capsys):
    path = tmp_path / "offline.json"
    assert cli.main(["bench", "--offline", "--threads", "1", "--num-prompts", "6", "--input-len", "8:16",
                     "--output-len", "4:8", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    [row] = result["rows"]
    assert result["meta"]["torch"] == torch.__version__ and result["meta"]["gpu"]
    assert row["requests"] == 6 and 24 <= row["output_tokens"] <= 48 and row["output_tokens_per_s"] > 0
    assert "output_tokens_per_s" in capsys.readouterr().out


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_online_against_the_live_server_reports_latencies(server, tmp_path, endpoint):
    path = tmp_path / "online.json"
    assert cli.main(["bench", "--url", server.url, "--api-key", API_KEY, "--endpoint", endpoint, "--rate", "inf",
                     "200", "--num-prompts", "8", "--input-len", "8:16", "--output-len", "4:8",
                     "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["rate"] for r in rows] == [None, 200]  # inf is written as null
    for row in rows:
        assert row["requests"] == 8 and row["failed"] == 0, row
        assert row["output_tokens_per_s"] > 0
        assert all(math.isfinite(row[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "e2e_p99_ms",
                                                   "tpot_p50_ms", "tpot_mean_ms", "ttft_mean_ms", "itl_mean_ms"))
        assert row["max_concurrency"] is None
    server.assert_no_block_leaked()


@pytest.mark.parametrize("flags, named", [
    (["--model", "/some/checkpoint"], "--model: online only"),
    (["--rate", "4", "--endpoint", "chat"], "--rate, --endpoint: online only"),
    (["--api-key", "k", "--max-concurrency", "2", "--no-ignore-eos"], "--api-key, --max-concurrency, --no-ignore-eos"),
])
def test_bench_offline_refuses_the_online_only_flags_by_name(flags, named, capsys, monkeypatch):
    monkeypatch.setattr(cli, "build_engine", lambda args: pytest.fail("an engine was built"))
    assert cli.main(["bench", "--offline", "--num-prompts", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "not with --offline" in err


def test_bench_scales_lengths_that_do_not_fit_the_context():
    from atom_core.serve.bench import make_workload

    workload = make_workload(20, (100, 1024), (100, 1024), 2048, 0, 512)
    assert "scaled by 0.25" in workload.note
    assert all(len(p) + m <= 512 for p, m in zip(workload.prompts, workload.output_lens))
    assert make_workload(3, (4, 8), (2, 3), 50, 7, 512).prompts == make_workload(3, (4, 8), (2, 3), 50, 7, None).prompts


def test_bench_against_a_server_listing_no_model_asks_for_model(monkeypatch, capsys):
    from atom_core.serve import bench

    async def lists_none(url, api_key):
        return None, None, None

    monkeypatch.setattr(bench, "server_info", lists_none)
    assert cli.main(["bench", "--url", "http://127.0.0.1:9"]) == 2
    assert "lists no model; name one with --model" in capsys.readouterr().err


def test_version_prints_the_package_version(capsys):
    from atom_core import __version__

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"atom-core {__version__}"


@pytest.mark.parametrize("argv, says", [
    (["generate", "/no/such/folder"], "no such folder"),
    (["generate", __file__], "not a folder"),
    (["generate", "--dtype", "fp13"], "expected 'auto' or one of"),
    (["generate", "Qwen/Qwen3-0.6B"], "huggingface-cli download Qwen/Qwen3-0.6B"),
    (["generate", "--max-tokens", "0"], "--max-tokens"),
    (["chat", "--temperature", "nan"], "--temperature"),
    (["bench", "--offline", "--input-len", "9:3"], "--input-len"),
    (["bench", "--url", "http://127.0.0.1:9"], "could not read /v1/models"),
    (["bench"], "--offline"),
    (["bench", "--url", "http://127.0.0.1:9", "--rate", "0"], "--rate must be > 0"),
    (["serve", "--device", "tpu"], "--device"),
    (["generate", "--expert-exchange", "all_gather"], "--expert-exchange"),
    (["generate", "--data-parallel-size", "0"], "--data-parallel-size"),
    (["generate", "--dp-attention"], "--dp-attention needs --data-parallel-size > 1"),
    (["nothing"], "invalid choice"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests"),
    (["generate", "--threads", str((os.cpu_count() or 1) + 1)], "--threads"),
    (["chat", "--chat-template", "/no/such/template.jinja"], "--chat-template '/no/such/template.jinja': no such file"),
    (["bench", "--offline", "--json", "/"], "--json '/'"),
    (["generate", "--seed", "-5"], "--seed"),
    (["bench", "--offline", "--seed", str(2**64)], "--seed"),
    # the engine's errors name the flags, not the library's parameters
    (["generate", "--threads", "1", "--max-model-len", "100000"], "error: --max-model-len=100000 exceeds"),
    (["generate", "--threads", "1", "--dtype", "int3"], "error: --dtype: unsupported dtype 'int3'"),
    (["generate", "--threads", "1", "--num-kv-blocks", "1"], "error: --num-kv-blocks=1 cannot hold"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_user_errors_print_one_error_line_and_return_2(argv, says, capsys):
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_a_bare_config_with_dummy_weights_takes_the_tokenizer_and_chat_template_beside_it(tmp_path, capsys):
    from atom_core.engine.engine import DEMO_MODEL

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(DEMO_MODEL) / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    argv = ["--device", "cpu", "--threads", "1", "--max-tokens", "3", "--load-format", "dummy"]
    assert cli.main(["generate", str(tmp_path / "config.json"), *argv, "--prompt", "Return the"]) == 0
    assert "--- 'Return the'\nReturn the" in capsys.readouterr().out
    folder = model_folder(str(tmp_path / "config.json"), "dummy")
    assert sorted(p.name for p in Path(folder).iterdir()) == ["chat_template.jinja", "config.json", "tokenizer.json",
                                                               "tokenizer_config.json"]


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_without_a_tokenizer_refuse_naming_what_it_needs(tmp_path, capsys, monkeypatch, command):
    from atom_core.engine.engine import DEMO_MODEL

    (tmp_path / "model.json").write_bytes((Path(DEMO_MODEL) / "config.json").read_bytes())  # no tokenizer beside it
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n"))
    argv = [command, str(tmp_path / "model.json"), "--device", "cpu", "--threads", "1", "--load-format", "dummy"]
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"error: {command} needs a model with a tokenizer (tokenizer.json)"), lines


def test_errors_about_quantization_and_weights_name_the_flags(tmp_path, capsys):
    from atom_core.engine.engine import DEMO_MODEL

    (tmp_path / "config.json").write_bytes((Path(DEMO_MODEL) / "config.json").read_bytes())  # no weights
    assert cli.main(["generate", str(tmp_path), "--device", "cpu", "--threads", "1"]) == 2
    assert "(pass --load-format='dummy' to build it with random weights)" in capsys.readouterr().err
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["generate", str(tmp_path), "--device", "cpu", "--threads", "1", "--quantization", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "--quantization='fp8' asks to quantize while loading" in err
    assert "drop the quantization argument to load it as is" in err


def test_the_base_install_runs_generate_chat_and_offline_bench_and_serve_names_the_extra():
    """A process where the serve extra's packages cannot be imported."""
    script = f"""
import json, sys
for name in {SERVE_ONLY!r}:
    sys.modules[name] = None  # "import fastapi" raises ImportError
from atom_core.serve.cli import main
codes = [main(["generate", "--max-tokens", "3", "--threads", "1", "--prompt", "Create a new"]),
         main(["chat", "--max-tokens", "3", "--threads", "1"]),
         main(["bench", "--offline", "--threads", "1", "--num-prompts", "2", "--input-len", "4:8",
               "--output-len", "2:3"]),
         main(["serve", "--threads", "1"])]
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {SERVE_ONLY!r} and sys.modules[m] is not None)
print(json.dumps({{"codes": codes, "loaded": loaded}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run([sys.executable, "-c", script], input="hello\n", cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"codes": [0, 0, 0, 2], "loaded": []}, result.stderr
    assert "assistant:" in result.stdout and "tokens/s" in result.stdout
    assert 'pip install "atom_core[serve]"' in result.stderr.strip().splitlines()[-1]


def test_the_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["atom-core"] == "atom_core.serve.cli:main"
    serve = " ".join(project["optional-dependencies"]["serve"])
    test = " ".join(project["optional-dependencies"]["test"])
    for package in ("fastapi", "uvicorn", "prometheus_client"):
        assert package in serve and package in test
    assert "openai" in test


@pytest.mark.parametrize("flags, want", [
    ([], {}),
    (["-tp", "2"], {"tensor_parallel_size": 2, "expert_parallel": False}),
    (["-tp", "2", "--expert-parallel"], {"tensor_parallel_size": 2, "expert_parallel": "all_reduce"}),
    (["-tp", "2", "--expert-parallel", "--expert-exchange", "all_to_all"],
     {"tensor_parallel_size": 2, "expert_parallel": "all_to_all"}),
    (["-dp", "2"], {"data_parallel_size": 2}),
    (["-dp", "2", "--dp-attention"], {"data_parallel_size": 2, "dp_attention": True, "expert_parallel": "all_to_all"}),
])
def test_parallel_flags_reach_engine_from_pretrained_as_its_arguments(flags, want, monkeypatch):
    from atom_core.engine import Engine
    from atom_core.serve.engine_options import Parser, add_engine_arguments, build_engine

    seen = {}
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, path, **kwargs: seen.update(kwargs)))
    parser = Parser()
    add_engine_arguments(parser)
    build_engine(parser.parse_args(flags + ["--threads", "1"]))
    names = ("tensor_parallel_size", "expert_parallel", "data_parallel_size", "dp_attention")
    assert {k: v for k, v in seen.items() if k in names} == want


@pytest.mark.parametrize("flags, want", [([], None), (["--seed", "5"], 5)])
def test_serve_seed_flag_is_the_engine_seed(flags, want, monkeypatch):
    from atom_core.engine import Engine
    from atom_core.serve import cli
    from atom_core.serve.engine_options import build_engine

    seen = {}
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, path, **kwargs: seen.update(kwargs)))
    build_engine(cli.build_parser().parse_args(["serve", *flags, "--threads", "1", "--device", "cpu"]))
    assert seen["seed"] == want


def test_serve_engine_process_flag_builds_one_replica_in_its_own_process_with_the_engine_flags(monkeypatch):
    from atom_core.engine import DataParallelEngine
    from atom_core.serve.engine_options import build_engine

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = cli.build_parser().parse_args(["serve", "--engine-process", "--device", "cpu", "--threads", "1",
                                          "--max-model-len", "96"])
    front = build_engine(args)
    try:
        assert isinstance(front, DataParallelEngine) and front.max_model_len == 96
        (replica,) = front.processes
        assert replica.pid != os.getpid() and replica.poll() is None
        prompts = ["Return the number of", "Create a new"]
        params = SamplingParams(temperature=0, max_tokens=5)
        got = front.generate(prompts, params, use_tqdm=False)
    finally:
        front.shutdown()
    want = demo_engine(max_model_len=96).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert replica.poll() is not None  # shutdown stopped it


@pytest.mark.parametrize("flags, cuda_available, env, want", [
    (["--device", "cuda"], False, {}, "front"),
    ([], True, {}, "front"),  # no --device: cuda when available
    ([], False, {}, "engine"),
    (["--device", "cpu"], True, {}, "engine"),
    (["--device", "cuda:1"], True, {}, "engine"),  # a numbered GPU: in the server's process
    (["--device", "cuda"], True, {"RANK": "0"}, "engine"),  # under torchrun
    (["--device", "cuda", "--no-engine-process"], True, {}, "engine"),
    (["--device", "cpu", "--engine-process"], False, {}, "front"),
])
def test_serve_runs_the_engine_in_its_own_process_by_default_on_a_gpu_only(flags, cuda_available, env, want,
                                                                            monkeypatch):
    import torch

    from atom_core.engine import DataParallelEngine, Engine
    from atom_core.serve.engine_options import build_engine

    built = []
    monkeypatch.setattr(Engine, "from_pretrained", classmethod(lambda cls, path, **kw: built.append("engine")))
    monkeypatch.setattr(DataParallelEngine, "__init__", lambda self, path, **kw: built.append("front"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.delenv("RANK", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    build_engine(cli.build_parser().parse_args(["serve", *flags, "--threads", "1"]))
    assert built == [want]


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_bench_sends_ignore_eos_unless_told_not_to(monkeypatch, ignore_eos):
    import asyncio

    from atom_core.serve import bench

    bodies = []

    async def stream(self, path, body):
        bodies.append(body)
        yield json.dumps({"choices": [{"text": "x"}]})

    monkeypatch.setattr(bench._Endpoint, "stream", stream)
    workload = bench.make_workload(2, (4, 8), (2, 3), 50, 0, None)
    row = asyncio.run(bench.run_online("http://127.0.0.1:9", workload, float("inf"), model="m",
                                       ignore_eos=ignore_eos))
    assert row["failed"] == 0 and len(bodies) == 2
    assert all(("ignore_eos" in b) == ignore_eos for b in bodies)


def test_a_gpu_server_keeps_its_engine_in_process_with_the_rl_endpoints_unless_told_otherwise():
    import argparse

    from atom_core.serve.engine_options import engine_process

    def args(**kw):
        return argparse.Namespace(**{"engine_process": None, "device": "cuda", "enable_rl_endpoints": False, **kw})

    assert engine_process(args()) is True  # a GPU's default: the engine in a process of its own
    assert engine_process(args(enable_rl_endpoints=True)) is False  # its routes call the Engine's own methods
    assert engine_process(args(enable_rl_endpoints=True, engine_process=True)) is True  # the flag wins
