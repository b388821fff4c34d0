"""PPO for multi-turn agents with a value head, written out in one file (CleanRL style).

The MDP is turn-level: a state is the token sequence up to a decision point, an action is the policy's whole reply
(its tokens), the reward is the environment's reward for that turn. Each iteration:

1. Roll out `tasks_per_iteration` x `group_size` episodes of the curriculum's tasks (`rl.play_iteration`); their
   trajectories go into the replay buffer as synthetic experience, and the curriculum may write new tasks.
2. With the current policy, before any update and without dropout: the "old" log-probability of every action token,
   the reference policy's (the warm start, for the KL penalty) and the value V(s_t) at every turn's decision point
   (the position just before the action's first token): a linear value head on the policy's last hidden state,
   so the value loss shapes the shared layers (the adapter) too, as in TRL's value-head models.
3. GAE over turns gives each turn an advantage and a return; advantages are normalised over the iteration's turns
   and every token of an action shares its turn's advantage.
4. `ppo.epochs` optimizer steps, each over all episodes in micro-batches (micro-batches only bound memory: the
   gradients accumulate over the iteration): per-token clipped surrogate on the policy's tokens only, plus
   `beta` x KL to the reference (k3 estimator), plus `ppo.value_coef` x MSE of the values to the returns.

Layout and resuming mirror components/rl/grpo.py: `out_dir/checkpoints/checkpoint-N` (adapter, value head, optimizer,
RNG states, then the replay buffer, curriculum and iteration log as of iteration N), `out_dir/model` the merged
final policy.
"""
from __future__ import annotations

import copy
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from components import distributed
from components.files import LAST_CHECKPOINT_MARK, atomic_directory
from components.llm.backends import GenerationBackend
from components.rl.curriculum import Curriculum
from components.rl.loop import (
    CurveProbe,
    RLResult,
    RLSettings,
    another_iteration_fits,
    checkpoint_number,
    iteration_record,
    keep_episodes,
    logged_seconds,
    play_iteration,
    progress,
    prune_checkpoints,
    save_sidecars,
    save_trained_policy,
    start_run,
    trainable,
)
from components.rl.policy import PolicyFormat
from components.rl.rollouts import Episode, EpisodeBatch
from components.simulator.replay_buffer import ReplayBuffer

if TYPE_CHECKING:  # torch and transformers take seconds to import: only the functions that need them do
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

VALUE_HEAD, OPTIMIZER, RNG = "value_head.pt", "optimizer.pt", "rng.pt"
MAX_GRAD_NORM = 1.0


# --- advantages ----------------------------------------------------------------------------------------------------

def turn_advantages(rewards: list[float], values: list[float], gamma: float, gae_lambda: float,
                    last_value: float = 0.0) -> tuple[list[float], list[float]]:
    """GAE over one episode's turns: (advantages, returns), one per turn.

    `values[t]` is V(s_t) at turn t's decision point; `last_value` is the value of the state after the last action
    (0 for a terminal state). delta_t = r_t + gamma V(s_t+1) - V(s_t); A_t = delta_t + gamma lambda A_t+1;
    the return (the value target) is A_t + V(s_t).
    """
    advantages = [0.0] * len(rewards)
    following, next_value = 0.0, last_value
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        following = delta + gamma * gae_lambda * following
        advantages[t], next_value = following, values[t]
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


# --- episodes as tensors -------------------------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """A few episodes as right-padded tensors, plus what the update attaches to them.

    Logits are only computed at `positions`: the sequence positions whose next token is an action token in some
    row (the environment's tokens and the prompt need none, and the vocabulary projection is most of the memory).
    """
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    positions: torch.Tensor  # (K,) position p: its logits score the token at p + 1
    targets: torch.Tensor  # (B, K) the token at p + 1
    policy_mask: torch.Tensor  # (B, K) 1.0 where that token is this row's action token (env_mask 1)
    token_turn: torch.Tensor  # (B, K) the turn that token belongs to, numbered across the micro-batch
    decision_rows: torch.Tensor  # (T,) per turn of the micro-batch: its row ...
    decision_positions: torch.Tensor  # (T,) ... and its decision point (just before the action's first token)
    # set by ppo_update before the first epoch
    old_logprobs: torch.Tensor | None = None  # (B, K)
    ref_logprobs: torch.Tensor | None = None  # (B, K); None without a reference policy
    advantages: torch.Tensor | None = None  # (T,) normalised
    returns: torch.Tensor | None = None  # (T,)

    @property
    def turns(self) -> int:
        return len(self.decision_rows)


def make_micro_batch(episodes: list[Episode], pad_id: int, device: torch.device | str = "cpu") -> MicroBatch:
    import torch

    length = max(len(e.prompt_ids) + len(e.completion_ids) for e in episodes)
    input_ids = torch.full((len(episodes), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(episodes), length), dtype=torch.long)
    is_action = torch.zeros((len(episodes), length), dtype=torch.bool)  # per sequence position
    turn = torch.zeros((len(episodes), length), dtype=torch.long)
    rows, decisions, first_turn = [], [], 0
    for row, episode in enumerate(episodes):
        n_prompt, sequence = len(episode.prompt_ids), episode.prompt_ids + episode.completion_ids
        input_ids[row, :len(sequence)] = torch.tensor(sequence)
        attention_mask[row, :len(sequence)] = 1
        is_action[row, n_prompt:len(sequence)] = torch.tensor(episode.env_mask, dtype=torch.bool)
        ends = episode.action_starts[1:] + [len(episode.completion_ids)]
        for t, (start, end) in enumerate(zip(episode.action_starts, ends, strict=True)):
            turn[row, n_prompt + start:n_prompt + end] = first_turn + t  # the env tokens in there are masked out
            rows.append(row)
            decisions.append(n_prompt + start - 1)
        first_turn += len(episode.action_starts)
    positions = torch.nonzero(is_action[:, 1:].any(dim=0)).squeeze(1)
    scored = positions + 1
    return MicroBatch(input_ids.to(device), attention_mask.to(device), positions.to(device),
                      input_ids[:, scored].to(device), is_action[:, scored].float().to(device),
                      turn[:, scored].to(device), torch.tensor(rows, device=device),
                      torch.tensor(decisions, device=device))


# --- forward pass and loss -----------------------------------------------------------------------------------------

def sequence_logprobs_and_values(model: PreTrainedModel, value_head: torch.nn.Module | None, batch: MicroBatch,
                                 temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward pass: the log-probability (B, K) and entropy (B, K, no gradient) of each scored token under
    logits / temperature (the distribution the rollouts sampled from), and V at each decision point (T,)."""
    import torch

    output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, output_hidden_states=True,
                   logits_to_keep=batch.positions)
    logprobs = torch.log_softmax(output.logits.float() / temperature, dim=-1)  # (B, K, vocabulary)
    token_logprobs = logprobs.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    values = None
    if value_head is not None:
        hidden = output.hidden_states[-1][batch.decision_rows, batch.decision_positions]  # (T, hidden)
        values = value_head(hidden.float()).squeeze(-1)
    return token_logprobs, entropy, values


def reference_logprobs(model: PreTrainedModel, reference: PreTrainedModel | None, batch: MicroBatch,
                       temperature: float) -> torch.Tensor | None:
    """The warm start's log-probabilities: a frozen copy when fine-tuning fully, else the policy with its LoRA
    adapter switched off (no second copy of the weights). With LoRA they are computed even when `beta` is 0: the KL
    to the warm start is worth logging, and costs one forward pass without gradients."""
    if reference is not None:
        return sequence_logprobs_and_values(reference, None, batch, temperature)[0]
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            return sequence_logprobs_and_values(model, None, batch, temperature)[0]
    return None  # full fine-tuning with beta 0: no reference kept


class PolicyLoss(NamedTuple):
    total: torch.Tensor  # surrogate + beta * kl
    surrogate: torch.Tensor
    kl: torch.Tensor
    clip_ratio: torch.Tensor  # share of tokens whose ratio left [1 - eps, 1 + eps]


def ppo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
             advantages: torch.Tensor, mask: torch.Tensor, clip_epsilon: float, beta: float,
             n_tokens: float | None = None) -> PolicyLoss:
    """Per-token clipped surrogate and KL penalty, summed over the policy's tokens (`mask` 1) and divided by
    `n_tokens` (default: the tokens in `mask`; the update passes the iteration's total, so every token of the
    iteration weighs the same whatever micro-batch it falls in). Tokens outside `mask` never contribute."""
    import torch

    policy = mask > 0
    n_tokens = n_tokens if n_tokens is not None else mask.sum().clamp(min=1)
    ratio = torch.exp(logprobs - old_logprobs)
    surrogate = -torch.min(ratio * advantages, ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantages)
    if ref_logprobs is None:
        kl = torch.zeros_like(logprobs)
    else:  # k3 = r - log r - 1 with r = pi_ref / pi: unbiased, never negative, low variance (Schulman)
        log_ref_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1
    zero = torch.zeros_like(logprobs)
    surrogate = torch.where(policy, surrogate, zero).sum() / n_tokens  # where, not *: a NaN off the mask stays out
    kl = torch.where(policy, kl, zero).sum() / n_tokens
    clipped = torch.where(policy, ((ratio - 1).abs() > clip_epsilon).float(), zero).sum() / n_tokens
    return PolicyLoss(surrogate + beta * kl, surrogate, kl, clipped.detach())


# --- one PPO update ------------------------------------------------------------------------------------------------

def ppo_update(model: PreTrainedModel, reference: PreTrainedModel | None, value_head: torch.nn.Linear,
               optimizer: torch.optim.Optimizer, episodes: list[Episode], settings: RLSettings,
               pad_id: int) -> dict[str, float | None]:
    """Steps 2-4 of the module docstring on one iteration's episodes; returns the numbers for the iteration log."""
    import torch

    device = next(model.parameters()).device
    # temperature 0 means greedy rollouts: score their tokens under the plain softmax (logits / 1)
    temperature = settings.temperature if settings.temperature > 0 else 1.0
    batches = [make_micro_batch(episodes[i:i + settings.micro_batch_size], pad_id, device)
               for i in range(0, len(episodes), settings.micro_batch_size)]
    # Under a launcher each process scores and trains every N-th micro-batch; advantages, the loss's normalisers and
    # the summed gradients are those of all the episodes, so N processes take the step one would.
    mine = range(distributed.rank(), len(batches), distributed.world_size())
    # Dropout stays off throughout (as in TRL's PPO): then the first epoch is exactly on-policy (ratio 1) and the
    # ratio measures the update, not dropout noise.
    model.eval()

    # Old log-probabilities recomputed here, not the sampling ones: generate's left-padded batch differs
    # numerically from this right-padded one, and the ratio must compare like with like.
    values = {}
    with torch.no_grad():
        for index in mine:
            batch = batches[index]
            batch.old_logprobs, _, batch_values = sequence_logprobs_and_values(model, value_head, batch, temperature)
            batch.ref_logprobs = reference_logprobs(model, reference, batch, temperature)
            values[index] = batch_values.tolist()
    values = {index: part for shares in distributed.all_gather(values) for index, part in shares.items()}
    values_per_turn = [value for index in range(len(batches)) for value in values[index]]  # episode by episode

    advantages, returns, turn = [], [], 0
    for episode in episodes:
        n = len(episode.rewards)
        # After the last turn: 0 when the environment ended the episode (terminal). When the turn or token limit
        # ended it, also 0, on purpose: those limits are part of the task (evaluation stops there too), so no more
        # reward can come, and bootstrapping would credit slow episodes with rewards they can never collect. (After a
        # token-limit cut the last position is not even a decision point the value head was trained on.)
        episode_advantages, episode_returns = turn_advantages(episode.rewards, values_per_turn[turn:turn + n],
                                                              settings.ppo.gamma, settings.ppo.gae_lambda,
                                                              last_value=0.0)
        advantages += episode_advantages
        returns += episode_returns
        turn += n
    advantages_t = torch.tensor(advantages, device=device)
    advantages_t = (advantages_t - advantages_t.mean()) / (advantages_t.std(unbiased=False) + 1e-8)
    returns_t = torch.tensor(returns, device=device)
    offset = 0
    for batch in batches:
        batch.advantages = advantages_t[offset:offset + batch.turns]
        batch.returns = returns_t[offset:offset + batch.turns]
        offset += batch.turns

    n_tokens = sum(batch.policy_mask.sum().item() for batch in batches)
    n_turns = len(advantages)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    totals = dict.fromkeys(("loss", "policy_loss", "value_loss", "kl", "entropy", "clip_ratio"), 0.0)
    grad_norm = 0.0
    for _ in range(settings.ppo.epochs):
        optimizer.zero_grad(set_to_none=True)
        for batch in (batches[index] for index in mine):
            logprobs, entropy, batch_values = sequence_logprobs_and_values(model, value_head, batch, temperature)
            policy = ppo_loss(logprobs, batch.old_logprobs, batch.ref_logprobs, batch.advantages[batch.token_turn],
                              batch.policy_mask, settings.clip_epsilon, settings.beta, n_tokens)
            value_loss = ((batch_values - batch.returns) ** 2).sum() / n_turns
            loss = policy.total + settings.ppo.value_coef * value_loss
            loss.backward()  # gradients accumulate over the micro-batches: one step per epoch
            for key, number in (("loss", loss), ("policy_loss", policy.surrogate), ("value_loss", value_loss),
                                ("kl", policy.kl), ("clip_ratio", policy.clip_ratio),
                                ("entropy", (entropy * batch.policy_mask).sum() / n_tokens)):
                totals[key] += number.item()
        distributed.sum_gradients(parameters)
        grad_norm += torch.nn.utils.clip_grad_norm_(parameters, MAX_GRAD_NORM).item()
        optimizer.step()
    totals = {**distributed.sum_numbers(totals), "grad_norm": grad_norm}
    update: dict[str, float | None] = {key: total / settings.ppo.epochs for key, total in totals.items()}
    if reference is None and not hasattr(model, "disable_adapter"):
        update["kl"] = None  # no reference policy: nothing was measured
    return update


# --- model, optimizer, checkpoints ---------------------------------------------------------------------------------

def load_policy(policy_model: str, settings: RLSettings, cache_dir: str | Path, resume: Path | None
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, PreTrainedModel | None]:
    """(policy to train, tokenizer, frozen reference or None): the warm start with a fresh LoRA adapter, or with the
    adapter of the checkpoint `resume`; with `lora` None the whole model trains (from the checkpoint's weights when
    resuming) and a frozen copy of the warm start is kept as the reference when `beta` > 0."""
    import torch

    from components.llm.models import load_causal_lm

    model, tokenizer = load_causal_lm(policy_model, cache_dir=cache_dir, dtype="float32")
    if settings.lora is None:
        reference = copy.deepcopy(model).eval().requires_grad_(False) if settings.beta > 0 else None
        if resume is not None:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(resume, dtype=torch.float32).to(model.device)
        return model, tokenizer, reference

    from peft import PeftModel, get_peft_model

    from components.llm.sft import lora_config

    if resume is not None:
        return PeftModel.from_pretrained(model, resume, is_trainable=True), tokenizer, None
    return get_peft_model(model, lora_config(model, settings.lora)), tokenizer, None


def make_value_head(model: PreTrainedModel) -> torch.nn.Linear:
    import torch

    value_head = torch.nn.Linear(model.config.hidden_size, 1)
    # Zero at the start: V = 0 everywhere, so the first value-loss gradients reaching the shared layers are not the
    # noise of a random head.
    torch.nn.init.zeros_(value_head.weight)
    torch.nn.init.zeros_(value_head.bias)
    return value_head.to(next(model.parameters()).device)


def make_optimizer(model: PreTrainedModel, value_head: torch.nn.Linear, settings: RLSettings) -> torch.optim.AdamW:
    import torch

    return torch.optim.AdamW([
        {"params": [p for p in model.parameters() if p.requires_grad], "lr": settings.learning_rate},
        {"params": list(value_head.parameters()), "lr": settings.ppo.value_learning_rate},
    ])


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_states() -> dict[str, Any]:
    import numpy as np
    import torch

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(checkpoint: Path, model: PreTrainedModel, value_head: torch.nn.Linear,
                    optimizer: torch.optim.Optimizer, buffer: ReplayBuffer | None, rows: list[dict[str, Any]],
                    curriculum: Curriculum, last: bool = False) -> None:
    """Adapter (or whole model), value head, optimizer and RNG states in one atomic directory, then the side-cars:
    the log, written last, marks the checkpoint complete (`rl.last_complete_checkpoint`). The run's `last`
    checkpoint says so (LAST_CHECKPOINT_MARK), so that a copy of it may leave the optimizer out (a parked row's)."""
    import torch

    with atomic_directory(checkpoint, replace=True) as tmp:
        model.save_pretrained(tmp)
        torch.save(value_head.state_dict(), tmp / VALUE_HEAD)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
        torch.save(rng_states(), tmp / RNG)
        if last:
            (tmp / LAST_CHECKPOINT_MARK).write_text(json.dumps({"iterations": len(rows)}) + "\n", encoding="utf-8")
    save_sidecars(checkpoint, buffer, rows, curriculum)


def load_checkpoint(checkpoint: Path, value_head: torch.nn.Linear, optimizer: torch.optim.Optimizer) -> None:
    """The value head, the optimizer and the RNG states (the policy's weights are loaded by `load_policy`). A last
    checkpoint copied without its optimizer (a parked row's) leaves `optimizer` fresh, as a Trainer does."""
    import torch

    device = value_head.weight.device
    value_head.load_state_dict(torch.load(checkpoint / VALUE_HEAD, map_location=device))
    if (checkpoint / OPTIMIZER).is_file():
        optimizer.load_state_dict(torch.load(checkpoint / OPTIMIZER, map_location=device))
    else:
        log.info("%s holds no optimizer state (a finished run's, copied without it): a fresh optimizer goes on",
                 checkpoint)
    set_rng_states(torch.load(checkpoint / RNG, weights_only=False))  # our own file: Python and numpy states


# --- the training loop ---------------------------------------------------------------------------------------------

def train_ppo(policy_model: str, curriculum: Curriculum, make_batch: Callable[[], EpisodeBatch],
              buffer: ReplayBuffer | None, fmt: PolicyFormat, settings: RLSettings, out_dir: str | Path,
              cache_dir: str | Path = ".cache/models", generator: GenerationBackend | None = None,
              environment: str = "", curve: CurveProbe | None = None) -> RLResult:
    """Train `policy_model` (the warm start) with PPO on episodes from `make_batch()` over the curriculum's tasks
    (`generator` writes the curriculum's task variations; None: no new tasks; `curve` adds held-out success to the
    iteration log). PPO has no groups of one task:
    give the curriculum clusters of similar tasks (`curriculum.cluster_tasks`) to measure reward variance over.

    Layout: `out_dir/checkpoints/checkpoint-N` (adapter, value head, optimizer, RNG states, plus the replay buffer and
    iteration log as of iteration N); `out_dir/model` is the final policy. A rerun with the same settings, warm start
    and `environment` (the caller's identity of where episodes come from) resumes from the last complete checkpoint
    and plays the same tasks an uninterrupted run would have.
    """
    out_dir = Path(out_dir)
    with distributed.main_process_first():  # the main process clears stale checkpoints; all resume from the same
        checkpoints, resume, rows = start_run(policy_model, curriculum, buffer, settings, out_dir, environment)
    earlier_seconds = logged_seconds(rows)  # iterations restored from the checkpoint
    main = distributed.is_main_process()

    seed_everything(settings.seed)  # before the LoRA and value-head initialisations, so a fresh run repeats
    model, tokenizer, reference = load_policy(policy_model, settings, cache_dir, resume)
    value_head = make_value_head(model)
    optimizer = make_optimizer(model, value_head, settings)
    start = 0
    if resume is not None:
        load_checkpoint(resume, value_head, optimizer)
        start = checkpoint_number(resume)

    started = time.monotonic()
    spent = sum(row["env_transitions"] for row in rows)  # every process: the resumed log's, then each iteration's
    iteration = start
    while another_iteration_fits(settings, iteration, spent):
        # Under a launcher each process plays its share of the iteration and trains on its share of all of it.
        episodes, stats, fields = play_iteration(model, tokenizer, make_batch, curriculum, generator, buffer, fmt,
                                                 settings, iteration)

        optimisation_started = time.monotonic()
        # an episode an environment failure ended is not the policy's outcome: it takes no part in the update
        update = ppo_update(model, reference, value_head, optimizer, trainable(episodes), settings,
                            tokenizer.pad_token_id)
        iteration, spent = iteration + 1, spent + fields["env_transitions"]
        last = not another_iteration_fits(settings, iteration, spent)
        if not main:
            continue
        rows.append(iteration_record(iteration, episodes, stats, buffer, **fields,
                                     optimisation_s=round(time.monotonic() - optimisation_started, 2), **update))
        keep_episodes(checkpoints, iteration, episodes)
        if curve is not None:
            rows[-1].update(curve.point(model, tokenizer, iteration, last))

        row, done = rows[-1], iteration - start
        where, pace = progress(settings, iteration, spent, (time.monotonic() - started) / done)
        log.info("iteration %s reward %.3f success %.2f kl %s held-out %s | %s", where, row["reward_mean"],
                 row["success_rate"], row.get("kl", "n/a"), row.get("heldout_success", "-"), pace)
        if iteration % settings.save_every == 0 or last:
            save_checkpoint(checkpoints / f"checkpoint-{iteration}", model, value_head, optimizer, buffer, rows,
                            curriculum, last)
            prune_checkpoints(checkpoints, settings.save_total_limit)

    trained = model.merge_and_unload() if settings.lora is not None else model
    model_dir = save_trained_policy(trained, tokenizer, out_dir, rows) if main else out_dir / "model"
    distributed.wait_for_everyone()
    return RLResult(model_dir, iteration, str(resume) if resume else None, rows,
                    earlier_seconds + time.monotonic() - started)
