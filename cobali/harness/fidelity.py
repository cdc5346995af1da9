"""Output fidelity: does a configuration generate what the model would generate for each request alone?

llama.cpp's numbers for a sequence shift slightly with the batch it shares, the chunking of its prompt, the
KV layout and the CPU's kernels, so two correct configurations can pick different greedy tokens where the
model's top two candidates are nearly tied. Counting identical texts therefore tests the CPU more than the
engine. This module compares greedy runs token by token instead, and at the first divergence of each
request reads the reference's own top-1 minus top-2 logprob margin at that step:

- a divergence at a margin below EPSILON is floating-point noise at a near-tie;
- a divergence at a clear margin is a bug: a wrong position or seq_id, stale KV, a bad prefix copy, or a
  sampler reading another request's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cobali.engine.engine import Engine
from cobali.engine.request import FinishReason
from cobali.engine.sampling_params import SamplingParams
from cobali.frontend.offline import LLM
from cobali.harness.workloads import WorkItem

# Largest reference margin (nats) at which a divergence still counts as noise: above every divergence honest
# batching made in the fidelity matrix (bench/engine/fidelity_matrix.sh: mixed batches, short chunks, preemption,
# prefix reuse), with headroom for other CPUs' kernels, and below the clear divergences of the planted bugs of
# tests/integration/test_engine_real.py (the first step of a corrupted request may still land on a near-tie: a run
# is judged by its largest). The margins: docs/results.md, "Output fidelity".
EPSILON = 1.0
# The tests' second check: with few tokens a request, most must be in common (summed over requests, up to each
# first divergence). Not part of the verdict: over long outputs near-ties become likely, and a correct prefix
# cache on mixed_length kept fewer than half its tokens in common while every divergence was a near-tie.
MIN_COMMON_FRACTION = 0.5
TOP_LOGPROBS = 2  # the margin needs the two most likely tokens


@dataclass(frozen=True)
class Trace:
    """One request's greedy tokens and, at each step, its top-1 minus top-2 logprob margin."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...]
    error: str | None = None


@dataclass(frozen=True)
class RequestFidelity:
    index: int
    n_tokens: int
    common: int  # tokens equal before the first divergence
    divergence: int | None  # step of the first differing token; None: identical
    reference_margin: float | None  # the reference's top-1 minus top-2 logprob at that step
    candidate_margin: float | None
    error: str | None = None

    @property
    def identical(self) -> bool:
        return self.error is None and self.divergence is None


@dataclass(frozen=True)
class FidelityReport:
    requests: tuple[RequestFidelity, ...]
    epsilon: float = EPSILON

    @property
    def n_identical(self) -> int:
        return sum(r.identical for r in self.requests)

    @property
    def margins(self) -> list[float]:
        """The reference's margin at every divergence."""
        return [r.reference_margin for r in self.requests if r.reference_margin is not None]

    @property
    def max_margin(self) -> float:
        return max(self.margins, default=0.0)

    @property
    def common_fraction(self) -> float:
        total = sum(r.n_tokens for r in self.requests)
        return sum(r.common for r in self.requests) / total if total else 1.0

    @property
    def errors(self) -> list[str]:
        return [f"request {r.index}: {r.error}" for r in self.requests if r.error]

    @property
    def flagged(self) -> list[RequestFidelity]:
        """Divergences at a clear margin: each one is a bug."""
        return [r for r in self.requests if r.reference_margin is not None and r.reference_margin >= self.epsilon]

    @property
    def passed(self) -> bool:
        """The verdict: every request ran, and no divergence came at a clear margin."""
        return not self.errors and not self.flagged

    @property
    def mostly_common(self) -> bool:
        return self.common_fraction >= MIN_COMMON_FRACTION

    def summary(self) -> dict:
        return {
            "requests": len(self.requests),
            "identical": self.n_identical,
            "identical_fraction": self.n_identical / len(self.requests) if self.requests else 1.0,
            "divergences": len(self.margins),
            "max_margin_at_divergence": self.max_margin,
            "divergences_over_epsilon": len(self.flagged),
            "common_token_fraction": self.common_fraction,
            "errors": len(self.errors),
            "epsilon": self.epsilon,
            "passed": self.passed,
        }

    def describe(self) -> str:
        s = self.summary()
        lines = [f"identical {s['identical']}/{s['requests']} ({s['identical_fraction']:.0%}), "
                 f"{s['divergences']} divergences, largest reference margin at one {s['max_margin_at_divergence']:.3f} "
                 f"(epsilon {self.epsilon}), tokens in common {s['common_token_fraction']:.1%}: "
                 f"{'PASS' if self.passed else 'FAIL'}"]
        lines += [f"  request {r.index}: first divergence at step {r.divergence} of {r.n_tokens}, margin "
                  f"reference {r.reference_margin:.3f} / candidate {r.candidate_margin:.3f}"
                  for r in self.requests if r.divergence is not None]
        lines += [f"  {e}" for e in self.errors]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"summary": self.summary(), "requests": [asdict(r) for r in self.requests]}


def greedy_traces(engine: Engine, items: Sequence[WorkItem], max_new: int) -> list[Trace]:
    """Run every item greedily to its full length (EOS ignored, so both runs compare as many steps) and
    keep each step's margin."""
    llm = LLM(engine)
    keys = [llm.submit(item.prompt, SamplingParams(max_tokens=item.max_tokens or max_new, ignore_eos=True,
                                                   logprobs=TOP_LOGPROBS))
            for item in items]
    finished = dict(llm.run())
    return [Trace(o.token_ids, tuple(lp.top[0][1] - lp.top[1][1] for lp in o.logprobs),
                  o.error if o.finish_reason is FinishReason.ERROR else None)
            for o in (finished[key] for key in keys)]


def compare(index: int, reference: Trace, candidate: Trace) -> RequestFidelity:
    error = reference.error and f"reference failed: {reference.error}"
    error = error or (candidate.error and f"candidate failed: {candidate.error}")
    n = len(reference.tokens)
    if error:
        return RequestFidelity(index, n, 0, None, None, None, error)
    step = next((i for i, (a, b) in enumerate(zip(reference.tokens, candidate.tokens, strict=False)) if a != b), None)
    if step is None and len(candidate.tokens) != n:
        error = f"candidate generated {len(candidate.tokens)} tokens, the reference {n}"
        return RequestFidelity(index, n, min(n, len(candidate.tokens)), None, None, None, error)
    if step is None:
        return RequestFidelity(index, n, n, None, None, None)
    return RequestFidelity(index, n, step, step, reference.margins[step], candidate.margins[step])


def compare_runs(reference: Sequence[Trace], candidate: Sequence[Trace], epsilon: float = EPSILON) -> FidelityReport:
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference requests against {len(candidate)} candidate requests")
    pairs = enumerate(zip(reference, candidate, strict=True))
    return FidelityReport(tuple(compare(i, a, b) for i, (a, b) in pairs), epsilon)
