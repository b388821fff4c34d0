"""A trained Llama-architecture model directory (safetensors, tokenizer.json) written as one GGUF file, the format
llama.cpp runs (`backends.LlamaCppBackend`).

Written with the `gguf` package that transformers already uses to read GGUF: the model's config becomes llama.*
metadata, its BPE vocabulary and merges the tokenizer.ggml.* fields, each tensor is renamed by gguf's own Hugging
Face name map, and the query and key projections are permuted into the rotary layout llama.cpp expects (the inverse
of the permutation transformers undoes when it reads a GGUF). The file is a cache of the model directory: its name
carries the weight type and a digest of the weights, so a retrained model never runs through a stale file, and it
lives in the models cache, never inside the model directory (a DVC output).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

import numpy as np

WeightType = Literal["f32", "f16", "q8_0"]


def gguf_path(model_dir: str | Path, weight_type: WeightType, cache_dir: str | Path) -> Path:
    """Where `export_gguf` writes `model_dir`'s GGUF: in `cache_dir`/gguf, named by the digest of its weights."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    with open(model_dir / "model.safetensors", "rb") as weights:
        for block in iter(lambda: weights.read(1 << 20), b""):
            digest.update(block)
    return Path(cache_dir) / "gguf" / f"{digest.hexdigest()[:16]}-{weight_type}.gguf"


def export_gguf(model_dir: str | Path, weight_type: WeightType, cache_dir: str | Path) -> Path:
    """`model_dir` as a GGUF file (written once, then reused): see the module docstring."""
    import gguf
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    target = gguf_path(model_dir, weight_type, cache_dir)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{model_dir}: GGUF export handles Llama-architecture models (SmolLM2 is one), "
                         f"not model_type {config.get('model_type')!r}; use the 'hf' backend for it")
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")  # its own: processes of a launch may export at once
    writer = gguf.GGUFWriter(str(partial), "llama")
    _write_metadata(writer, config, weight_type)
    _write_tokenizer(writer, model_dir)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    for name, tensor in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # llama.cpp reads the output projection from token_embd when the file has none
        tensor = tensor.astype(np.float32)
        if name.endswith("q_proj.weight"):
            tensor = _rotary_permute(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _rotary_permute(tensor, kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"{model_dir}: tensor {name!r} has no GGUF name; the model is not a plain Llama")
        data, dtype = _encode(tensor, weight_type, gguf)
        writer.add_tensor(gguf_name, data, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)  # a crash mid-write leaves no file that looks complete
    return target


def _rotary_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face keeps each head's rotary halves apart; llama.cpp interleaves them (convert_hf_to_gguf's permute)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _encode(tensor: np.ndarray, weight_type: WeightType, gguf) -> tuple[np.ndarray, object]:
    if tensor.ndim == 1 or weight_type == "f32":  # norms stay f32, as llama.cpp's converter keeps them
        return tensor, gguf.GGMLQuantizationType.F32
    if weight_type == "f16":
        return tensor.astype(np.float16), gguf.GGMLQuantizationType.F16
    kind = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(tensor, kind), kind


def _write_metadata(writer, config: dict, weight_type: WeightType) -> None:
    import gguf

    rope = config.get("rope_parameters") or {}
    writer.add_name(str(config.get("_model_name_or_path") or "dreamgym-model"))
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weight_type])


def _write_tokenizer(writer, model_dir: Path) -> None:
    """The byte-level BPE vocabulary as llama.cpp's 'gpt2' tokenizer. Prompts reach llama.cpp as token ids encoded
    by the Hugging Face tokenizer, so llama.cpp only detokenizes: special tokens are marked so it can skip them."""
    import gguf

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    special = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    for added in tokenizer.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ValueError(f"{model_dir}/tokenizer.json: token ids are not 0..{len(tokens) - 1} without gaps")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")  # the pre-tokenizer splits text; llama.cpp gets ids, never text, here
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
