"""Offline batch generation (`cobali batch`): a resumable JSONL-in, JSONL-out job over one engine, or
over Ray workers with one engine each."""
