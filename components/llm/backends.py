"""Text generation backends: prompts in, replies out, one per prompt, in order.

Hugging Face batched `generate` (the default, CPU or one GPU), llama.cpp in-process (CPU, the model exported to
GGUF), vLLM offline inference (GPU), and any OpenAI-compatible endpoint (a served model that many workers share).
The experience model, the curriculum's task writer, the annotation teacher and the policy's next-action accuracy all
generate through this seam.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:  # torch and transformers load inside the functions that need them
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from components.llm.gguf_export import WeightType

log = logging.getLogger(__name__)
# torch's global random stream: one sampler at a time, whatever its thread (a stream forked, reseeded and put back
# by one must not take the other's draws)
TORCH_RANDOM = threading.RLock()


def stream_seed(*parts: int) -> int:
    """A sampling seed made of integers (a run's seed, an iteration, an episode, a turn): the same in every process,
    as Python hashes a tuple of integers without its per-process salt."""
    return hash(parts) & 0xFFFF_FFFF_FFFF


@contextmanager
def random_stream(seed: int | None, device: Any) -> Iterator[None]:
    """Sampling on `device` inside the block draws from `seed`, holding torch's global stream (TORCH_RANDOM), which
    comes back as it was; None: the global stream as it goes."""
    if seed is None:
        yield
        return
    import torch

    with TORCH_RANDOM, torch.random.fork_rng(devices=[device] if device.type == "cuda" else [],
                                              device_type=device.type):
        torch.manual_seed(seed)
        yield


Message = dict[str, str]
Prompt = str | list[Message]  # a rendered prompt string, or chat messages to render with the chat template


class BackendError(RuntimeError):
    """A backend could not produce replies at all (an endpoint down, a refused request)."""


class PromptTooLong(BackendError):
    """Some prompts of a batch (`indices`) do not fit the backend's context; the others would have been answered."""

    def __init__(self, message: str, indices: Sequence[int]) -> None:
        super().__init__(message)
        self.indices = tuple(indices)


class GenerationBackend(Protocol):
    """Turns prompts into replies, one per prompt, in order. Chat messages get the model's chat template."""

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float) -> list[str]: ...


class HFGenerationBackend:
    """Batched `model.generate` with left padding: the default, on CPU or one GPU.

    Prompts are sorted by length before batching, so each batch pads little; replies come back in input order.
    temperature 0 is greedy decoding (reproducible); above 0 samples.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 8,
                 stop: Sequence[str] = ()) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.stop = list(stop)  # a reply ends at the first of these (kept): tokens after it would be thrown away
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self._seed: int | None = None
        self._calls = 0

    def reseed(self, seed: int) -> None:
        """Sampling (temperature > 0) repeats after the same seed, on a random stream of the backend's own: the
        process's torch RNG (an agent's, in the same process) is neither reset nor advanced."""
        self._seed, self._calls = seed, 0

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0) -> list[str]:
        seed = None  # never reseeded: sample from the process's stream, as generate always does
        if self._seed is not None:
            seed, self._calls = self._seed * 1_000_003 + self._calls, self._calls + 1
        # a sampler in another thread (the policy, while this model serves a simulator) draws from the same stream
        with TORCH_RANDOM if temperature > 0 else nullcontext(), random_stream(seed, self.model.device):
            return self._generate(prompts, max_new_tokens, temperature)

    def _generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float) -> list[str]:
        import torch

        encoded = [encode_prompt(self.tokenizer, p) for p in prompts]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
        replies: list[str] = [""] * len(encoded)
        self.model.eval()
        started, batches = time.monotonic(), math.ceil(len(order) / self.batch_size)
        sampling = sampling_settings(temperature)
        stopping = {"stop_strings": self.stop, "tokenizer": self.tokenizer} if self.stop else {}
        for start in range(0, len(order), self.batch_size):
            batch = order[start: start + self.batch_size]
            inputs = self.tokenizer.pad({"input_ids": [encoded[i] for i in batch]}, padding_side="left",
                                        return_tensors="pt").to(self.model.device)
            with torch.inference_mode():
                output = self.model.generate(**inputs, max_new_tokens=max_new_tokens,
                                             pad_token_id=self.tokenizer.pad_token_id, **sampling, **stopping)
            new_tokens = output[:, inputs["input_ids"].shape[1]:]
            for i, text in zip(batch, self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True), strict=True):
                replies[i] = text
            if batches > 1:
                done = start // self.batch_size + 1
                elapsed = time.monotonic() - started
                log.info("generated batch %d/%d (%d new tokens max) | %.1fs/batch, ETA %.0fs", done, batches,
                         new_tokens.shape[1], elapsed / done, elapsed / done * (batches - done))
        return replies


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> list[int]:
    """A prompt's token ids: chat messages through the chat template (with the assistant's header), strings as they
    are (the tokenizer adds BOS where the model wants one)."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already has them


def sampling_settings(temperature: float) -> dict[str, Any]:
    """`generate` keywords: greedy at temperature 0 (reproducible), else plain sampling at that temperature."""
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}


class ConversationBackend:
    """Generation for ONE growing conversation (an episode), encoding only what is new at each turn.

    Every call renders and tokenizes the whole prompt exactly as `HFGenerationBackend` does, then keeps the
    key/value cache of the longest prefix those tokens share with the ones already run through the model: a turn
    pays for its new observation and its reply, not for the conversation so far. The cache is cut back to that
    prefix, so whatever text the caller puts in the conversation (a parsed action rather than the raw reply) is what
    the model sees: the same token ids as `HFGenerationBackend` at batch 1. One prompt per call; one object per
    episode (or per thread: a new conversation reuses whatever prefix it shares, the system turn at least).
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.model, self.tokenizer = model, tokenizer
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.cache: Any = None
        self.cached_ids: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.prompt_tokens = 0  # prompt tokens seen, and of them encoded (the rest came from the cache)
        self.encoded_tokens = 0

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0) -> list[str]:
        if len(prompts) != 1:
            raise ValueError(f"a ConversationBackend continues one conversation: got {len(prompts)} prompts")
        ids = encode_prompt(self.tokenizer, prompts[0])
        sequence = self.extend(ids, max_new_tokens, temperature)[0].tolist()
        return [self.tokenizer.decode(sequence[len(ids):], skip_special_tokens=True)]

    def extend(self, ids: list[int], max_new_tokens: int, temperature: float, **generate_kwargs: Any) -> Any:
        """`model.generate` on the token ids `ids`, encoding only what follows the longest prefix they share with the
        cache (see the class); returns what generate returns (its sequences begin with `ids`)."""
        import torch
        from transformers import DynamicCache

        shared = 0
        for cached, new in zip(self.cached_ids, ids[:-1]):  # at least the last token is encoded: it gives the logits
            if cached != new:
                break
            shared += 1
        if shared == 0 or self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
            shared = 0
        elif (surplus := self.cache.get_seq_length() - shared) > 0:
            self.cache.crop(-surplus)  # back to the shared prefix
        self.prompt_tokens += len(ids)
        self.encoded_tokens += len(ids) - shared
        self.model.eval()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=torch.tensor([ids], device=self.model.device), attention_mask=torch.ones(
                    1, len(ids), dtype=torch.long, device=self.model.device), past_key_values=self.cache,
                max_new_tokens=max_new_tokens, **{"pad_token_id": self.tokenizer.pad_token_id, **generate_kwargs},
                **sampling_settings(temperature))
        sequences = output.sequences if hasattr(output, "sequences") else output
        self.cached_ids = sequences[0].tolist()[:self.cache.get_seq_length()]
        return output


class OpenAICompatibleBackend:
    """Any OpenAI-compatible server (vLLM `serve`, TGI, llama.cpp server, a hosted API) over plain HTTP.

    Chat messages go to `{base_url}/chat/completions`, plain strings to `{base_url}/completions`. Requests run
    `concurrency` at a time, since servers batch concurrent requests themselves. Connection errors, timeouts, 429
    and 5xx are retried with exponential backoff; other HTTP errors (a wrong model name, a bad key) fail at once.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        concurrency: int = 8,
        backoff_s: float = 1.0,
        stop: Sequence[str] = (),
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.stop = list(stop)  # the API's `stop`: servers leave the stop string out, so it is put back
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s, self.max_retries, self.concurrency = timeout_s, max_retries, concurrency
        self.backoff_s = backoff_s

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0) -> list[str]:
        failed = threading.Event()  # one request out of retries fails the call: the others stop trying
        errors: list[BackendError] = []  # the failed requests' own errors, first first

        def one(prompt: Prompt) -> str:
            body: dict[str, Any] = {"model": self.model, "max_tokens": max_new_tokens, "temperature": temperature}
            if self.stop:
                body["stop"] = self.stop
            try:
                if isinstance(prompt, str):
                    choice = self._post("/completions", {**body, "prompt": prompt}, failed)["choices"][0]
                    return _with_stop(choice["text"] or "", choice, self.stop)
                choice = self._post("/chat/completions", {**body, "messages": prompt}, failed)["choices"][0]
                return _with_stop(choice["message"]["content"] or "", choice, self.stop)
            except _NotSent:
                raise
            except BackendError as error:
                errors.append(error)
                failed.set()
                raise

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            try:
                return list(pool.map(one, prompts))
            except _NotSent:  # an earlier prompt was not sent: the error that stopped it is the one to report
                raise errors[0] from None

    def _post(self, path: str, body: dict[str, Any], failed: threading.Event | None = None) -> dict[str, Any]:
        """The endpoint's JSON reply; BackendError once retries run out, or at once when `failed` says another
        request of the same call has given up (an endpoint that is down costs one request's retries, not each one's)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base_url + path, json.dumps(body).encode(), headers, method="POST")
        for attempt in range(self.max_retries + 1):
            if failed is not None and failed.is_set():
                raise _NotSent(f"{self.base_url}{path}: not sent, another request of this call failed")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as error:
                if error.code != 429 and error.code < 500 or attempt == self.max_retries:
                    detail = error.read()[:500].decode(errors="replace")
                    raise BackendError(f"{self.base_url}{path}: HTTP {error.code}: {detail}") from error
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                if attempt == self.max_retries:
                    raise BackendError(f"{self.base_url}{path}: {error}") from error
            delay = min(self.backoff_s * 2.0**attempt, 30.0)
            if failed is None:
                time.sleep(delay)
            else:
                failed.wait(delay)  # another request giving up ends the wait
        raise AssertionError("unreachable")


class _NotSent(BackendError):
    """A request left unsent because another of its call failed (`generate` reports that one's error)."""


def _with_stop(text: str, choice: dict[str, Any], stop: Sequence[str]) -> str:
    """OpenAI-style servers cut the stop string off; with one stop string it is known and goes back on, so a
    reply reads the same from every backend (`</done>` closes the experience model's format)."""
    if choice.get("finish_reason") == "stop" and len(stop) == 1 and not text.endswith(stop[0]):
        return text + stop[0]
    return text


class LlamaCppBackend:
    """llama.cpp in-process (CPU): the trained model exported to GGUF (`gguf_export`), no server, no Python per layer.

    llama.cpp runs the weights in one C++ graph, with int8 kernels for q8_0 (Hugging Face `generate` at batch 1 on a
    CPU is bound by per-token Python overhead; batched, by arithmetic, as llama.cpp is). Prompts are encoded by the
    Hugging Face tokenizer exactly as `HFGenerationBackend` encodes them (the same token ids reach the model), and
    llama.cpp keeps the key/value cache of the longest prefix a prompt shares with the previous one (the system
    message at least). A reply ends at end-of-sequence, at `max_new_tokens`, or with the token that completes a stop
    string (kept, as with the HF backend). With `batch_size` > 1 the prompts of a call are decoded together, up to
    that many at once, each its own sequence of a second llama.cpp context: every decoding step is one forward pass
    for all of them (what it buys on a CPU: reports/research/experience_model/speed/).

    `draft_tokens` > 0 turns on prompt-lookup decoding (one sequence at a time): after each token, up to that many
    tokens that followed the same bigram earlier in the prompt or reply are checked in one forward pass and kept
    while they match the greedy choice. A reply copies much of its prompt (the next state repeats the state), and on
    a CPU checking k tokens at once costs about what prompt encoding does per token, far less than k decoding steps.
    Greedy replies are unchanged; llama.cpp then keeps logits for every position (context x vocabulary floats).
    """

    def __init__(self, model_dir: str | Path, cache_dir: str | Path, weight_type: WeightType, threads: int,
                 context: int, draft_tokens: int = 0, stop: Sequence[str] = (), batch_size: int = 1) -> None:
        from transformers import AutoTokenizer, GenerationConfig

        try:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        except ImportError as error:
            raise ImportError("the 'llamacpp' backend needs llama-cpp-python (installed by `make setup`)") from error
        from components.llm.gguf_export import export_gguf

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        self.end_ids = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self.stop = list(stop)
        # The context is sized to what a prompt and its reply need, not the model's maximum: prefill cost grew with
        # it (measured without flash attention). Threads 0: every core this process may run on
        # (taskset, cgroups).
        self.threads = threads or len(os.sched_getaffinity(0))
        self.llm = Llama(model_path=str(export_gguf(model_dir, weight_type, cache_dir)), n_ctx=context,
                         flash_attn=True, n_threads=self.threads, n_batch=512, verbose=False,
                         # logits_all: drafts are checked against every position's logits (llama-cpp-python
                         # 0.3.36 sizes its logits buffer by this argument, not by the draft model)
                         logits_all=bool(draft_tokens),
                         draft_model=LlamaPromptLookupDecoding(num_pred_tokens=draft_tokens) if draft_tokens else None)
        self.batch_size, self.draft_tokens = batch_size, draft_tokens
        self._rng = np.random.default_rng(0)  # sampling of sequences decoded together
        # made on first use; prefix: the tokens sequence 0 holds from the last call that all its prompts began with
        self._together: dict[str, Any] = {"context": None, "batch": None, "n_ctx": 0, "prefix": []}
        # freed with the backend, or at exit before the bindings unload: the batch's context before the model
        weakref.finalize(self, _close_llama, self._together, self.llm)

    def reseed(self, seed: int) -> None:
        """Sampling (temperature > 0) repeats after the same seed."""
        self.llm.set_seed(seed)
        self._rng = np.random.default_rng(seed)

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0) -> list[str]:
        encoded = [encode_prompt(self.tokenizer, prompt) for prompt in prompts]
        too_long = [i for i, ids in enumerate(encoded) if len(ids) + max_new_tokens > self.llm.n_ctx()]
        if too_long:  # before generating anything: the caller answers the rest without them
            longest = max(len(encoded[i]) for i in too_long)
            raise PromptTooLong(f"{len(too_long)} of {len(prompts)} prompts (up to {longest} tokens) plus "
                                f"{max_new_tokens} new tokens exceed the llama.cpp context of {self.llm.n_ctx()} "
                                "tokens: raise llamacpp.context", too_long)
        if self.draft_tokens or self.batch_size == 1 or len(encoded) == 1:
            new = [self._generate_one(ids, max_new_tokens, temperature) for ids in encoded]
        else:
            new = [tokens for start in range(0, len(encoded), self.batch_size)
                   for tokens in self._generate_together(encoded[start:start + self.batch_size], max_new_tokens,
                                                         temperature)]
        return [self.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in new]

    def _generate_one(self, ids: list[int], max_new_tokens: int, temperature: float) -> list[int]:
        new: list[int] = []
        # temp 0 is llama.cpp's greedy sampler; above it, plain sampling as sampling_settings asks of HF.
        for token in self.llm.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            if token in self.end_ids:
                break
            new.append(token)
            if len(new) >= max_new_tokens or self._stopped(new):
                break
        return new

    def _generate_together(self, encoded: list[list[int]], max_new_tokens: int, temperature: float) -> list[list[int]]:
        """Every prompt its own sequence of one llama.cpp context: prefills share batches of 512 tokens, and each
        decoding step is one forward pass for all the sequences still going (the weights are read once per step)."""
        import llama_cpp as lc

        context, batch = self._context_for(self.batch_size * max(len(ids) + max_new_tokens for ids in encoded))
        memory = lc.llama_get_memory(context)
        vocabulary = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.llm._model.model))

        def decode(items: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
            """Run (token, position, sequence, wants logits) through the model; the logits asked for, by sequence."""
            batch.n_tokens = len(items)
            for k, (token, position, sequence, wants) in enumerate(items):
                batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = token, position, 1, wants
                batch.seq_id[k][0] = sequence
            if lc.llama_decode(context, batch) != 0:
                raise BackendError("llama_decode failed on a batch of sequences")
            return {sequence: np.ctypeslib.as_array(lc.llama_get_logits_ith(context, k), shape=(vocabulary,)).copy()
                    for k, (_, _, sequence, wants) in enumerate(items) if wants}

        def prefill(tokens: list[tuple[int, int, int, bool]]) -> dict[int, np.ndarray]:
            logits: dict[int, np.ndarray] = {}
            for start in range(0, len(tokens), 512):
                logits.update(decode(tokens[start:start + 512]))
            return logits

        # The prefix every prompt shares (the system message, the task when one task's episodes step together) is
        # encoded once, in sequence 0, and its key/value stream copied to the others; sequence 0 keeps what it
        # already holds of it from the previous call. Each prompt keeps at least its last token, whose logits start
        # its reply.
        shared = os.path.commonprefix(encoded)[:min(len(ids) for ids in encoded) - 1]
        kept = len(os.path.commonprefix([shared, self._together["prefix"]]))
        lc.llama_memory_seq_rm(memory, 0, kept, -1)
        self._together["prefix"] = []  # until sequence 0 holds all of it
        prefill([(token, kept + i, 0, False) for i, token in enumerate(shared[kept:])])
        for sequence in range(1, len(encoded)):  # across streams llama.cpp copies the whole stream, at next decode
            lc.llama_memory_seq_cp(memory, 0, sequence, -1, -1)
        self._together["prefix"] = shared
        logits = prefill([(ids[position], position, sequence, position == len(ids) - 1)
                          for sequence, ids in enumerate(encoded) for position in range(len(shared), len(ids))])
        new: list[list[int]] = [[] for _ in encoded]
        going = list(range(len(encoded)))
        while going:
            step = []
            for sequence in going:
                token = self._choose(logits[sequence], temperature)
                if token in self.end_ids:
                    continue
                new[sequence].append(token)
                if len(new[sequence]) < max_new_tokens and not self._stopped(new[sequence]):
                    step.append((token, len(encoded[sequence]) + len(new[sequence]) - 1, sequence, True))
            going = [sequence for _, _, sequence, _ in step]
            if step:
                logits = decode(step)
        return new

    def _choose(self, logits: np.ndarray, temperature: float) -> int:
        """Greedy at temperature 0, else plain sampling at that temperature (as sampling_settings asks of HF)."""
        if temperature <= 0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / temperature
        probabilities = np.exp(scaled - scaled.max())
        return int(self._rng.choice(len(probabilities), p=probabilities / probabilities.sum()))

    def _context_for(self, tokens: int) -> tuple[Any, Any]:
        """A llama.cpp context of `batch_size` sequences sharing a key/value cache of at least `tokens` cells (made
        again, larger, when a batch needs more), and its token batch."""
        import llama_cpp as lc

        together = self._together
        if together["n_ctx"] < tokens:
            if together["context"] is not None:
                lc.llama_free(together["context"])
            params = lc.llama_context_default_params()
            params.n_ctx = -(-tokens // 256) * 256
            params.n_batch = params.n_ubatch = 512
            params.n_seq_max = self.batch_size
            params.kv_unified = False  # a stream of cells per sequence: attention never spans the others' cells
            params.n_threads = params.n_threads_batch = self.threads
            params.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
            from llama_cpp._utils import suppress_stdout_stderr

            with suppress_stdout_stderr(disable=False):  # llama.cpp's context report, quiet as the Llama above
                together["context"] = lc.llama_init_from_model(self.llm._model.model, params)
            if together["context"] is None:
                raise BackendError(f"llama.cpp could not make a context of {params.n_ctx} tokens")
            together["n_ctx"], together["prefix"] = params.n_ctx, []
        if together["batch"] is None:
            together["batch"] = lc.llama_batch_init(512, 0, self.batch_size)
        return together["context"], together["batch"]

    def _stopped(self, new: list[int]) -> bool:
        if not self.stop:
            return False
        tail = self.tokenizer.decode(new[-16:], skip_special_tokens=True)  # 16 tokens hold any closing tag
        return any(s in tail for s in self.stop)


def _close_llama(together: dict[str, Any], llm: Any) -> None:
    import llama_cpp as lc

    if together["batch"] is not None:
        lc.llama_batch_free(together["batch"])
    if together["context"] is not None:
        lc.llama_free(together["context"])
    llm.close()


class VLLMBackend:
    """vLLM offline inference (GPU): `LLM(model_dir).chat(...)`. A seam for machines that have vLLM installed.

    vLLM is imported only here, so the rest of the project never needs it. To share one served model among many
    rollout workers instead, run `vllm serve MODEL_DIR` and use `OpenAICompatibleBackend("http://host:8000/v1", ...)`.
    """

    def __init__(self, model: str, stop: Sequence[str] = (), **engine_kwargs: Any) -> None:
        self.stop = list(stop)
        try:
            from vllm import LLM
        except ImportError as error:
            raise ImportError(
                "the 'vllm' backend needs the vllm package and a GPU: pip install vllm "
                "(or serve the model elsewhere and use the 'openai' backend)"
            ) from error
        self.llm = LLM(model=model, **engine_kwargs)

    def generate(self, prompts: Sequence[Prompt], max_new_tokens: int, temperature: float = 0.0) -> list[str]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=temperature, max_tokens=max_new_tokens, stop=self.stop or None,
                                include_stop_str_in_output=True)
        replies: list[str] = [""] * len(prompts)
        chats = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if chats:
            for i, out in zip(chats, self.llm.chat([prompts[i] for i in chats], params), strict=True):
                replies[i] = out.outputs[0].text
        if texts:
            for i, out in zip(texts, self.llm.generate([prompts[i] for i in texts], params), strict=True):
                replies[i] = out.outputs[0].text
        return replies


def make_backend(
    kind: Literal["hf", "llamacpp", "vllm", "openai"],
    model: str,
    *,
    batch_size: int,
    base_url: str | None,
    weight_type: WeightType,
    threads: int,
    context: int,
    cache_dir: str | Path,
    draft_tokens: int = 0,
    stop: Sequence[str] = (),
) -> GenerationBackend:
    """The backend params.yaml names (`builders.generation_backend` maps it): `model` is a trained model directory
    (hf, llamacpp, vllm) or the served name (openai). `stop`: strings that end a reply (e.g. the closing tag of the
    expected format), kept in the reply. weight_type, threads, context (prompt and reply tokens), draft_tokens and
    cache_dir (where GGUF exports go) are llamacpp's."""
    if kind == "hf":
        from components.llm.sft import load_trained_model

        lm, tokenizer = load_trained_model(model)
        return HFGenerationBackend(lm, tokenizer, batch_size=batch_size, stop=stop)
    if kind == "llamacpp":
        return LlamaCppBackend(model, cache_dir, weight_type, threads, context, draft_tokens, stop=stop,
                               batch_size=batch_size)
    if kind == "vllm":
        return VLLMBackend(model, stop=stop)
    if kind == "openai":
        if not base_url:
            raise ValueError("the 'openai' backend needs base_url (e.g. http://127.0.0.1:8000/v1)")
        return OpenAICompatibleBackend(base_url, model, stop=stop)
    raise ValueError(f"unknown backend {kind!r}: expected 'hf', 'llamacpp', 'vllm' or 'openai'")
