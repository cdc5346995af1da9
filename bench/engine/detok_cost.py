"""What detokenizing and looking for stop strings costs the engine, a token: the case for doing it there.

    .venv/bin/python bench/engine/detok_cost.py                  # the embedded model's vocabulary
    .venv/bin/python bench/engine/detok_cost.py --tokens 20000 --repeats 5

The engine core turns each request's tokens into text (their pieces through an incremental UTF-8 decoder:
cobali/engine/detok.py's TextStream) and looks for stop strings in the tick that made them, so that a stop ends
the request before its next row is planned. This times that work as the engine does it (Engine._decode_to): the
pieces of a real English text's tokens (workloads/system_prompt.txt, repeated to --tokens), pushed when the stream
is due, every --stream-interval tokens or every token where stop strings are set, and the text taken when due.
Best of --repeats, µs a token.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from cobali.backends.llama_cpp.config import LlamaCppConfig
from cobali.backends.llama_cpp.vocab import LlamaCppVocabulary
from cobali.engine.detok import TextStream

TEXT = Path(__file__).resolve().parents[2] / "workloads" / "system_prompt.txt"
STOPS = ("\n\nUser:", "</answer>", "###", "Observation:")  # a chat's and an agent's


def stream_through(tokens: list[int], piece: dict[int, bytes], stop: tuple[str, ...], interval: int) -> float:
    """Seconds to stream `tokens` through one request's TextStream, as the engine pushes and takes them."""
    stream = TextStream(stop, interval)
    start = time.perf_counter()
    for n in range(1, len(tokens) + 1):
        if stream.checks_each_token or stream.is_due(n):
            stopped = stream.push(b"".join(piece[t] for t in tokens[stream.decoded:n]), decoded=n)
            assert not stopped, f"the text holds a stop string ({stream.stop_hit!r}): choose others"
            if stream.is_due(n):
                stream.take(n)
    stream.close(stopped=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a GGUF whose vocabulary to use (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    vocab = LlamaCppVocabulary.load(LlamaCppConfig(model_path=args.model))
    once = vocab.tokenize(TEXT.read_text(), add_special=False)
    tokens = (once * (args.tokens // len(once) + 1))[: args.tokens]
    piece = {t: vocab.token_bytes(t) for t in set(tokens)}  # the engine's pieces are cached the same way
    print(f"{len(tokens)} tokens of English, {len(piece)} distinct; µs a token, best of {args.repeats}")
    print(f"{'stop strings':>14} {'interval':>8} {'µs/token':>9}")
    for stop, interval in (((), 1), ((), 16), (STOPS, 1), (STOPS, 16)):
        best = min(stream_through(tokens, piece, stop, interval) for _ in range(args.repeats))
        print(f"{len(stop):>14} {interval:>8} {best / len(tokens) * 1e6:>9.2f}")


if __name__ == "__main__":
    main()
