"""Structured output through the engine, on the demo model (random-ish text: the tokens mean nothing, but
every output must satisfy its constraint): JSON schema, regex, choice, EBNF grammar and any JSON
object, with async scheduling on and off, beside plain requests that must not notice; a complete
grammar finishes the request ("stop", also with ignore_eos); preemption keeps the matcher in step;
abort and finish free it and async scheduling resumes; refusals before anything is queued."""

import dataclasses
import gc
import json
import re
import subprocess
import sys
import weakref

import pytest
import torch

from atom_core import ops
from atom_core.engine import Engine, SamplingParams
from atom_core.engine.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green"]}, "maxItems": 2},
    },
    "required": ["name", "age", "member", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}( [a-z]{2,5}){0,2}\."
CHOICES = ["yes", "no", "maybe later"]
GRAMMAR = 'root ::= "(" [0-9] [0-9]? (("+" | "*") [0-9] [0-9]?)? ")"'
GRAMMAR_REGEX = r"\([0-9][0-9]?([+*][0-9][0-9]?)?\)"


def check_schema(value) -> None:
    """SCHEMA, checked by hand."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "member", "tags"}
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120
    assert isinstance(value["member"], bool)
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2
    assert all(t in ("red", "green") for t in value["tags"])


def check(kind: str, out) -> None:
    """The output satisfies its constraint (a complete one: each of these grammars ends)."""
    assert out.finish_reason == "stop", (kind, out.text)
    if kind == "json":
        check_schema(json.loads(out.text))
    elif kind == "regex":
        assert re.fullmatch(REGEX, out.text), out.text
    elif kind == "choice":
        assert out.text in CHOICES
    elif kind == "grammar":
        assert re.fullmatch(GRAMMAR_REGEX, out.text), out.text


CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=GRAMMAR),
}
PROMPTS = ["Return the value of", "If the file does not exist,", "The default is", "Note that the"]


@pytest.fixture(autouse=True, scope="module")
def _torch_backend():
    """Without a GPU the reference ops (the suite sets TRITON_INTERPRET=1 there, under which auto picks
    Triton's CPU interpreter for some ops: seconds per step); on a GPU the default choice."""
    with ops.use_backend(None if torch.cuda.is_available() else "torch"):
        yield


# Every engine here gets a pool of this many blocks (room for every request of these tests): pools sized
# from a GPU's free memory would leave none for the next engine while the module's engine lives.
POOL = dict(num_kv_blocks=1024)
# The demo model in float32: the tests compare tokens across batch shapes and block sizes, which a GPU's
# bf16 kernels round differently.
FP32 = dict(dtype=torch.float32)


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(max_num_seqs=16, **POOL, **FP32)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_output_satisfies_its_constraint_and_plain_rows_do_not_notice(engine, async_scheduling):
    engine.async_scheduling = async_scheduling
    plain = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    alone = engine.generate(PROMPTS[0], plain, use_tqdm=False)[0].token_ids
    kinds, params = [], []
    for seed in range(2):
        for kind, constraint in CONSTRAINTS.items():
            kinds.append(kind)
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=100, structured_outputs=constraint))
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    outs = engine.generate(prompts + [PROMPTS[0]], params + [plain], use_tqdm=False)
    for kind, out in zip(kinds, outs):
        check(kind, out)
    assert outs[-1].token_ids == alone  # the plain row is not masked by its batch mates' grammars
    assert engine.scheduler.num_structured == 0


def test_any_json_object_is_json_or_a_prefix_of_one(engine):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, structured_outputs={"json_object": True})
    out = engine.generate("The default is", params, use_tqdm=False)[0]
    assert out.text.startswith("{")
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 40


def test_a_complete_grammar_finishes_the_request_even_with_ignore_eos(engine):
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=50, ignore_eos=True, structured_outputs={
        "choice": CHOICES})
    out = engine.generate("Note that the", params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text in CHOICES
    assert out.token_ids[-1] in engine.eos_token_ids  # the stop token the grammar asked for ends it
    assert len(out.token_ids) < 50


def test_a_grammar_complete_at_max_tokens_finishes_with_stop_not_length(engine):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, structured_outputs={"choice": ["yes"]})
    full = engine.generate("Note that the", params, use_tqdm=False)[0]
    exact = engine.generate("Note that the", dataclasses.replace(params, max_tokens=len(full.token_ids)),
                            use_tqdm=False)[0]
    assert (exact.text, exact.finish_reason, exact.token_ids) == ("yes", "stop", full.token_ids)


@pytest.mark.parametrize("regex", [r"\S+", r".{1,30}", r"[ -~]{3,60}"])
def test_eos_is_allowed_only_where_the_grammar_is_complete_not_after_its_literal_text(engine, regex):
    """The EOS token's literal text ("<|endoftext|>") matches these regexes; it used to be allowed as that text,
    ending the grammar (and the request, with "stop") before any character was written."""
    eos = engine.tokenizer.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 100.0},
                            structured_outputs={"regex": regex})
    out = engine.generate("Hi", params, use_tqdm=False)[0]
    assert out.token_ids[0] != eos and re.fullmatch(regex, out.text), (out.token_ids, out.text)


OBJECT_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("params, text", [
    (dict(allowed_token_ids="{", structured_outputs={"json": OBJECT_A}), "{"),  # only '{' allowed: then nothing
    (dict(bad_words=[str(d) for d in range(10)], structured_outputs={"regex": "ab[0-9]"}), "ab"),
    (dict(min_tokens=10, structured_outputs={"choice": ["yes", "no"]}), None),  # complete, but EOS is banned
    (dict(min_tokens=3, allowed_token_ids=[]), ""),  # only EOS allowed, and min_tokens bans it
], ids=["allowed_token_ids", "bad_words", "min_tokens", "min_tokens_alone"])
def test_rules_that_together_allow_no_token_finish_the_request_with_error(engine, params, text):
    """The sampler answers a row with no allowed token with token 0 (EOS here): that used to finish with
    "stop", as if the constraint were met. (With the debug checks on, the all -inf row is refused in the step.)"""
    tokenizer = engine.tokenizer
    if params.get("allowed_token_ids") == "{":
        params["allowed_token_ids"] = tokenizer.encode("{", add_special_tokens=False)
    if params.get("allowed_token_ids") == []:
        params["allowed_token_ids"] = [tokenizer.eos_token_id]
    with ops.debug_checks(False):
        out = engine.generate("Hi", SamplingParams(temperature=0, max_tokens=20, **params), use_tqdm=False)[0]
    assert (out.finish_reason, out.stop_reason) == ("error", None)
    assert out.token_ids[-1] == 0 and (text is None or out.text == text)
    assert engine.scheduler.num_structured == 0


def test_a_choice_with_a_character_outside_the_bmp_is_generated_as_written(engine):
    # (JSON's ASCII escapes write such a character as two surrogate escapes, which the grammar
    # would read as two separate, unencodable code points.)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs={"choice": ["\U0001F600 yes"]})
    out = engine.generate("The default is", params, use_tqdm=False)[0]
    assert (out.text, out.finish_reason) == ("\U0001F600 yes", "stop")


def test_n_sequences_each_follow_the_grammar(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=60, structured_outputs={"regex": REGEX})
    out = engine.generate("Return the value of", params, use_tqdm=False)[0]
    assert [seq.index for seq in out.outputs] == [0, 1, 2]
    for seq in out.outputs:
        check("regex", seq)


def test_preemption_keeps_the_grammar_in_step_with_the_recomputed_tokens():
    """Greedy outputs with preemptions (a pool too small for every row) equal those without."""
    params = [SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=CONSTRAINTS[kind])
              for kind in ("json", "regex", "grammar", "json")]
    prompts = [PROMPTS[i] * 3 for i in range(4)]  # longer prompts: more blocks to take back
    roomy = Engine.from_pretrained(max_num_seqs=8, **POOL, **FP32)
    want = [o.token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy
    tight = Engine.from_pretrained(max_num_seqs=8, block_size=4, num_kv_blocks=34, max_model_len=128, **FP32)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.num_preemptions > 0
    assert [o.token_ids for o in outs] == want
    for kind, out in zip(("json", "regex", "grammar", "json"), outs):
        check(kind, out)


def test_abort_and_finish_free_the_matcher_and_async_scheduling_resumes(engine):
    engine.async_scheduling = True
    rid = engine.add_request("Return the value of", SamplingParams(max_tokens=80, structured_outputs={
        "json": SCHEMA}))
    request = engine._requests[rid][0]
    engine.step()
    engine.step()
    assert engine._in_flight is None  # no step launched ahead while a grammar runs
    state = weakref.ref(request.grammar)
    assert request.grammar.num_accepted >= 1
    engine.abort(rid)
    assert request.grammar is None and engine.scheduler.num_structured == 0
    gc.collect()
    assert state() is None  # nothing else holds the matcher
    engine.add_request("The default is", SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert engine._in_flight is not None  # plain requests only: the next step is launched ahead again
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_grammar_compiled_beforehand_is_used_as_it_is_and_must_be_the_requests(engine, monkeypatch):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=20, structured_outputs={"choice": CHOICES})
    grammar = engine.compile_structured(params)
    assert engine.compile_structured(SamplingParams()) is None
    monkeypatch.setattr(engine.grammar_compiler, "compile", lambda spec: pytest.fail("compiled again"))
    with pytest.raises(ValueError, match="compiled for"):
        engine.add_request("Note that the", SamplingParams(structured_outputs={"regex": "a+"}), grammar=grammar)
    with pytest.raises(ValueError, match="compiled for"):
        engine.add_request("Note that the", SamplingParams(), grammar=grammar)
    rid = engine.add_request("Note that the", params, grammar=grammar)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert outs[0].text in CHOICES and outs[0].finish_reason == "stop"


class RaisingMatcher:
    """A grammar's matcher whose mask fill raises (the grammar library failing); the rest is the real one."""

    def __init__(self, matcher):
        self.matcher = matcher

    def fill_next_token_bitmask(self, *args, **kwargs):
        raise RuntimeError("injected mask failure")

    def __getattr__(self, name):
        return getattr(self.matcher, name)


def test_a_mask_that_raises_fails_its_request_once_and_the_engine_goes_on(engine):
    engine.async_scheduling = True
    plain = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    alone = engine.generate(PROMPTS[0], plain, use_tqdm=False)[0].token_ids
    plain_id = engine.add_request(PROMPTS[0], plain)
    bad_id = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=40, structured_outputs={"json": SCHEMA}))
    bad = engine._requests[bad_id][0]
    bad.grammar.matcher = RaisingMatcher(bad.grammar.matcher)
    with pytest.raises(RuntimeError, match="injected mask failure"):
        engine.step()
    assert (bad.finish_reason, bad.grammar, engine.scheduler.num_structured) == ("error", None, 0)
    assert engine.failed_request_ids == [bad_id]  # (what AsyncEngine reads to fail its stream)
    good_id = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=60, structured_outputs={
        "regex": REGEX}))
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {out.request_id: out for out in engine.step() if out.finished}  # nothing raises again
    assert finished.keys() == {plain_id, good_id}
    assert finished[plain_id].token_ids == alone  # its row, made in the failed schedule, is none the worse
    check("regex", finished[good_id])
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("structured, match", [
    ({"json": {"type": "nonsense"}}, r"structured_outputs\.json: Unsupported type"),
    ({"json": {"$ref": "#/missing"}}, r"structured_outputs\.json: .*missing"),
    ({"regex": "[a-z"}, r"structured_outputs\.regex: .*Unclosed"),
    ({"grammar": 'root ::= "a" |'}, r"structured_outputs\.grammar: EBNF parser error"),
    ({"json": "{not json"}, r"structured_outputs\.json=.*not valid JSON"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of json, regex, choice, grammar, json_object"),
    ({"choice": []}, r"structured_outputs\.choice=\[\]: must be a non-empty list"),
    ({"jsn": {}}, "not StructuredOutputsParams fields"),
    ({"json": False}, r"structured_outputs\.json=False: the schema false matches no value"),
    # keywords the grammar library takes without enforcing them (outputs broke each one)
    ({"json": {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}},
     r"structured_outputs\.json: #: 'uniqueItems' is not enforced"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "x"}}}}},
     r"json: #/properties/a: 'not' is not enforced"),
    ({"json": {"$defs": {"x": {"if": {"minLength": 1}, "then": {"maxLength": 2}}}, "$ref": "#/$defs/x"}},
     r"json: #/\$defs/x: 'if' / 'then' / 'else'"),
    ({"json": {"anyOf": [{"allOf": [{"type": "integer"}, {"minimum": 3}]}, {"type": "null"}]}},
     r"json: #/anyOf/0: 'allOf' of several schemas"),
    ({"json": {"type": "array", "prefixItems": [{"type": "number", "multipleOf": 0.5}]}},
     r"json: #/prefixItems/0: 'multipleOf' is enforced on integers by a whole step only"),
    ({"json": {"type": "array", "contains": {"type": "integer"}}}, r"json: #: 'contains'"),
])
def test_bad_constraints_are_refused_by_name_before_anything_is_queued(engine, structured, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("Return the", SamplingParams(structured_outputs=structured))
    with pytest.raises(ValueError, match=match):  # generate checks every prompt before queueing any
        engine.generate(["Return the", "The file"], [SamplingParams(), SamplingParams(structured_outputs=structured)],
                        use_tqdm=False)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=match):  # the data-parallel front's check: the same refusal
        front_checks(engine).check("Return the", SamplingParams(structured_outputs=structured))


def test_the_keywords_the_grammar_library_enforces_are_taken(engine):
    schema = {"type": "object", "required": ["a", "b"], "additionalProperties": False, "properties": {
        "a": {"allOf": [{"type": "integer", "minimum": 0, "maximum": 99}]},
        "b": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30}}}
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60, structured_outputs={"json": schema})
    for seed in range(3):
        out = engine.generate("Return the", dataclasses.replace(params, seed=seed), use_tqdm=False)[0]
        value = json.loads(out.text)
        assert out.finish_reason == "stop" and 0 <= value["a"] <= 99 and value["b"] % 3 == 0 <= value["b"] <= 30


def front_checks(engine):
    """The checks ``DataParallelEngine``'s front builds, for this engine's model."""
    from atom_core.engine import structured_output
    from atom_core.engine.request_checks import RequestChecks

    return RequestChecks(engine.tokenizer, engine.model.config.vocab_size, engine.max_model_len,
                         engine.max_logprobs, structured_output.check_grammar)


def test_the_data_parallel_front_checks_a_constraint_without_compiling_it(engine, monkeypatch):
    from atom_core.engine import structured_output

    def no_compiler(*args, **kwargs):
        raise AssertionError("the front built a GrammarCompiler")

    monkeypatch.setattr(structured_output, "GrammarCompiler", no_compiler)
    checks = front_checks(engine)
    for constraint in [*CONSTRAINTS.values(), StructuredOutputsParams(json_object=True)]:
        checks.check("Return the", SamplingParams(structured_outputs=constraint))


def test_the_compiled_grammar_cache_stays_within_its_bound(engine, monkeypatch):
    from atom_core.engine import structured_output

    monkeypatch.setattr(structured_output, "GRAMMAR_CACHE_BYTES", 2**20)
    compiler = structured_output.GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size,
                                                 engine.eos_token_ids)
    for i in range(150):  # ~17 KB each over the demo vocabulary: 2.5 MB unbounded
        compiler.compile(StructuredOutputsParams(json={"type": "object", "properties": {f"field_{i}": {
            "type": "integer"}}, "required": [f"field_{i}"]}))
    assert compiler.compiler.get_cache_size_bytes() <= 1.25 * 2**20


def test_without_a_tokenizer_or_without_xgrammar_the_request_is_refused(engine, monkeypatch):
    from atom_core.engine import structured_output

    params = SamplingParams(structured_outputs={"regex": "a+"})
    bare = Engine(engine.model, None, max_num_seqs=2, warmup=False, **POOL)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        bare.add_request([1, 2, 3], params)
    del bare
    engine.runner.bind()
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    with pytest.raises(structured_output.StructuredOutputUnavailableError, match=r"atom_core\[structured\]"):
        structured_output.import_xgrammar()
    fresh = Engine(engine.model, engine.tokenizer, max_num_seqs=2, warmup=False, **POOL)
    with pytest.raises(ValueError, match=r"pip install 'atom_core\[structured\]'"):
        fresh.add_request("Return the", params)
    assert not fresh.has_unfinished_requests()
    del fresh
    engine.runner.bind()


def test_importing_atom_core_does_not_import_the_grammar_library():
    code = ("import sys, atom_core, atom_core.engine, atom_core.engine.structured_output; "
            "from atom_core.engine import Engine, SamplingParams; "
            "assert 'xgrammar' not in sys.modules, 'xgrammar imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_benchmark_script_runs_and_records_the_library_versions(tmp_path):
    from benchmarks import structured_output as bench

    path = tmp_path / "out.json"
    bench.main(["--smoke", "--section", "libraries", "--libraries", "xgrammar", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["meta"]["libraries"]["xgrammar"] and data["meta"]["tokenizer"]["sha256"]
    assert {row["case"] for row in data["rows"]} == {"json", "regex"}
    assert all(row["mask_us_p50"] > 0 for row in data["rows"])
