"""The OpenAI-compatible HTTP server and the ``atom-core`` command line: the top layer.

Optional: the server needs the ``serve`` extra (``pip install "atom_core[serve]"``: FastAPI, uvicorn,
prometheus_client); ``atom-core generate`` / ``chat`` / ``bench`` run on the base install.
Nothing here is imported by ``import atom_core``. See docs/serving.md.
"""
