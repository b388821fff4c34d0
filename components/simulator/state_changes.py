"""A state as labelled sections, and a step as the sections it changed: the experience model's short reply form.

A text state is read as sections, each starting at a header line: a capitalised word and a colon at the start of
the line (TextWorld's `Recipe:`, `Observation:`, `Inventory: ...`; MiniWoB's `Task: ...`) or an element reference
(`[7] button "Submit"`). Lines before the first header form an unlabelled first section. A header whose label came
earlier belongs to the section it is in: a cookbook read aloud in the observation repeats the recipe's
`Ingredients:`, and the state after it must still have a section form (without one, every reply in the changed form
there is unusable, and the model replies in that form: 41-44 of 94 refusal probes fell back on such states).

`changes(state, next_state)` is the next state as the sections that differ from the state's, in the next state's
order, after one `<removed>LABEL LABEL ...</removed>` line naming the sections that went away (one line, not one a
label: a web page's tab switch removes a dozen elements, and a line each cost a third of MiniWoB's examples their
place under max_seq_len); `apply_changes` rebuilds the next state
from the state and those changes. `changes` returns None whenever `apply_changes` would not rebuild the next state
byte for byte (a new section anywhere but at the end, a repeated label starting a section in the changes): then the
full next state is the only form.

Why: a TextWorld step changes the observation and sometimes the inventory, while the recipe stays; replying with the
changed sections halves what the model writes, and showing retrieved examples and history the same way stops the
prompt repeating every other game's recipe (reports/research/experience_model/speed/).
"""
from __future__ import annotations

import re

_HEADER = re.compile(r"\[-?\d+\]|[A-Z][A-Za-z]{0,30}:")
_REMOVED = re.compile(r"<removed>(.*)</removed>")


def sections(text: str) -> list[tuple[str, str]]:
    """[(label, the section's text with its header line)], in order, each label once (a repeated one continues the
    section it is in)."""
    parts: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for line in text.split("\n"):
        header = _HEADER.match(line)
        label = header.group(0) if header else None
        if not parts or (label is not None and label not in seen):
            parts.append((label or "", [line]))
            seen.add(label or "")
        else:
            parts[-1][1].append(line)
    return [(label, "\n".join(lines)) for label, lines in parts]


def apply_changes(state: str, changes: str) -> str:
    """The next state that `changes` (the form `changes()` writes) makes of `state`."""
    before = sections(state)
    lines = changes.split("\n") if changes else []
    removed = {label for line in lines if (m := _REMOVED.fullmatch(line)) for label in m.group(1).split() or [""]}
    kept = [line for line in lines if not _REMOVED.fullmatch(line)]
    changed = sections("\n".join(kept)) if kept else []
    replacement = dict(changed)
    rebuilt = [replacement.pop(label, text) for label, text in before if label not in removed]
    rebuilt += [text for label, text in changed if label in replacement]  # new sections go last
    return "\n".join(rebuilt)


def changes(state: str, next_state: str) -> str | None:
    """The changed sections of `next_state` (see the module docstring); None when they cannot rebuild it exactly."""
    before, after = sections(state), sections(next_state)
    old, new = dict(before), dict(after)
    gone = " ".join(label for label, _ in before if label not in new)
    text = "\n".join([f"<removed>{gone}</removed>"] * bool(gone)
                      + [section for label, section in after if old.get(label) != section])
    return text if apply_changes(state, text) == next_state else None


def from_first_change(state: str, other: str) -> str:
    """`state` from its first section that `other` does not hold as it is: the part of a context state (a history
    step, a retrieved example) that tells it apart. The whole state when nothing differs."""
    mine, theirs = sections(state), set(sections(other))
    for index, section in enumerate(mine):
        if section not in theirs:
            return "\n".join(text for _, text in mine[index:])
    return state
