"""Closed-loop play of an LLM policy, four ways in one run: the conversation re-encoded whole at every turn
(`HFGenerationBackend` at batch 1, the path before `ConversationBackend`), encoded once and extended turn by turn
(`ConversationBackend`, the evaluation stage's path), and the RL rollout (`rollouts.rollout` over a `RealBatch` at
temperature 0, environments stepped one after another) both ways its `batched` switch offers: every game's turn in
one `generate` re-encoding every context, or one game at a time carrying its key/value cache (`policy.batched_rollouts`
false, the CPU profiles' setting).

    .venv/bin/python benchmarks/evaluation_speed.py [--games N] [--policy DIR|NAME] [--threads T] [--workers W]
        [--params FILE] [--rounds R] [--no-batched]

The same policy plays the same N held-out TextWorld games greedily through `evaluation.evaluate_policy` (the
stage's harness: W environments stepped in parallel threads) both ways, alternating which goes first per round so a
machine that slows down does not favour one. Prints seconds per game, prompt tokens encoded per game, the ratio,
and whether each played the same actions as the first in every game (the cached path should: the same token ids
reach the model; the rollouts keep the raw reply tokens in their context, not the parsed action, so they may not;
the rollout's two ways must agree with each other).
Default policy: the warm start in models/policy/sft/model if trained, else the packaged base model.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import load_model, print_machine, table  # noqa: E402
from components import builders  # noqa: E402
from components.config import load_params  # noqa: E402
from components.envs.registry import real_environment  # noqa: E402
from components.llm.backends import ConversationBackend, HFGenerationBackend  # noqa: E402
from components.results.evaluation import evaluate_policy  # noqa: E402
from components.rl.policy import llm_policy  # noqa: E402
from components.rl.rollouts import RealBatch, rollout  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--games", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="each round plays the N games both ways")
    parser.add_argument("--policy", default=None, help="a trained model directory or a model name")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--workers", type=int, default=2, help="environments stepped in parallel (threads)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batched", action=argparse.BooleanOptionalAction, default=True,
                        help="also play the RL rollout's two ways (--no-batched: skip them)")
    args = parser.parse_args()
    print_machine(args.threads)

    params = load_params(args.params)
    trained = Path(params.policy.sft.out_dir) / "model"
    name = args.policy or (str(trained) if trained.is_dir() else params.models.policy)
    model, tokenizer, described = load_model(name, params.models.cache_dir)
    kind = real_environment("textworld-cooking")
    tasks = kind.make_tasks(params.environments, "heldout", args.games, params.seed)  # generated before timing
    fmt, max_tokens = builders.policy_format(params), params.policy.max_action_tokens
    print(f"policy: {described}; {len(tasks)} held-out TextWorld games, at most {params.policy.max_turns} turns, "
          f"{args.workers} environment threads", flush=True)

    backends: dict[str, list] = {"re-encoded every turn": [], "encoded once (KV cache)": []}

    def make(way: str):
        def make_policy(env):
            backend = HFGenerationBackend(model, tokenizer, batch_size=1) if way.startswith("re-encoded") \
                else ConversationBackend(model, tokenizer)
            backends[way].append(backend)
            return llm_policy(backend, fmt, max_tokens)
        return make_policy

    seconds = {way: 0.0 for way in backends}
    actions: dict[str, list] = {way: [] for way in backends}
    for round_ in range(args.rounds):
        for way in (list(backends) if round_ % 2 == 0 else list(reversed(backends))):
            started = time.perf_counter()
            result = evaluate_policy(kind, params.environments, tasks, make(way), workers=args.workers,
                                     confidence=params.evaluate.confidence, name=way,
                                     max_steps=params.policy.max_turns, progress=None)
            seconds[way] += time.perf_counter() - started
            actions[way].append([[s.action for s in t.steps] for t in result.trajectories])
            print(f"round {round_ + 1}, {way}: {time.perf_counter() - started:.1f} s, "
                  f"{result.successes}/{result.episodes} won", flush=True)

    # The RL rollout (`rollouts.rollout` over a RealBatch, greedy here), both ways its `batched` switch offers.
    rollout_ways = {"rollout, batched across games": True, "rollout, one game at a time with its KV cache": False}
    for way, batched in (rollout_ways.items() if args.batched else ()):
        seconds[way], actions[way] = 0.0, []
        for round_ in range(args.rounds):
            started = time.perf_counter()
            batch = RealBatch(lambda task: kind.open(params.environments))
            try:
                episodes = rollout(model, tokenizer, batch, tasks, fmt, max_turns=params.policy.max_turns,
                                   batched=batched, max_action_tokens=max_tokens,
                                   max_tokens=params.synthetic_rl.max_tokens, temperature=0.0)
            finally:
                batch.close()
            seconds[way] += time.perf_counter() - started
            actions[way].append([e.actions for e in episodes])
            print(f"round {round_ + 1}, {way}: {time.perf_counter() - started:.1f} s, "
                  f"{sum(e.success for e in episodes)}/{len(episodes)} won", flush=True)

    games = len(tasks) * args.rounds
    cached = backends["encoded once (KV cache)"]
    encoded = sum(b.encoded_tokens for b in cached)
    prompt = sum(b.prompt_tokens for b in cached)
    baseline = seconds["re-encoded every turn"] / games
    encoded_per_game = {"re-encoded every turn": f"{prompt / games:.0f}", "encoded once (KV cache)":
                        f"{encoded / games:.0f}", **dict.fromkeys(rollout_ways, "n/a")}
    rows = [[way, f"{seconds[way] / games:.2f}", encoded_per_game[way], f"{baseline / (seconds[way] / games):.2f}x",
             str(actions[way] == actions["re-encoded every turn"])] for way in seconds]
    print()
    print(table(["path", "s per game", "prompt tokens encoded per game", "speed vs re-encoding",
                 "same actions as re-encoding"], rows))


if __name__ == "__main__":
    main()
