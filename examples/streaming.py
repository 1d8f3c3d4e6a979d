"""Stream text as it arrives: ``add_request`` + ``step()``; each output carries the step's ``new_text``
(decoded incrementally: a multi-byte character split across tokens comes out whole once complete)."""

import sys

from atom_core.engine import Engine, SamplingParams

engine = Engine.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else None)
prompt = "If the file does not exist,"
request_id = engine.add_request(prompt, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, seed=1))
print(prompt, end="", flush=True)
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.request_id == request_id:
            print(out.new_text, end="", flush=True)
            finish_reason = out.finish_reason
print(f"\n[{finish_reason}]")
