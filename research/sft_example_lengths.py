"""Token lengths of the experience model's SFT examples per task, as train_experience_model builds them: which tasks
lose examples to experience_model.training.max_seq_len (those are left out of training, never cut).

    python research/sft_example_lengths.py [--params params.yaml] [--show TASK]

Run in a project whose annotate and index_buffer stages have run. `--show TASK` prints the first over-length example
of a task whose id contains TASK, message by message with each one's tokens.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from components.builders import experience_sft_data
from components.config import load_params
from components.llm.models import resolve_model
from components.llm.sft import token_lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--show", metavar="TASK", help="print the first over-length example of this task")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    root, params = Path("."), load_params(args.params)
    limit = params.experience_model.training.max_seq_len
    annotated, dataset = experience_sft_data(params, root)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(params.models.experience, root / params.models.cache_dir))
    records = {(r.trajectory_id, r.step_index): r for r in annotated}
    by_task = defaultdict(list)
    for row, (prompt, completion) in zip(dataset, token_lengths(dataset, tokenizer), strict=True):
        record = records[(row["trajectory_id"], row["step_index"])]
        by_task[record.task.task_id.rsplit("-", 1)[0]].append((prompt, completion, row))
    print(f"{'task':40s} {'examples':>8s} {'over':>5s} {'median':>6s} {'max':>6s} {'reply max':>9s}   (tokens; "
          f"max_seq_len {limit})")
    for task, rows in sorted(by_task.items()):
        totals = sorted(p + c for p, c, _ in rows)
        print(f"{task:40s} {len(rows):8d} {sum(t > limit for t in totals):5d} {totals[len(totals) // 2]:6d} "
              f"{totals[-1]:6d} {max(c for _, c, _ in rows):9d}")
    print(f"{'all':40s} {sum(map(len, by_task.values())):8d} "
          f"{sum(p + c > limit for rows in by_task.values() for p, c, _ in rows):5d}")
    if args.show:
        example = next((row for task, rows in by_task.items() if args.show in task
                        for p, c, row in rows if p + c > limit), None)
        for message in (example["prompt"] + example["completion"]) if example else []:
            print(f"===== {message['role']} ({len(tokenizer(message['content'])['input_ids'])} tokens)\n"
                  f"{message['content']}")


if __name__ == "__main__":
    main()
