"""The newcomer's path: every python block of README.md and docs/*.md runs as pasted, every script
in examples/ runs, and the README's ``python -m atom_core.demo`` behaves (help, errors, output).

A block runs in a fresh Python process started in the repository root, as a reader pasting it
into ``python`` there would (CPU, the built-in demo model), with a timeout. A block that needs a
GPU or a real checkpoint says so in a comment on the line before its fence,
``<!-- skip-test: needs a GPU -->``, and is reported as skipped with that reason. Blocks of other
languages (bash, plain text such as docs/ops.md's API summaries) are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import atom_core
from atom_core import demo

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
DEMO_MODEL = Path(atom_core.__file__).resolve().parent / "demo_model"
# Arguments that keep each example short on a CPU (the demo model, few tokens).
EXAMPLE_ARGS = {"custom_loop.py": [str(DEMO_MODEL), "8"]}
TIMEOUT_S = 300  # a block or example that takes longer has hung (each takes seconds)

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_SKIP = re.compile(r"^<!--\s*skip-test:\s*(.+?)\s*-->$")


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int            # 1-based line of the opening fence
    language: str        # "" for a plain fence
    code: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path.name}:{self.line}"


def code_blocks(path: Path, text: str | None = None) -> list[CodeBlock]:
    """The fenced code blocks of a Markdown file, in order; a ``<!-- skip-test: reason -->`` line
    (blank lines allowed between) right before a fence marks that block."""
    lines = (path.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i].strip())
        if not opening:
            i += 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = _SKIP.match(before)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: code block never closed")
        blocks.append(CodeBlock(path, i + 1, opening.group(1).lower(), "\n".join(lines[i + 1:end]) + "\n",
                                skip.group(1) if skip else None))
        i = end + 1
    return blocks


PYTHON_BLOCKS = [b for path in DOC_FILES for b in code_blocks(path) if b.language in ("python", "py")]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run_python(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository root, as a user's shell would start it: without the test
    suite's TRITON_INTERPRET (the CPU runs the reference ops), one thread (two cores are shared)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, *args], input=stdin, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


# ---- the extractor itself -----------------------------------------------------------------------

def test_code_blocks_reads_language_line_code_and_skip_marker():
    text = ("# T\n\n```bash\npip install x\n```\n\n<!-- skip-test: needs a GPU -->\n\n```python\n"
            "import torch\ntorch.zeros(1, device='cuda')\n```\n```python\nprint(1)\n```\n```\nplain\n```\n")
    blocks = code_blocks(Path("doc.md"), text)
    assert [(b.line, b.language, b.code, b.skip_reason) for b in blocks] == [
        (3, "bash", "pip install x\n", None),
        (9, "python", "import torch\ntorch.zeros(1, device='cuda')\n", "needs a GPU"),
        (13, "python", "print(1)\n", None),
        (16, "", "plain\n", None),
    ]


def test_code_blocks_refuses_an_unclosed_fence():
    with pytest.raises(ValueError, match="never closed"):
        code_blocks(Path("doc.md"), "```python\nprint(1)\n")


# ---- the blocks and the examples ------------------------------------------------------------------

@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.id for b in PYTHON_BLOCKS])
def test_python_block_runs_as_pasted(block):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    result = run_python(["-"], stdin=block.code)
    assert result.returncode == 0, f"{block.id} failed:\n{block.code}\n--- stderr:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_script_runs(script):
    result = run_python([str(script.relative_to(ROOT)), *EXAMPLE_ARGS.get(script.name, [])])
    assert result.returncode == 0, f"{script.name} failed:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{script.name} printed nothing"


# ---- python -m atom_core.demo ----------------------------------------------------------------------

@pytest.fixture
def keep_torch_threads():
    """demo.main sets torch's thread count (--threads); put the test session's back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_demo_help_shows_the_module_command_without_markup():
    help_text = demo.build_parser().format_help()
    assert help_text.startswith("usage: python -m atom_core.demo ")
    assert "`" not in help_text


@pytest.mark.parametrize("argv, says", [
    (["--model", "/no/such/folder"], "no such folder"),
    (["--model", "Qwen/Qwen3-0.6B"], "huggingface-cli download Qwen/Qwen3-0.6B --local-dir Qwen3-0.6B"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--threads", "many"], "--threads"),
    (["--max-model-len", "-5"], "--max-model-len"),
    (["--device", "tpu"], "--device"),
    (["--dtype", "int3"], "dtype"),                 # refused by the library (ValueError)
    (["--max-model-len", "100000"], "max_model_len"),  # beyond the demo model's 512 positions: the library's ValueError
    (["--no-such-flag"], "--no-such-flag"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_demo_user_error_prints_one_error_line_and_returns_2(argv, says, capsys, keep_torch_threads):
    assert demo.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], captured.err


def test_demo_prints_every_prompt_and_the_token_rate(capsys, keep_torch_threads):
    prompts = ["Return the number of", "This module provides"]
    assert demo.main(["--max-tokens", "4", "--prompt", prompts[0], "--prompt", prompts[1], "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert all(f"--- {p!r}\n{p}" in out for p in prompts)
    assert re.search(r"^\d+ tokens in [\d.]+ s: [\d.]+ tokens/s \(2 prompts, device \S+, 1 CPU thread", out, re.M)


def test_the_demo_on_a_model_without_a_tokenizer_says_what_it_needs(tmp_path, capsys, keep_torch_threads):
    import shutil

    from atom_core.engine.engine import DEMO_MODEL

    shutil.copytree(DEMO_MODEL, tmp_path / "m", ignore=shutil.ignore_patterns("tokenizer*"))
    assert demo.main(["--model", str(tmp_path / "m")]) == 2
    assert "the demo needs a model with a tokenizer (tokenizer.json)" in capsys.readouterr().err
