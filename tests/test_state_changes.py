"""components/simulator/state_changes.py: sections, the changed-sections form, and its exact inverse."""
from __future__ import annotations

import pytest

from components.simulator.state_changes import apply_changes, changes, from_first_change, sections

RECIPE = "Recipe:\nIngredients:\nred potato\n\nDirections:\nslice the red potato\nprepare meal"
BEFORE = f"{RECIPE}\nObservation:\nYou take the knife.\nInventory: You are carrying: a knife."
AFTER = (f"{RECIPE}\nObservation:\nYou slice the red potato.\n\nYour score has just gone up.\n"
         "Inventory: You are carrying: a knife and a sliced red potato.")
PAGE = 'Task: Log in.\n[1] input_text#user value=""\n[2] button "Submit"'


def test_sections_split_at_headers_and_a_repeated_label_stays_in_its_section():
    assert [label for label, _ in sections(BEFORE)] == ["Recipe:", "Ingredients:", "Directions:", "Observation:",
                                                         "Inventory:"]
    assert [label for label, _ in sections("a preamble\n" + PAGE)] == ["", "Task:", "[1]", "[2]"]
    assert sections("Ingredients:\nx\nObservation:\nIngredients:\ny") == [
        ("Ingredients:", "Ingredients:\nx"), ("Observation:", "Observation:\nIngredients:\ny")]


def test_a_textworld_step_is_its_observation_and_inventory():
    step = changes(BEFORE, AFTER)
    assert step == AFTER[AFTER.index("Observation:"):]  # the recipe, unchanged, is left out
    assert apply_changes(BEFORE, step) == AFTER


@pytest.mark.parametrize("after", [
    PAGE.replace('value=""', 'value="ann" focused'),  # a section changes in place
    PAGE + '\n[3] div "Welcome"',  # a new section at the end
    PAGE.replace('\n[2] button "Submit"', ""),  # a section goes away
    PAGE,  # nothing changes
])
def test_changes_rebuild_the_next_state_byte_for_byte(after):
    step = changes(PAGE, after)
    assert step is not None and apply_changes(PAGE, step) == after
    if after == PAGE:
        assert step == ""


def test_the_sections_a_step_removes_go_on_one_line():
    """A tab switch on a web page removes a dozen elements: one line names them all (a line each cost a third of
    MiniWoB's examples their place under max_seq_len); the older line-a-label form still applies."""
    tab_1 = PAGE + '\n[3] span "alpha"\n[4] span "beta"\n[5] span "gamma"'
    tab_2 = PAGE + '\n[6] span "delta"'
    step = changes(tab_1, tab_2)
    assert step == '<removed>[3] [4] [5]</removed>\n[6] span "delta"'
    assert apply_changes(tab_1, step) == tab_2
    assert apply_changes(tab_1, "<removed>[3]</removed>\n<removed>[4]</removed>\n<removed>[5]</removed>\n"
                                '[6] span "delta"') == tab_2
    assert apply_changes("a preamble\n" + PAGE, "<removed></removed>") == PAGE  # the unlabelled first section


def test_no_changed_form_when_it_cannot_rebuild_the_next_state():
    assert changes(PAGE, 'Task: Log in.\n[3] div "New"\n[1] input_text#user value=""\n[2] button "Submit"') is None
    assert changes(BEFORE, AFTER.replace("Observation:\n", "Observation:\nIngredients:\n")) is None  # repeated label


def test_the_step_after_reading_the_cookbook_has_a_changed_form():
    """The state after `examine cookbook` repeats the recipe's labels in its observation; the next step still
    replies with its observation and inventory only (the model writes that form, and it must apply)."""
    cookbook = BEFORE.replace("You take the knife.", "You open the cookbook:\n\n" + RECIPE.replace("Recipe:\n", ""))
    step = changes(cookbook, AFTER)
    assert step == AFTER[AFTER.index("Observation:"):]
    assert apply_changes(cookbook, step) == AFTER


def test_context_states_start_at_their_first_changed_section():
    assert from_first_change(BEFORE, AFTER) == BEFORE[BEFORE.index("Observation:"):]
    assert from_first_change(BEFORE, BEFORE) == BEFORE  # nothing differs: the whole state
    cookbook = AFTER.replace("Observation:\n", "Observation:\nRecipe #1\nIngredients:\nred potato\n")
    assert from_first_change(BEFORE, cookbook) == BEFORE[BEFORE.index("Observation:"):]  # repeated labels are fine
