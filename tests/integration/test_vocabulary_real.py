"""The embedded model's vocabulary loaded alone (LlamaCppVocabulary.load: what a frontend in a process apart from
the engine's tokenizes with) answers as the full backend does: the same tokens, bytes, chat template and llguidance
vocabulary; it takes a fraction of the full model's memory, and close() gives it back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cobali.backends.llama_cpp import LlamaCppBackend, LlamaCppVocabulary
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.engine.tokenizer import Tokenizer

TEXTS = ["Hello, world!", "<|im_start|>user\nhé 😀 日本語<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>",
         "  leading spaces\tand\ttabs\n\n", "ab<|im_", "", "\u00a0\u200b\ufffd"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é 😀"}]
CYCLES = 6  # loads and closes after the first: were close() to free nothing, each would add a whole load

# Runs in a process of its own, so that nothing loaded before skews its memory: loads `what` once and prints the
# RSS it added and the seconds it took; for the vocabulary, then loads and closes it CYCLES more times and prints
# the RSS left above the start.
MEASURE = """
import json, sys, time
from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.loading import load_model
from cobali.backends.llama_cpp.tools import llama_logs
from cobali.backends.llama_cpp.vocab import LlamaCppVocabulary
import llama_cpp as ll

def rss():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) * 1024

what, path, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
config = LlamaCppConfig(path, n_seq_max=1)
llama_logs()
ll.llama_backend_init()
start = rss()
began = time.perf_counter()
loaded = LlamaCppVocabulary.load(config) if what == "vocabulary" else load_model(path, config)
seconds, added = time.perf_counter() - began, rss() - start
left = None
if what == "vocabulary":
    loaded.close()
    for _ in range(cycles):
        LlamaCppVocabulary.load(config).close()
    left = rss() - start
print(json.dumps({"added": added, "seconds": seconds, "left": left}))
"""


def measure(what: str, model_path: str) -> dict:
    done = subprocess.run([sys.executable, "-c", MEASURE, what, model_path, str(CYCLES)], capture_output=True,
                          text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def backend(model_path: str):
    backend = LlamaCppBackend(LlamaCppConfig(model_path, n_seq_max=1))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def vocabulary(model_path: str):
    vocabulary = LlamaCppVocabulary.load(LlamaCppConfig(model_path))
    yield vocabulary
    vocabulary.close()


@pytest.mark.parametrize("add_special", [True, False])
def test_it_tokenizes_as_the_full_backend(backend: LlamaCppBackend, vocabulary: LlamaCppVocabulary,
                                          add_special: bool) -> None:
    for text in TEXTS:
        assert vocabulary.tokenize(text, add_special) == backend.tokenize(text, add_special), text
    assert vocabulary.tokenize("<|im_end|>", add_special=False) == [2]  # a special token is one token


def test_every_token_has_the_full_backends_bytes(backend: LlamaCppBackend, vocabulary: LlamaCppVocabulary) -> None:
    assert vocabulary.n_vocab == backend.n_vocab == backend.info.n_vocab
    assert vocabulary.max_token_bytes == backend.max_token_bytes > 0
    for token in range(vocabulary.n_vocab):
        assert vocabulary.token_bytes(token) == backend.token_bytes(token), token
        assert vocabulary.special_token_bytes(token) == backend.special_token_bytes(token), token
    assert (vocabulary.eog_mask() == backend.eog_mask()).all()


def test_the_text_side_reads_it_as_the_engines_backend(backend: LlamaCppBackend,
                                                      vocabulary: LlamaCppVocabulary) -> None:
    ours, theirs = Tokenizer(vocabulary, 2048, ""), Tokenizer(backend, 2048, "")
    text = "".join(TEXTS)
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert ours.control_token("<|im_start|>") == theirs.control_token("<|im_start|>") == 1
    assert ours.max_prompt_chars == theirs.max_prompt_chars > 0


def test_it_renders_the_chat_template_as_the_full_backend(backend: LlamaCppBackend,
                                                          vocabulary: LlamaCppVocabulary) -> None:
    source = vocabulary.chat_template_source()
    assert source == backend.chat_template_source()
    assert source.text and "<|im_start|>" in source.text and source.eos_token == "<|im_end|>"
    assert vocabulary.apply_chat_template(MESSAGES) == backend.apply_chat_template(MESSAGES)


def test_its_guidance_tokenizer_is_the_full_backends(backend: LlamaCppBackend, vocabulary: LlamaCppVocabulary) -> None:
    ours, theirs = vocabulary.guidance_tokenizer(), backend.guidance_tokenizer()
    assert ours.vocab_size == theirs.vocab_size == vocabulary.n_vocab
    assert ours.eos_token == theirs.eos_token
    for token in range(vocabulary.n_vocab):
        assert ours.decode_bytes([token]) == theirs.decode_bytes([token]), token
        assert ours.is_special_token(token) == theirs.is_special_token(token), token
    for text in TEXTS:
        assert ours.tokenize_str(text) == theirs.tokenize_str(text), text


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_it_takes_a_fraction_of_the_full_models_memory_and_close_frees_it(model_path: str) -> None:
    vocabulary, full = measure("vocabulary", model_path), measure("model", model_path)
    # The weights (mapped and read at load) are most of the full model; the vocabulary alone reads none of them.
    assert 0 < vocabulary["added"] < full["added"] / 2, (vocabulary, full)
    # Memory freed may stay with the allocator, but the next load reuses it: CYCLES loads that each kept theirs
    # would leave CYCLES + 1 loads' worth.
    assert vocabulary["left"] < 2 * vocabulary["added"], vocabulary


def test_close_is_final_and_idempotent(model_path: str) -> None:
    vocabulary = LlamaCppVocabulary.load(LlamaCppConfig(model_path))
    vocabulary.close()
    assert vocabulary.model is None and vocabulary.vocab is None
    vocabulary.close()


def test_a_file_that_is_no_model_is_refused(tmp_path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LlamaCppVocabulary.load(LlamaCppConfig(str(path)))
