"""Structured output: the grammar libraries' per-step mask time at a ~150k vocabulary, and the
engine's per-step time with and without structured output at batch size 64.

Three sections (``--section libraries``, ``engine``, ``op``, or ``all``, the default):

* **libraries** — xgrammar, llguidance and outlines-core (whichever are installed) on the same
  tokenizer, for a JSON schema and a regex: compile time, then, walking the tokens of a valid
  output, the time to fill one row's token bitmask per step (median and p90, microseconds), the time
  to advance the matcher by one token, and the time to fill the bitmask of 64 rows in one step
  (64 matchers, one after another on this thread, and on the library's threads: xgrammar's
  BatchGrammarMatcher, llguidance's executor).
  The tokenizer: ``--tokenizer PATH`` (a ``tokenizer.json`` or a folder with one), else a byte-level
  BPE of ``--vocab-size`` tokens (default 151,643: Qwen3's count of regular tokens) trained with the
  ``tokenizers`` library on the ``.py`` files of the environment's site-packages (code and its
  docstrings; about two minutes once, then cached under ``~/.cache/atom_core/``). The vocabulary's
  size and sha256 go in the result file.
* **engine** — ``Engine.step`` time at ``--batch-size`` decoding rows (default 64) of the model of
  ``--model`` (default the demo model; with ``--load-format dummy`` a ``config.json`` such as
  ``benchmarks/configs/qwen3-0.6b.json`` with random weights and ``--tokenizer``'s tokenizer), plain
  against every row constrained by a JSON schema (and by a regex), and the difference per step.

* **op** — ``ops.apply_token_mask_`` alone on [``--batch-size``, ``--vocab-size``] logits, every row
  masked, per backend (the twin; Triton on a GPU), and with the bitmask's host-to-device copy.

``python -m benchmarks.structured_output --json out.json`` prints the tables and writes
``{"meta": run_metadata(), "rows": [...]}`` with the libraries' versions in ``meta["libraries"]``.
``--smoke``: the demo model's 2048-token tokenizer and a few steps (the CI check that this script
runs).
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.metadata
import itertools
import json
import os
import site
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import print_table, run_metadata

LIBRARIES = ("xgrammar", "llguidance", "outlines_core")
DEMO_TOKENIZER = Path(__file__).resolve().parent.parent / "atom_core" / "demo_model" / "tokenizer.json"
EOS = "<|endoftext|>"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "member", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_DOCUMENT = {"name": "Ada Lovelace of Ockham Park", "age": 36, "email": "ada.lovelace@example.org",
                   "member": True, "tags": ["red", "blue"],
                   "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"}}
REGEX = r"[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15}){0,3}, born (19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
REGEX_TEXT = "Grace Brewster Murray Hopper, born 1906-12-09"
# More regexes, the mask cost of each library depends on the pattern's shape: the same without the
# bounded repetitions, a date alone, and a word class run.
MORE_REGEXES = {
    "regex_unbounded": (r"[A-Z][a-z]+( [A-Z][a-z]+)*, born (19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
                        REGEX_TEXT),
    "regex_date": (r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", "1906-12-09"),
    "regex_words": (r"\w+@\w+\.com", "grace_hopper@navy.com"),
}


# ---------------------------------------------------------------------------------------------- tokenizer

def training_files() -> list[str]:
    roots = [p for p in site.getsitepackages() if os.path.isdir(p)]
    return sorted(f for root in roots for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True))


def trained_tokenizer(vocab_size: int) -> Path:
    """A byte-level BPE of ``vocab_size`` tokens (the first one ``<|endoftext|>``), trained once on
    the site-packages' .py files and cached."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "atom_core"
    path = cache / f"bpe-{vocab_size}.json"
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = training_files()
    print(f"training a {vocab_size}-token byte-level BPE on {len(files)} .py files (once; cached at {path})",
          file=sys.stderr)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for file in files:
            try:
                yield Path(file).read_text(encoding="utf-8", errors="ignore")
            except OSError:
                continue

    tokenizer.train_from_iterator(texts(), trainer)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def resolve_tokenizer(args) -> Path:
    if args.tokenizer:
        path = Path(args.tokenizer)
        return path / "tokenizer.json" if path.is_dir() else path
    if args.smoke:
        return DEMO_TOKENIZER
    return trained_tokenizer(args.vocab_size)


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars)}


def token_bytes(tokenizer_json: dict) -> tuple[list[bytes], int]:
    """Each token's bytes (a byte-level BPE's vocabulary), and the EOS id."""
    decode = byte_level_decoder()
    vocab = tokenizer_json["model"]["vocab"]
    added = {t["id"]: t["content"] for t in tokenizer_json.get("added_tokens", [])}
    size = max(max(vocab.values()), max(added, default=0)) + 1
    out = [b""] * size
    for token, i in vocab.items():
        out[i] = bytes(decode[c] for c in token)
    for i, content in added.items():
        out[i] = content.encode()
    eos = next((i for i, c in added.items() if c == EOS), 0)
    return out, eos


# ---------------------------------------------------------------------------------------------- libraries

def versions() -> dict:
    found = {}
    for name in ("xgrammar", "llguidance", "outlines_core", "tokenizers"):
        try:
            found[name] = importlib.metadata.version(name.replace("_", "-"))
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_path: Path, vocab: list[bytes], eos: int):
        import torch
        import xgrammar as xgr
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(tokenizer_path))
        encoded = [""] * len(vocab)
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            encoded[i] = token
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        info = xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=len(vocab),
                                 stop_token_ids=[eos], add_prefix_space=metadata["add_prefix_space"])
        self.xgr, self.torch = xgr, torch
        self.compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))  # as the engine
        self.vocab_size = len(vocab)

    def compile(self, kind, spec):
        if kind == "json":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=(",", ":"))
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows):
        return self.xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask, row):
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token):
        assert matcher.accept_token(token), token

    def fill_batch(self, matchers, bitmask):
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)

    def fill_batch_parallel(self, matchers, bitmask):
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_path: Path, vocab: list[bytes], eos: int):
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_path.read_text(), n_vocab=len(vocab), eos_token=eos)
        self.executor = llguidance.LLExecutor()
        self.vocab_size = len(vocab)

    def compile(self, kind, spec):
        ll = self.ll.LLMatcher
        compact = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
        grammar = ll.grammar_from_json_schema(json.dumps(spec), defaults=compact) if kind == "json" \
            else ll.grammar_from_regex(spec)
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # compiles; a matcher per request
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar):
        return self.ll.LLMatcher(self.tokenizer, grammar)

    def bitmask(self, rows):
        return self.ll.torch.allocate_token_bitmask(rows, self.vocab_size)

    def fill(self, matcher, bitmask, row):
        self.ll.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token):
        assert matcher.consume_token(token), (token, matcher.get_error())

    def fill_batch(self, matchers, bitmask):
        for row, m in enumerate(matchers):
            self.ll.torch.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch_parallel(self, matchers, bitmask):
        self.ll.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)


class OutlinesCore:
    name = "outlines_core"

    def __init__(self, tokenizer_path: Path, vocab: list[bytes], eos: int):
        import outlines_core
        import torch

        self.oc, self.torch = outlines_core, torch
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i != eos and b:
                by_bytes.setdefault(b, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, by_bytes)
        self.vocab_size = len(vocab)

    def compile(self, kind, spec):
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(spec), whitespace_pattern="") if kind == "json" else spec
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, index):
        return self.oc.Guide(index)

    def bitmask(self, rows):
        return self.torch.full((rows, (self.vocab_size + 31) // 32), -1, dtype=self.torch.int32)

    def fill(self, guide, bitmask, row):
        v = bitmask[row]
        guide.write_mask_into(v.data_ptr(), v.numel(), v.element_size())

    def accept(self, guide, token):
        guide.advance(token, return_tokens=False)

    def fill_batch(self, guides, bitmask):
        for row, g in enumerate(guides):
            v = bitmask[row]
            g.write_mask_into(v.data_ptr(), v.numel(), v.element_size())


BACKENDS = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines_core": OutlinesCore}


def _allowed(bitmask, row, token) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def measure_library(lib, case: str, spec, token_ids: list[int], batch_size: int, repeats: int) -> dict:
    t0 = time.perf_counter()
    compiled = lib.compile("json" if case == "json" else "regex", spec)
    compile_ms = 1e3 * (time.perf_counter() - t0)
    fill_us, accept_us = [], []
    bitmask = lib.bitmask(1)
    for _ in range(repeats):
        matcher = lib.matcher(compiled)
        for token in token_ids:
            t0 = time.perf_counter()
            lib.fill(matcher, bitmask, 0)
            t1 = time.perf_counter()
            assert _allowed(bitmask, 0, token), f"{lib.name} masks token {token} of a valid output"
            fill_us.append(1e6 * (t1 - t0))
            if token == token_ids[-1]:  # EOS: allowed at the end, nothing to advance to
                break
            t1 = time.perf_counter()
            lib.accept(matcher, token)
            accept_us.append(1e6 * (time.perf_counter() - t1))
    # A batch: row i starts i tokens into the output (a new matcher when one reaches the end), and
    # each step fills every row's mask, then advances every row by its next token.
    n = len(token_ids) - 1  # tokens a matcher advances over (the last is EOS)
    matchers, where = [], []
    for row in range(batch_size):
        m = lib.matcher(compiled)
        for token in token_ids[:row % n]:
            lib.accept(m, token)
        matchers.append(m)
        where.append(row % n)
    big = lib.bitmask(batch_size)
    batch_ms, parallel_ms = [], []
    for step in range(max(3, repeats) * n):
        t0 = time.perf_counter()
        if hasattr(lib, "fill_batch_parallel") and step % 2:
            lib.fill_batch_parallel(matchers, big)
            parallel_ms.append(1e3 * (time.perf_counter() - t0))
        else:
            lib.fill_batch(matchers, big)
            batch_ms.append(1e3 * (time.perf_counter() - t0))
        for row in range(batch_size):
            if where[row] == n:
                matchers[row], where[row] = lib.matcher(compiled), 0
            else:
                lib.accept(matchers[row], token_ids[where[row]])
                where[row] += 1
    row = {"library": lib.name, "case": case, "vocab": lib.vocab_size, "tokens": len(token_ids),
           "compile_ms": compile_ms, "mask_us_mean": statistics.fmean(fill_us),
           "mask_us_p50": statistics.median(fill_us),
           "mask_us_p90": statistics.quantiles(fill_us, n=10)[-1] if len(fill_us) > 1 else fill_us[0],
           "mask_us_max": max(fill_us), "accept_us_p50": statistics.median(accept_us),
           f"mask_bs{batch_size}_ms": statistics.median(batch_ms),
           f"mask_bs{batch_size}_ms_mean": statistics.fmean(batch_ms)}
    if parallel_ms:
        row[f"mask_bs{batch_size}_parallel_ms"] = statistics.median(parallel_ms)
    return row


def library_section(args, tokenizer_path: Path) -> list[dict]:
    from tokenizers import Tokenizer

    tokenizer_json = json.loads(tokenizer_path.read_text())
    vocab, eos = token_bytes(tokenizer_json)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    cases = [("json", SCHEMA, json.dumps(SCHEMA_DOCUMENT, separators=(",", ":"))), ("regex", REGEX, REGEX_TEXT)]
    if not args.smoke:
        cases += [(name, regex, text) for name, (regex, text) in MORE_REGEXES.items()]
    rows = []
    for name in args.libraries:
        try:
            t0 = time.perf_counter()
            lib = BACKENDS[name](tokenizer_path, vocab, eos)
            setup_ms = 1e3 * (time.perf_counter() - t0)
        except ImportError as e:
            print(f"{name}: not installed ({e})", file=sys.stderr)
            continue
        for kind, spec, text in cases:
            token_ids = tokenizer.encode(text, add_special_tokens=False).ids + [eos]
            row = measure_library(lib, kind, spec, token_ids, args.batch_size, args.repeats)
            row["setup_ms"] = setup_ms
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- engine

ENGINE_CASES = {
    # Constraints that cannot end within the timed steps, so every row stays in the batch.
    "json_schema": {"json": {"type": "array", "items": SCHEMA, "minItems": 8}},
    "regex": {"regex": r"((19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01]), ){16,}"},
}


def engine_section(args, tokenizer_path: Path | None) -> list[dict]:
    """Decode-step time at ``batch_size`` rows: plain (async scheduling on, as by default), every row
    constrained (which turns the launch-ahead off), and plain with async scheduling off (what the mask
    costs beyond the lost overlap); ``rounds`` interleaved rounds, the best median step of each case."""
    import tempfile

    import torch

    from atom_core.engine import Engine, SamplingParams

    device = args.device
    engine_args = {"device": device, "max_num_seqs": args.batch_size, "max_model_len": args.max_model_len,
                       "enforce_eager": args.enforce_eager}
    with tempfile.TemporaryDirectory() as folder:
        if args.load_format == "dummy":
            (Path(folder) / "config.json").write_text(Path(args.model).read_text())
            (Path(folder) / "tokenizer.json").write_text(tokenizer_path.read_text())
            engine = Engine.from_pretrained(folder, load_format="dummy", dtype=args.dtype, **engine_args)
        else:
            engine = Engine.from_pretrained(args.model, **engine_args)
    vocab = engine.model.config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(16)]
    runs = [("plain", True, None)] + [(case, True, spec) for case, spec in ENGINE_CASES.items()] + [
        ("plain, async off", False, None)]
    best: dict[str, tuple[float, int]] = {}
    for _, (case, async_scheduling, spec) in itertools.product(range(args.rounds), runs):
        engine.async_scheduling = async_scheduling
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.steps + 8, ignore_eos=True,
                                structured_outputs=spec)
        for _ in range(args.batch_size):
            engine.add_request(prompt, params)
        for _ in range(3):  # prefill and the first decode steps are not timed
            engine.step()
        times = []
        for _ in range(args.steps):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = engine.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - t0))
            if len(outs) < args.batch_size:  # a row finished: the batch is no longer full
                break
        while engine.has_unfinished_requests():
            engine.step()
        ms = statistics.median(times)
        if case not in best or ms < best[case][0]:
            best[case] = (ms, len(times))
    baseline = best["plain"][0]
    return [{"case": case, "rows": args.batch_size, "device": device, "steps_timed": n, "step_ms": ms,
             "overhead_ms": ms - baseline, "x_plain": ms / baseline} for case, (ms, n) in best.items()]


def op_section(args, vocab: int) -> list[dict]:
    """``ops.apply_token_mask_`` on [batch_size, vocab] float32 logits, every row masked, per backend
    available on the device (the twin; Triton on a GPU), with the bitmask's copy to the device."""
    import torch

    from atom_core.ops.dispatch import backend_available
    from atom_core.ops.selftest_cases_token_mask import token_mask_inputs
    from atom_core.ops.token_mask import apply_token_mask_
    from benchmarks.common import bench_timed

    device = args.device
    logits, bitmask, _ = token_mask_inputs(args.batch_size, vocab, torch.float32, device)
    rows = torch.arange(args.batch_size, device=device)
    bitmask = torch.cat([bitmask, bitmask])[:args.batch_size]
    host = bitmask.cpu().pin_memory() if device == "cuda" else bitmask
    backends = ["torch"] + (["triton"] if device == "cuda" and backend_available("triton") else [])
    out = []
    for backend in backends:
        mask_only = bench_timed(lambda b=backend: apply_token_mask_(logits, bitmask, rows, backend=b), device=device)
        with_copy = bench_timed(lambda b=backend: apply_token_mask_(logits, host.to(device, non_blocking=True), rows,
                                                                    backend=b), device=device, graph=False)
        out.append({"op": "apply_token_mask_", "backend": backend, "rows": args.batch_size, "vocab": vocab,
                    "ms": mask_only.ms, "ms_with_copy": with_copy.ms, "timing": mask_only.mode})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--section", choices=("libraries", "engine", "op", "all"), default="all")
    parser.add_argument("--tokenizer", help="a tokenizer.json (or a folder with one); default: a trained BPE")
    parser.add_argument("--vocab-size", type=int, default=151_643)
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="walks over the output per library and case")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="engine section: a checkpoint folder (default: the demo "
                        "model), or with --load-format dummy a config.json")
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30, help="engine section: decode steps timed")
    parser.add_argument("--rounds", type=int, default=3, help="engine section: each case this many times, "
                        "interleaved; the best median is kept")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--dtype", default=None, help="engine section with --load-format dummy (default: the "
                        "config's)")
    parser.add_argument("--smoke", action="store_true", help="the demo tokenizer, few steps (CI)")
    parser.add_argument("--json", help="write the rows and the run's metadata here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.batch_size, args.rounds = 1, 3, min(args.batch_size, 4), 1
        args.libraries = [name for name in args.libraries if name != "outlines_core"]  # seconds to compile
    tokenizer_path = resolve_tokenizer(args)
    rows = []
    if args.section in ("libraries", "all"):
        lib_rows = library_section(args, tokenizer_path)
        print(f"\nper-step token-mask time, tokenizer {tokenizer_path} ({lib_rows[0]['vocab'] if lib_rows else '?'} "
              f"tokens), one row unless said")
        print_table(lib_rows, list(dict.fromkeys(k for r in lib_rows for k in r)))
        rows += [{"section": "libraries", **r} for r in lib_rows]
    if args.section in ("engine", "all"):
        eng_rows = engine_section(args, tokenizer_path)
        print(f"\nengine decode step at {args.batch_size} rows ({args.device})")
        print_table(eng_rows)
        rows += [{"section": "engine", **r} for r in eng_rows]
    if args.section in ("op", "all"):
        op_rows = op_section(args, args.vocab_size)
        print(f"\napply_token_mask_ at {args.batch_size} x {args.vocab_size} ({args.device})")
        print_table(op_rows)
        rows += [{"section": "op", **r} for r in op_rows]
    if args.json:
        meta = run_metadata()
        meta["libraries"] = versions()
        meta["tokenizer"] = {"path": str(tokenizer_path),
                             "sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
