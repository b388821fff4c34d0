"""Train an agent with TRL's GRPOTrainer against a served DreamGym simulator. Nothing of DreamGym is imported here.

Serve an exported simulator, then point this script at it:

    dreamgym simulator serve bundle --port 8000 &
    SIMULATOR_URL=http://127.0.0.1:8000 python examples/train_with_trl.py --model Qwen/Qwen2.5-0.5B-Instruct

It needs `trl` and OpenEnv's client (`pip install trl openenv-core`), and a model whose chat template TRL can parse
tool calls from (Qwen2.5/Qwen3, Llama 3.1/3.2, ...); `--chat-template FILE` lends one to a model whose own template
has no tools (TRL ships them: trl/chat_templates/qwen2_5.jinja fits any ChatML model). Each rollout is one episode
of the simulator: `reset` starts it (its task and first state join the prompt), the model acts through the `act`
tool, and the episode's reward is the sum of the simulator's rewards.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from datasets import Dataset
from openenv.core import GenericEnvClient
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

PROMPT = "You are an agent in a text environment. Use the `act` tool, one action at a time, until the task is done."


class Simulator:
    """One episode at a time in the served simulator: TRL builds one instance per rollout and reuses it."""

    def __init__(self) -> None:
        self.client = GenericEnvClient(base_url=os.environ["SIMULATOR_URL"]).sync()
        self.client.connect()
        self.reward, self.done = 0.0, False

    def reset(self, **row) -> str:
        observation = self.client.reset(seed=row["seed"]).observation
        self.reward, self.done = 0.0, False
        return f"Task: {observation['instruction']}\n{observation['text']}"

    def act(self, action: str) -> str:
        """Do one thing in the environment and see what happens.

        Args:
            action: What to do, in a few words, for example "open fridge".
        """
        if self.done:
            raise ValueError("The episode is over.")
        result = self.client.step({"message": action})
        self.reward += result.reward or 0.0
        self.done = result.done
        return result.observation["text"]

    def get_reward(self) -> float:
        return self.reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a model id or a local checkpoint")
    parser.add_argument("--chat-template", help="a Jinja chat template file to use instead of the model's")
    parser.add_argument("--output-dir", default="trl-grpo-simulator")
    parser.add_argument("--episodes", type=int, default=64, help="rows of the training set (one seed each)")
    parser.add_argument("--max-steps", type=int, default=50)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=512)
    parser.add_argument("--max-tool-calls", type=int, default=8, help="actions per episode at most")
    args = parser.parse_args()

    rows = [{"prompt": [{"role": "user", "content": PROMPT}], "seed": seed} for seed in range(args.episodes)]
    config = GRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calls, logging_steps=1, save_strategy="no", report_to="none",
        bf16=torch.cuda.is_available(),  # TRL defaults to bf16, which a CPU refuses
    )
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    trainer = GRPOTrainer(model=args.model, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, environment_factory=Simulator)
    trainer.train()
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
