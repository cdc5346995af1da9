"""Issue 36's hostile corpus (corpus.py), its seeded fuzzer (fuzz.py) and the harness that sends them to a real
`cobali serve` beside a probe (harness.py, streams.py); run by tests/integration/test_hostile_corpus.py."""
