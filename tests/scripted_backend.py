"""A test double for the experience *model* only: its reply is a fixed function of the prompt's action.

Replies are well-formed targets, so the environment, `predict`, the prompt builder and the replay buffer around it
are tested for real and deterministically. It records every prompt it receives.
"""
import re

from components.simulator.experience_model import format_target


class ScriptedBackend:
    """Replies `after <action>`; the action "eat meal" ends the episode with reward 1, "give up" with 0 (with
    `one_turn`, every action ends it)."""

    def __init__(self, garbage: bool = False, one_turn: bool = False) -> None:
        self.calls: list[list] = []
        self.garbage, self.one_turn = garbage, one_turn

    def generate(self, prompts, max_new_tokens, temperature=0.0):
        self.calls.append(list(prompts))
        replies = []
        for prompt in prompts:
            action = re.findall(r"^Action: (.*)$", prompt[-1]["content"], re.M)[-1]
            done = self.one_turn or action in ("eat meal", "give up")
            replies.append("no tags at all" if self.garbage else
                           format_target(f"after {action}", float(action == "eat meal"), done, f"did {action}"))
        return replies


class ScriptedTaskWriter:
    """A test double for the curriculum's task writer (the experience model's backbone): for each prompt, a
    well-formed harder variation of the prompt's task, numbered so that no two replies are duplicates."""

    def __init__(self) -> None:
        self.calls: list[list] = []

    def generate(self, prompts, max_new_tokens, temperature=0.0):
        self.calls.append(list(prompts))
        replies = []
        for prompt in prompts:
            task = re.findall(r"^Task: (.*)$", prompt[-1]["content"], re.M)[0]
            replies.append(f"<instruction>{task} Harder, variant {len(self.calls)}.{len(replies)}.</instruction>")
        return replies
