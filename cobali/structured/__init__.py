"""Constrained decoding on llguidance: a request's constraint as a grammar (grammars.py), compiled under the
operator's limits (compiler.py, limits.py), and applied to logits rows as token masks while sampling (guide.py).
No constraint text from a client ever reaches llama.cpp's own grammar parser."""
