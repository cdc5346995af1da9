"""Which file `--hf-repo REPO[:QUANT]` / `--hf-file` loads: llama-server's picking (llama.cpp's
common/download.cpp), on file listings alone."""

from __future__ import annotations

import sys

import pytest

from cobali.backends.hf_model import pick_gguf, resolve_hf_model, split_parts, split_repo

REPO = [
    "README.md", "mmproj-model-f16.gguf", "Model-Q2_K.gguf", "Model-Q4_K_M.gguf", "Model-q8_0.gguf",
    "big/Model-Q6_K-00002-of-00003.gguf", "big/Model-Q6_K-00001-of-00003.gguf", "big/Model-Q6_K-00003-of-00003.gguf",
    "Model-Q4_K_M.imatrix.gguf",
]


@pytest.mark.parametrize(("quant", "expected"), [
    ("", "Model-Q4_K_M.gguf"),  # the default quant
    ("q2_k", "Model-Q2_K.gguf"),  # case-insensitive
    ("Q8_0", "Model-q8_0.gguf"),
    ("Q6_K", "big/Model-Q6_K-00001-of-00003.gguf"),  # a split model by its first part
])
def test_the_quant_is_picked_as_llama_server_picks_it(quant: str, expected: str) -> None:
    assert pick_gguf(REPO, quant) == expected


def test_without_q4_k_m_the_default_is_q8_0_then_the_first_model() -> None:
    assert pick_gguf([f for f in REPO if "Q4_K_M" not in f]) == "Model-q8_0.gguf"
    assert pick_gguf(["mmproj-x.gguf", "a-F16.gguf", "b-Q5_0.gguf"]) == "a-F16.gguf"  # never a projector


def test_a_missing_quant_names_the_quants_the_repository_has() -> None:
    with pytest.raises(ValueError, match=r"no Q5_K_M GGUF in o/n: it has Q2_K, Q4_K_M, Q6_K, Q8_0"):
        pick_gguf(REPO, "Q5_K_M", repo="o/n")
    with pytest.raises(ValueError, match=r"no GGUF model in o/n: it has no .gguf files"):
        pick_gguf(["README.md"], repo="o/n")


def test_hf_file_is_matched_case_insensitively_or_named_missing() -> None:
    assert pick_gguf(REPO, "Q2_K", hf_file="model-q4_k_m.GGUF") == "Model-Q4_K_M.gguf"
    with pytest.raises(ValueError, match=r"--hf-file 'x.gguf' is not in o/n; its GGUF files: mmproj-model-f16.gguf"):
        pick_gguf(REPO, hf_file="x.gguf", repo="o/n")


def test_every_part_of_a_split_model_is_fetched() -> None:
    assert split_parts(REPO, "big/Model-Q6_K-00001-of-00003.gguf") == [
        "big/Model-Q6_K-00002-of-00003.gguf", "big/Model-Q6_K-00001-of-00003.gguf",
        "big/Model-Q6_K-00003-of-00003.gguf"]
    assert split_parts(REPO, "Model-Q2_K.gguf") == ["Model-Q2_K.gguf"]


@pytest.mark.parametrize("spec", ["noslash", "a/b/c", "/b:Q4_0", "a/:Q4_0"])
def test_a_bad_repo_spec_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="expected OWNER/NAME"):
        split_repo(spec)


def test_without_huggingface_hub_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # an import of it fails
    with pytest.raises(ValueError, match=r"--hf-repo needs the hf extra: pip install '\.\[hf\]'"):
        resolve_hf_model("o/n:Q4_0")
