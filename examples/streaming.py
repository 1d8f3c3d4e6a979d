"""Stream tokens as they arrive: ``add_request`` + ``step()``."""

import sys

from atom_core.engine import Engine, SamplingParams

engine = Engine.from_pretrained(sys.argv[1] if len(sys.argv) > 1 else None)
prompt = "If the file does not exist,"
request_id = engine.add_request(prompt, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, seed=1))
print(prompt, end="", flush=True)
shown = ""
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.request_id != request_id:
            continue
        # Decode everything so far and print what is new: multi-byte characters split across
        # tokens come out whole once complete.
        text = out.text if out.finished else engine.tokenizer.decode(out.token_ids)
        print(text[len(shown):], end="", flush=True)
        shown = text
print(f"\n[{out.finish_reason}]")
