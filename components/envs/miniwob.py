"""MiniWoB++ web tasks (Farama `miniwob` 1.1 gymnasium envs) in headless Debian Chromium, behind the text interface.

Decisions callers rely on:
- Task: `environment="miniwob"`, `parameters={"task": "login-user", "seed": 17}`. The seed fixes the page and the
  utterance, so `make_tasks` resets a browser once per task to copy the utterance into `Task.instruction`
  (~0.1 s a task plus one browser start). Every state starts with the live utterance anyway.
- State (never raw HTML): `Task: <utterance>`, then one line per visible leaf element in document order,
  `[ref] tag#id.class "text" value="..." options=[...] color="..." size=WxH checked focused` (parts where present),
  and `text "..."` for bare text without a ref (MiniWoB renumbers text nodes every step, so they cannot be targets).
  A `<select>` is one line: its chosen option as `value`, every option's text in `options` (MiniWoB's DOM reading
  skips options, which have no size, and the list itself is no leaf, so without this it was not shown at all). A leaf
  with no text but a colour (a coloured block) shows it, `color="#e31b1b (red)"`, and an SVG shape or letter its
  colour and size, `size=20x20`: tasks ask for "shades of red" or "a small N".
  Refs are stable in an episode, numbered by the adapter in order of first appearance (MiniWoB's own numbering
  depends on timing).
- Actions: `click [ref]`, `type [ref] "text"` (focus, select all, type: replaces the field's text), `clear [ref]`,
  `select [ref] "option"` (chooses that option of a list, as a user's pick does: input and change events fire),
  `press "Enter"` / `press [ref] "Enter"` (a MiniWoB allowed key: Enter, Tab, ArrowDown, C-a, ...), `wait`
  (let late widgets such as autocomplete menus appear). `valid_actions` is None: typing is open-ended.
- An invalid or unparsable action returns the current state plus an `Error: ...` line, reward 0,
  `info["valid_action"] = False`, and the episode goes on (the step cap of `run_episode` bounds it, as in WebArena).
- Reward: 1.0 on the step where MiniWoB reports success, else 0.0 (the paper's outcome reward). MiniWoB's own
  undiscounted reward is in `info["raw_reward"]` (its time-discounted one is left out: it depends on wall-clock
  time, and recorded trajectories must be reproducible byte for byte);
  `info["success"]` on the final step.
- MiniWoB ends an episode by itself after a wall-clock limit (10-30 s per task) with failure: slow policies (an LLM on
  CPU) pass `episode_time_limit_s` (the pipeline does: `environments.miniwob.episode_time_limit_s`).
- A step that runs past `step_timeout_s` (a hung page or browser) kills the browser and ends the episode with an
  environment failure (`info["env_failure"]` says why, `info["timeout"] = True`, `truncated`); the next reset starts a
  fresh browser. A browser error ends the episode the same way, unless the browser still answers: then it refused the
  action, a failure that counts (`info["error"]`). A reset that hangs (RESET_TIMEOUT_S) or fails is retried once in a
  fresh browser, then raises `EnvironmentFailure`; a missing Chromium or an unknown task raise as they are.
- One browser per env, started at the first reset (~2.5 s) and reused across resets and tasks. `close()` quits it and
  kills its process group (chromedriver runs in its own session); it also runs from `__exit__`, `__del__` and atexit
  (so Ctrl-C is covered; the `dreamgym` command turns SIGTERM into an exit too). A SIGKILL, or a SIGTERM nobody
  handles, skips all of these and leaves the browser running;
  its command line contains `dreamgym-miniwob-` (the profile directory).
- The three `flight.*` tasks need a local http server and are refused.
"""
from __future__ import annotations

import atexit
import colorsys
import functools
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from miniwob.action import Action, ActionTypes
from miniwob.constants import DEFAULT_ALLOWED_KEYS
from miniwob.environment import MiniWoBEnvironment
from miniwob.fields import FIELD_EXTRACTORS
from miniwob.selenium_instance import DEFAULT_BASE_URL, HTML_DIR, SeleniumInstance
from selenium import webdriver
from selenium.webdriver.chrome.service import Service as ChromeService
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.wait import WebDriverWait

from components.data.contract import HELDOUT_GAME_SEEDS, Task
from components.envs.base import (
    ENV_FAILURE,
    Environment,
    EnvironmentFailure,
    Observation,
    Policy,
    Split,
    StepResult,
)

# The default task mix, each solved by the expert (SOLVERS has a few more); the env runs any non-flight task.
TASKS = ("click-button", "click-link", "enter-text", "enter-password", "login-user", "click-checkboxes",
         "click-tab-2", "use-autocomplete-nodelay", "search-engine", "email-inbox", "book-flight-nodelay")
SEED_RANGES: dict[str, tuple[int, int]] = {"train": (0, HELDOUT_GAME_SEEDS.start),
                                           "heldout": (HELDOUT_GAME_SEEDS.start, HELDOUT_GAME_SEEDS.stop)}
CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage")
DEBIAN_BINARIES = {"MINIWOB_CHROME_BINARY": "/usr/bin/chromium", "MINIWOB_CHROMEDRIVER": "/usr/bin/chromedriver"}
SETTLE_POLL_S = 0.1  # after an action, the page is re-read this often until two reads agree (see _settled)
SETTLE_MAX_S = 1.0
RESET_TIMEOUT_S = 30.0  # page loads are slower than steps; a reset that hangs this long gets a fresh browser
TEXT_INPUTS = ("input_text", "input_password", "input_email", "input_search", "input_number", "input_tel",
               "input_url", "textarea")

T = TypeVar("T")
INTERACTIVE_ELEMENTS_JS = """
const sized = e => { const box = e.getBoundingClientRect(); return box.width > 0 && box.height > 0; };
const visible = e => {  // as MiniWoB reads the page: no box without size on the way down from the body
  const box = e.getBoundingClientRect();
  for (let up = e.parentElement; up && up !== document.body; up = up.parentElement) if (!sized(up)) return false;
  return box.width > 1 && box.height > 1;
};
const jquery = e => (window.jQuery && jQuery._data(e, 'events')) || {};
const controls = 'input:not([type=hidden]), select, textarea, button, a, canvas, [contenteditable=true]';
const pointer = e => getComputedStyle(e).cursor === 'pointer';  // inherited: the outermost one counts
const handled = e => ['click', 'mousedown', 'mouseup'].some(
  kind => typeof e['on' + kind] === 'function' || e['__on' + kind] || kind in jquery(e));  // d3 keeps __on<kind>
const hidden = '#reward-display, #sync-task-cover, #click-canvas, #query';  // as MiniWoB's DOM reading skips them
return Array.from(document.body.querySelectorAll('*'))  // a dialog is added to the body, outside #wrap
  .filter(e => visible(e) && !e.closest(hidden)
               && (e.matches(controls) || handled(e) || pointer(e) && !pointer(e.parentElement)))
  .map(e => [e.tagName.toLowerCase() + (e instanceof HTMLInputElement ? '_' + e.type : ''),
             [e, ...e.querySelectorAll('*')].map(x => x.dataset && x.dataset.wob_ref)
               .filter(ref => ref !== undefined).map(Number)]);
"""  # [tag, the MiniWoB refs of the element and of everything inside it] per visible interactive element


class StepTimeout(Exception):
    pass


class ActionError(ValueError):
    pass


def _binary(variable: str) -> str:
    """The env var if set, else the Debian path: miniwob's own fallback (selenium-manager) needs the network."""
    path = os.environ.get(variable) or DEBIAN_BINARIES[variable]
    if not Path(path).exists():
        raise RuntimeError(f"{path} not found: apt-get install chromium chromium-driver, or set {variable}")
    return path


def _call(fn: Callable[[], T], timeout_s: float) -> T:
    """Run fn in a daemon thread and give up after timeout_s: a wedged browser blocks its HTTP call for minutes,
    and a daemon thread never keeps the interpreter from exiting."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as error:  # handed to the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True, name="miniwob-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StepTimeout(f"no answer from the browser within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _field_extractor(task_name: str) -> Callable[[str], list[tuple[str, str]]]:
    """miniwob's fields of a task's utterance; none for a task it has no extractor for (button-delay), which runs
    all the same: only the expert reads fields."""
    return FIELD_EXTRACTORS.get(task_name, lambda utterance: [])


class _Browser(SeleniumInstance):
    """miniwob's Selenium instance with our Chromium flags, a fresh profile, its own process group, page switching."""

    def __init__(self, task_name: str):
        super().__init__(index=0, subdomain=task_name, headless=True, field_extractor=_field_extractor(task_name))
        self.task_name = task_name
        self.record_screenshots = False  # the text state does not use them, and each costs a PNG round trip
        self.profile_dir = tempfile.mkdtemp(prefix="dreamgym-miniwob-")
        self.service: ChromeService | None = None

    def create_driver(self) -> None:
        options = webdriver.ChromeOptions()
        for flag in (*CHROME_FLAGS, f"--user-data-dir={self.profile_dir}"):
            options.add_argument(flag)
        options.binary_location = _binary("MINIWOB_CHROME_BINARY")
        # A new session puts chromedriver and every Chromium process in one process group that close() can kill.
        self.service = ChromeService(executable_path=_binary("MINIWOB_CHROMEDRIVER"),
                                     popen_kw={"start_new_session": True})
        self.driver = webdriver.Chrome(service=self.service, options=options)
        self.load(self.task_name)
        self.inner_width, self.inner_height = self.driver.execute_script(
            "return [window.innerWidth, window.innerHeight];")

    def load(self, task_name: str) -> None:
        """Open another task's page in the same browser (~0.2 s instead of a 2 s browser start)."""
        self.url = urllib.parse.urljoin(DEFAULT_BASE_URL, f"{task_name}.html")
        self.field_extractor = _field_extractor(task_name)
        self.task_name = task_name
        self.driver.get(self.url)
        WebDriverWait(self.driver, 5).until(expected_conditions.element_to_be_clickable((By.ID, self.SYNC_SCREEN_ID)))

    def close(self, polite: bool = True) -> None:
        """Quit (if polite), then kill the whole process group: quit hangs on a wedged renderer or leaves orphans."""
        if polite and getattr(self, "driver", None) is not None and not self.died:
            try:
                _call(self.driver.quit, 5.0)
            except Exception:
                pass
        self.died = True
        process = self.service.process if self.service is not None else None
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                process.wait(5)  # reap chromedriver so no zombie is left behind
            except (subprocess.TimeoutExpired, ChildProcessError):
                pass
        shutil.rmtree(self.profile_dir, ignore_errors=True)


class _Gym(MiniWoBEnvironment):
    """The miniwob gymnasium env on a `_Browser` made by the caller, who can thus kill it even mid-start."""

    def __init__(self, browser: _Browser):
        self._browser = browser
        super().__init__(subdomain=browser.task_name)

    def _hard_reset_instance(self) -> None:
        self.instance = self._browser
        self.instance.start()


@dataclass(frozen=True)
class Element:
    """One line of the abstract state."""

    ref: int | None  # None for bare text
    tag: str
    text: str = ""
    id: str = ""
    cls: str = ""
    value: str | None = None  # text inputs, and a list's chosen option
    options: tuple[str, ...] = ()  # a list's options
    color: str = ""  # an SVG shape's fill, a textless leaf's background: "#rrggbb (name)"
    size: str = ""  # an SVG shape's or letter's, "WxH" in pixels
    checked: bool = False
    focused: bool = False

    def render(self) -> str:
        if self.ref is None:
            return f"text {_quote(self.text)}"
        parts = [f"[{self.ref}] {self.tag}" + (f"#{self.id}" if self.id else "") + (f".{self.cls}" if self.cls else "")]
        if self.text:
            parts.append(_quote(self.text))
        if self.value is not None:
            parts.append(f"value={_quote(self.value)}")
        if self.options:
            parts.append("options=" + json.dumps(list(self.options), ensure_ascii=False))
        if self.color:
            parts.append(f"color={_quote(self.color)}")
        if self.size:
            parts.append(f"size={self.size}")
        parts += [flag for flag, on in (("checked", self.checked), ("focused", self.focused)) if on]
        return " ".join(parts)


_QUOTED = r'"(?:[^"\\]|\\.)*"'
_LINE = re.compile(rf'^\[(?P<ref>\d+)\] (?P<tag>[\w-]+)(?:#(?P<id>[^\s.#"]+))?(?:\.(?P<cls>[^\s.#"]+))?'
                   rf'(?: (?P<text>{_QUOTED}))?(?: value=(?P<value>{_QUOTED}))?(?: options=(?P<options>\[.*?\]))?'
                   rf'(?: color=(?P<color>{_QUOTED}))?(?: size=(?P<size>\d+x\d+))?'
                   r"(?P<checked> checked)?(?P<focused> focused)?$")
_TEXT_LINE = re.compile(rf"^text (?P<text>{_QUOTED})$")
_NAME = re.compile(r'^[^\s.#"]+$')
_GENERATED_ID = re.compile(r"^ui-id-\d+$")  # jQuery UI numbers its widgets per page load: noise, not meaning


def _quote(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _elements_from_dom(dom_elements: Sequence[dict[str, Any]], details: dict[str, Any] | None = None) -> list[Element]:
    """The state's elements; `details`: what MiniWoB's reading leaves out, by ref (see _with_details)."""
    lists, fills = (details or {}).get("lists", {}), (details or {}).get("fills", {})
    parents = {int(raw["ref"]): int(raw["parent"]) for raw in dom_elements}
    child_tags: dict[int, set[str]] = defaultdict(set)  # of the children MiniWoB read: it leaves out those without size
    for raw in dom_elements:
        child_tags[int(raw["parent"])].add(raw["tag"])
    labelled = set()  # elements with text inside them
    for raw in dom_elements:
        ref = int(raw["ref"])
        while raw["text"].strip() and ref in parents and ref not in labelled:
            labelled.add(ref)
            ref = parents[ref]
    elements = []
    for raw in dom_elements:
        focused, _, _, is_leaf = (bool(flag) for flag in raw["flags"])
        tag, text = raw["tag"], " ".join(raw["text"].split())
        # a coloured box whose content has no size (a card face down) is one line, and so is an icon (a button, a
        # link or a box holding only a drawing): its name tells the agent what it does
        children = child_tags.get(int(raw["ref"]), set())
        is_leaf = is_leaf or not children and raw["bg_color"][3] > 0 or int(raw["ref"]) not in labelled and (
            tag in ("button", "a") or children == {"svg"})
        if float(raw["width"][0]) <= 1 or float(raw["height"][0]) <= 1:
            continue  # 1-pixel nodes are screen-reader helpers
        if tag == "select" and raw["ref"] in lists:
            options, chosen = lists[raw["ref"]]
            elements.append(Element(int(raw["ref"]), tag, "", *_names(raw),
                                    options[chosen] if 0 <= chosen < len(options) else "", tuple(options),
                                    focused=focused))
            continue
        if not is_leaf or tag == "body":
            continue  # containers repeat their leaves' text
        if raw["ref"] < 0:
            if text:
                elements.append(Element(None, "t", text))
            continue
        element_id, cls = _names(raw)
        is_text_input = tag in TEXT_INPUTS
        color, size = "", ""
        if raw["ref"] in fills:  # an SVG shape or letter
            color, size = _color(fills[raw["ref"]]), f"{raw['width'][0]:.0f}x{raw['height'][0]:.0f}"
        elif not (text or is_text_input or tag.startswith("input") or tag in ("button", "select")) \
                and raw["bg_color"][3] > 0:  # a coloured block
            color = _color(raw["bg_color"])
        if not (text or element_id or cls or color or is_text_input or tag.startswith("input") or tag == "button"):
            continue  # an empty, nameless, colourless leaf tells the agent nothing
        elements.append(Element(int(raw["ref"]), tag, text, element_id, cls,
                                raw["value"] if is_text_input else None, color=color, size=size,
                                checked=tag in ("input_checkbox", "input_radio") and raw["value"] == "True",
                                focused=focused))
    return elements


COLOR_NAMES = ((15, "red"), (45, "orange"), (70, "yellow"), (165, "green"), (200, "cyan"), (255, "blue"),
               (290, "purple"), (345, "magenta"), (360, "red"))  # upper bounds of hue in degrees


def _color(rgba: Sequence[float]) -> str:
    """`#rrggbb (name)`: the hex the page drew, and a name by hue (grey by lightness when nearly unsaturated)."""
    red, green, blue = (float(channel) for channel in rgba[:3])
    hue, lightness, saturation = colorsys.rgb_to_hls(red, green, blue)
    if saturation < 0.15 or lightness < 0.08 or lightness > 0.95:
        name = "black" if lightness < 0.2 else "white" if lightness > 0.9 else "grey"
    else:
        name = next(name for bound, name in COLOR_NAMES if hue * 360 < bound)
    return "#" + "".join(f"{round(channel * 255):02x}" for channel in (red, green, blue)) + f" ({name})"


def _names(raw: dict[str, Any]) -> tuple[str, str]:
    """An element's id and first class, where they are names a line can carry."""
    element_id = raw["id"] if _NAME.match(raw["id"] or "") and not _GENERATED_ID.match(raw["id"]) else ""
    cls = next((c for c in raw["classes"].split() if _NAME.match(c) and c != "SVG_CLASS"), "")
    return element_id, cls


def render_state(utterance: str, elements: Sequence[Element]) -> str:
    return "\n".join([f"Task: {utterance}", *(element.render() for element in elements)])


def parse_state(state: str) -> tuple[str, list[Element]]:
    """The utterance and elements of a rendered state (policies read states this way, as an LLM would)."""
    lines = state.splitlines()
    utterance = lines[0].removeprefix("Task: ") if lines else ""
    elements = []
    for line in lines[1:]:
        if match := _LINE.match(line):
            elements.append(Element(int(match["ref"]), match["tag"], json.loads(match["text"] or '""'),
                                    match["id"] or "", match["cls"] or "",
                                    json.loads(match["value"]) if match["value"] else None,
                                    tuple(json.loads(match["options"])) if match["options"] else (),
                                    json.loads(match["color"]) if match["color"] else "", match["size"] or "",
                                    bool(match["checked"]), bool(match["focused"])))
        elif match := _TEXT_LINE.match(line):
            elements.append(Element(None, "t", json.loads(match["text"])))
    return utterance, elements


@dataclass(frozen=True)
class Command:
    verb: str  # click, type, clear, select, press, wait
    ref: int | None = None
    text: str = ""


_COMMAND = re.compile(r'^(?P<verb>click|type|clear|select|press|wait)(?:\s*\[(?P<ref>-?\d+)\])?(?:\s+(?P<arg>".*"))?$',
                      re.IGNORECASE | re.DOTALL)
_KEYS = {key.lower(): key for key in DEFAULT_ALLOWED_KEYS} | {
    key[1:-1].lower(): key for key in DEFAULT_ALLOWED_KEYS if key.startswith("<") and len(key) > 2}


def parse_action(action: str, elements: Sequence[Element]) -> Command:
    """A Command for an action text, or ActionError saying what is wrong with it."""
    match = _COMMAND.match(action.strip())
    if not match:
        raise ActionError('unknown action; use click [ref], type [ref] "text", clear [ref], select [ref] "option", '
                          'press [ref] "Key", press "Key" or wait')
    verb, ref, arg = match["verb"].lower(), match["ref"], match["arg"]
    needs_ref, needs_arg = verb in ("click", "type", "clear", "select"), verb in ("type", "select", "press")
    if needs_ref and ref is None or verb == "wait" and ref is not None:
        raise ActionError(f"{verb} takes {'an element [ref]' if needs_ref else 'no [ref]'}")
    if needs_arg != (arg is not None):
        raise ActionError(f'{verb} {"needs" if needs_arg else "takes no"} quoted text')
    text = ""
    if arg is not None:
        try:
            text = json.loads(arg)
        except json.JSONDecodeError:
            text = arg[1:-1]  # unescaped inner quotes: take the text as written
    target = None
    if ref is not None:
        target = next((e for e in elements if e.ref == int(ref)), None)
        if target is None:
            raise ActionError(f"no element [{ref}] on the page")
        if verb in ("type", "clear") and target.tag not in TEXT_INPUTS:
            raise ActionError(f"[{ref}] is a {target.tag}, not a text field")
        if verb == "select" and target.tag != "select":
            raise ActionError(f"[{ref}] is a {target.tag}, not a list; select chooses an option of a select")
        if verb == "select" and text not in target.options:
            raise ActionError(f"[{ref}] has no option {text!r}; its options: {', '.join(map(repr, target.options))}")
    if verb == "press":
        if text.lower() not in _KEYS:
            raise ActionError(f"unknown key {text!r}; use e.g. Enter, Tab, Backspace, ArrowDown, C-a")
        text = _KEYS[text.lower()]
    return Command(verb, target.ref if target else None, text)


def _close_at_exit(ref: weakref.ref[MiniWoB]) -> None:
    env = ref()
    if env is not None:
        env.close()


class MiniWoB(Environment):
    name = "miniwob"

    def __init__(self, *, step_timeout_s: float = 10.0, episode_time_limit_s: float | None = None,
                 wait_s: float = 0.5):
        """step_timeout_s: a step (or reset) taking longer fails and restarts the browser; episode_time_limit_s:
        replaces MiniWoB's wall-clock episode limit (10-30 s); wait_s: how long the `wait` action sleeps."""
        self.step_timeout_s = step_timeout_s
        self.episode_time_limit_s = episode_time_limit_s
        self.wait_s = wait_s
        self._gym: _Gym | None = None
        self._utterance = ""
        self._elements: list[Element] = []
        self._shown_refs: dict[int, int] = {}  # MiniWoB's ref -> the ref the agent sees, this episode (_shown)
        self._state = ""
        self._done = True
        self._at_exit = functools.partial(_close_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)

    # -- Environment ------------------------------------------------------------------------------------------------

    def reset(self, task: Task) -> Observation:
        name, seed = _task_key(task)
        for variable in DEBIAN_BINARIES:  # a missing browser is a setup error, not an environment failure
            _binary(variable)
        for attempt in range(2):  # a crashed or hung browser gets one fresh restart
            try:
                gym = self._browser(name)
                observation = _call(lambda: self._start_episode(gym, seed), RESET_TIMEOUT_S)
                break
            except Exception as error:
                self._drop_browser(polite=False)
                if attempt:
                    raise EnvironmentFailure(f"the browser failed at reset: {_describe(error)}") from error
        self._done = False
        self._shown_refs = {}
        self._observe(observation)
        return Observation(self._state)

    def step(self, action: str) -> StepResult:
        if self._gym is None and not self._state:
            raise RuntimeError("call reset() before step()")
        if self._done:
            return self._failed_step("the episode is over; call reset()", done=True)
        try:
            command = parse_action(action, self._elements)
        except ActionError as error:
            return self._failed_step(str(error), done=False)
        try:
            observation, metadata = _call(lambda: self._execute(command), self.step_timeout_s)
        except StepTimeout as error:
            self._drop_browser(polite=False)
            return self._end(False, {"timeout": True, "truncated": True, ENV_FAILURE: f"step timed out: {error}"})
        except Exception as error:  # the browser crashed or refused the action: the episode cannot go on
            why, working = f"browser error: {_describe(error)}", self._answers()
            self._drop_browser(polite=False)
            if working:  # it refused this action (e.g. text WebDriver cannot type): a failure that counts
                return self._end(False, {"error": why})
            return self._end(False, {"truncated": True, ENV_FAILURE: why})
        if metadata["done"]:
            raw = float(metadata["raw_reward"])
            return self._end(raw > 0, {"raw_reward": raw})
        self._observe(observation)
        return StepResult(Observation(self._state), 0.0, False, {"valid_action": True})

    def interactive_coverage(self) -> tuple[int, list[str]]:
        """Of the current page's visible interactive elements (form controls, links, canvases, elements with a click
        handler set as a property, by jQuery or by d3, and elements under a pointer cursor), how many the state shows
        (the element or one inside it has a line), and the tags of those it does not."""
        if self._gym is None or self._done:
            raise RuntimeError("call reset() first: coverage is of a live page")
        driver = self._gym.instance.driver
        found = _call(lambda: driver.execute_script(INTERACTIVE_ELEMENTS_JS), self.step_timeout_s)
        shown_refs = {element.ref for element in self._elements}
        on_page = {page for page, shown in self._shown_refs.items() if shown in shown_refs}
        missing = [tag for tag, refs in found if not on_page.intersection(refs)]
        return len(found) - len(missing), missing

    def close(self) -> None:
        self._drop_browser()
        if getattr(self, "_at_exit", None) is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass  # interpreter shutdown: modules may already be gone; atexit has closed it then

    # -- internals --------------------------------------------------------------------------------------------------

    def _start_episode(self, gym: _Gym, seed: int) -> dict[str, Any]:
        if self.episode_time_limit_s is not None:  # read by the page when the episode starts
            gym.instance.driver.execute_script(f"core.EPISODE_MAX_TIME = {int(self.episode_time_limit_s * 1000)};")
        observation, info = self._settled(gym, gym.reset(seed=seed)[0], {"done": False})
        if info["done"]:  # the page's clock ran out while it loaded: reset() retries in a fresh browser
            raise RuntimeError("the episode ended while its page was loading")
        return observation

    def _browser(self, name: str) -> _Gym:
        if self._gym is not None and self._gym.instance.died:
            self._drop_browser()
        if self._gym is None:
            browser = _Browser(name)
            try:
                self._gym = _Gym(browser)
            except BaseException:  # Ctrl-C or a failed start: chromedriver runs in its own session, kill it
                browser.close()
                raise
        elif self._gym.instance.task_name != name:
            instance = self._gym.instance
            _call(lambda: instance.load(name), RESET_TIMEOUT_S)
        return self._gym

    def _answers(self) -> bool:
        """Whether the browser still runs a script: after an error, it tells a refused action from a crash."""
        gym = self._gym
        try:
            return gym is not None and _call(lambda: gym.instance.driver.execute_script("return 1;"), 5.0) == 1
        except Exception:
            return False

    def _drop_browser(self, polite: bool = True) -> None:
        gym, self._gym = getattr(self, "_gym", None), None
        if gym is not None and getattr(gym, "instance", None) is not None:
            gym.instance.close(polite)

    def _execute(self, command: Command) -> tuple[dict[str, Any], dict[str, Any]]:
        """Run a command as miniwob actions; all but the last skip the observation (a DOM read is ~20 ms)."""
        gym = self._gym
        assert gym is not None

        def key(name: str) -> Action:
            return gym.create_action(ActionTypes.PRESS_KEY, key=gym.action_space_config.allowed_keys.index(name))

        page_ref = next((page for page, shown in self._shown_refs.items() if shown == command.ref), None)
        actions: list[Action]
        if command.verb == "click":
            actions = [gym.create_action(ActionTypes.CLICK_ELEMENT, ref=page_ref)]
        elif command.verb in ("type", "clear"):
            typing = (gym.create_action(ActionTypes.TYPE_TEXT, text=command.text) if command.text
                      else key("<Backspace>"))
            actions = [gym.create_action(ActionTypes.CLICK_ELEMENT, ref=page_ref), key("C-a"), typing]
        elif command.verb == "select":
            # No MiniWoB action chooses an option, and WebDriver's Select clicks an <option> that has no size here
            gym.instance.driver.execute_script(
                "const list = core.previousDOMInfo[arguments[0]];"
                "list.selectedIndex = Array.from(list.options).findIndex(o => o.text.trim() === arguments[1]);"
                "list.focus();"
                "for (const kind of ['input', 'change']) list.dispatchEvent(new Event(kind, {bubbles: true}));",
                page_ref, command.text)
            actions = [gym.create_action(ActionTypes.NONE)]
        elif command.verb == "press":
            if page_ref is not None:
                gym.instance.driver.execute_script(f"core.previousDOMInfo[{page_ref}].focus();")
            actions = [key(command.text)]
        else:  # wait
            time.sleep(self.wait_s)
            actions = [gym.create_action(ActionTypes.NONE)]
        for action in actions[:-1]:
            gym.instance.perform(action, gym.action_space_config)
        observation, _, _, _, info = gym.step(actions[-1])
        return self._settled(gym, observation, info)

    def _settled(self, gym: _Gym, observation: dict[str, Any],
                 info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The page once its scripts stop changing it: an inbox fills in and an autocomplete menu is drawn just after
        the reset or action returns, so a state read at once depended on timing (two collections of the same seed
        differed in 8 of 66 episodes, and an expert once met a half-drawn inbox). Re-read every SETTLE_POLL_S until
        two reads agree, at most SETTLE_MAX_S (a page with a live clock never settles)."""
        instance = gym.instance
        deadline = time.monotonic() + SETTLE_MAX_S
        observation = observation if info["done"] else _with_details(instance, observation)
        rendered = "" if info["done"] else self._render(observation)
        while not info["done"] and time.monotonic() < deadline:
            time.sleep(SETTLE_POLL_S)
            info = {**info, **instance.get_metadata()}
            if info["done"]:  # the page ended the episode by itself (a submit fired by the menu)
                return instance.get_empty_observation(), info
            again = _with_details(instance, instance.get_observation(use_cached_fields=True)[0])
            rendered, previous = self._render(again), rendered
            if rendered == previous:
                break
            observation = again
        return observation, info

    def _render(self, observation: dict[str, Any]) -> str:
        utterance = observation["utterance"] or self._utterance
        return render_state(utterance, _elements_from_dom(observation["dom_elements"], observation.get("details")))

    def _observe(self, observation: dict[str, Any]) -> None:
        self._utterance = observation["utterance"] or self._utterance
        self._elements = [self._shown(element)
                          for element in _elements_from_dom(observation["dom_elements"], observation.get("details"))]
        self._state = render_state(self._utterance, self._elements)

    def _shown(self, element: Element) -> Element:
        """`element` under the ref the agent sees: refs are numbered in order of first appearance in the episode.

        MiniWoB's own refs count every node the page ever created, and a widget redrawn on each keystroke (an
        autocomplete menu) uses up a timing-dependent number of them, so the same episode showed `[14]` in one run
        and `[11]` in the next."""
        if element.ref is None:
            return element
        return replace(element, ref=self._shown_refs.setdefault(element.ref, len(self._shown_refs) + 1))

    def _failed_step(self, error: str, *, done: bool) -> StepResult:
        state = self._state + f"\nError: {error}"
        return StepResult(Observation(state), 0.0, done, {"valid_action": False, "error": error})

    def _end(self, success: bool, info: dict[str, Any]) -> StepResult:
        self._done = True
        self._elements = []
        self._state = f"Task: {self._utterance}\nEpisode over: {'success' if success else 'failure'}."
        if error := info.get(ENV_FAILURE) or info.get("error"):
            self._state += f"\nError: {error}"
        info = {"valid_action": True, "success": success, "truncated": False, **info}
        return StepResult(Observation(self._state), 1.0 if success else 0.0, True, info)


SVG_SHAPES = ("circle", "ellipse", "rect", "polygon", "path", "line", "polyline", "text")  # "text": SVG letters


def _with_details(instance: _Browser, observation: dict[str, Any]) -> dict[str, Any]:
    """The observation with what MiniWoB's DOM reading leaves out (one script call, only on pages that need it):
    each `<select>`'s options and chosen index, and each SVG shape's or letter's fill, by ref."""
    lists = [int(raw["ref"]) for raw in observation["dom_elements"] if raw["tag"] == "select"]
    shapes = [int(raw["ref"]) for raw in observation["dom_elements"] if raw["tag"] in SVG_SHAPES and raw["ref"] > 0]
    if not lists and not shapes:
        return observation
    options, fills = instance.driver.execute_script(
        "const at = ref => core.previousDOMInfo[ref];"
        "return [arguments[0].map(ref => [Array.from(at(ref).options).map(o => o.text.trim()), at(ref).selectedIndex]),"
        "        arguments[1].map(ref => getComputedStyle(at(ref)).fill)];", lists, shapes)
    channels = [[int(n) / 255 for n in re.findall(r"\d+", fill)[:3]] + [1.0] for fill in fills]
    return {**observation, "details": {
        "lists": {ref: (names, chosen) for ref, (names, chosen) in zip(lists, options)},
        "fills": {ref: rgba for ref, rgba in zip(shapes, channels) if len(rgba) == 4}}}  # "none": no paint


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error)[:200]}"


def _task_key(task: Task) -> tuple[str, int]:
    if task.environment != MiniWoB.name:
        raise ValueError(f"task {task.task_id} is for {task.environment!r}, not {MiniWoB.name!r}")
    name = str(task.parameters["task"])
    if name.startswith("flight.") or not (HTML_DIR / "miniwob" / f"{name}.html").exists():
        raise ValueError(f"unknown or unsupported MiniWoB task {name!r} (flight.* tasks need an http server)")
    return name, int(task.parameters["seed"])


# -- tasks ---------------------------------------------------------------------------------------------------------

def make_tasks(split: Split, count: int, *, seed: int, task_names: Sequence[str] | None = None,
               env: MiniWoB | None = None) -> list[Task]:
    """`count` tasks cycling over `task_names` (default TASKS), episode seeds drawn without repeats from the split's
    own range (train and held-out never share a page). Deterministic in its arguments. Reads each utterance with a
    reset, in `env` if given, else in a browser of its own."""
    names = tuple(task_names or TASKS)
    low, high = SEED_RANGES[split]
    episode_seeds = random.Random(f"miniwob/{split}/{seed}").sample(range(low, high), count)
    keys = [(names[index % len(names)], episode_seed) for index, episode_seed in enumerate(episode_seeds)]
    runner = env or MiniWoB()
    try:
        utterances = {}
        for name, episode_seed in sorted(keys):  # grouped by task: one page load per task
            state = runner.reset(_task(name, episode_seed, "")).state
            utterances[name, episode_seed] = parse_state(state)[0]
    finally:
        if env is None:
            runner.close()
    return [_task(name, episode_seed, utterances[name, episode_seed]) for name, episode_seed in keys]


def _task(name: str, episode_seed: int, instruction: str) -> Task:
    return Task(f"miniwob-{name}-s{episode_seed}", MiniWoB.name, instruction, {"task": name, "seed": episode_seed})


# -- policies ------------------------------------------------------------------------------------------------------
# Policies read only the task name, the rendered state and the history, as an LLM agent would; the expert also uses
# miniwob's field extractor on the utterance (the `obs["fields"]` of the gym env).

History = Sequence[tuple[str, str]]
Solver = Callable[[dict[str, str], list[Element], History], str]


def expert_policy() -> Policy:
    """Scripted solvers for the tasks of SOLVERS (raises KeyError for other tasks)."""

    def act(task: Task, observation: Observation, history: History) -> str:
        name = str(task.parameters["task"])
        utterance, elements = parse_state(observation.state)
        fields = dict(_field_extractor(name)(utterance))
        return SOLVERS[name](fields, elements, history)

    return act


def random_policy(rng: random.Random) -> Policy:
    """Click a random element, type a random word into a random text field, or choose a random option of a list."""

    def act(task: Task, observation: Observation, history: History) -> str:
        targets = [e for e in parse_state(observation.state)[1] if e.ref is not None]
        if not targets:
            return "wait"
        element = rng.choice(targets)
        if element.options:
            return f"select [{element.ref}] {_quote(rng.choice(element.options))}"
        if element.tag in TEXT_INPUTS and rng.random() < 0.5:
            word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8)))
            return f"type [{element.ref}] {_quote(word)}"
        return f"click [{element.ref}]"

    return act


def _find(elements: Sequence[Element], *, tag: str | None = None, id: str | None = None, cls: str | None = None,
          text: str | None = None) -> list[Element]:
    return [e for e in elements if e.ref is not None and (tag is None or e.tag == tag) and (id is None or e.id == id)
            and (cls is None or e.cls == cls) and (text is None or e.text == text)]


def _click(element: Element) -> str:
    return f"click [{element.ref}]"


def _type(element: Element, text: str) -> str:
    return f"type [{element.ref}] {_quote(text)}"


def _clicked_texts(history: History) -> list[str]:
    """Texts of the elements clicked so far, oldest first (a solver's memory of tabs and pages visited)."""
    texts = []
    for state, action in history:
        if match := re.fullmatch(r"click \[(\d+)\]", action.strip()):
            texts += [e.text for e in parse_state(state)[1] if e.ref == int(match[1])]
    return texts


def _fill_then_click(pairs: Sequence[tuple[Element, str]], button: Element) -> str:
    for field, text in pairs:
        if field.value != text:
            return _type(field, text)
    return _click(button)


def _click_button(fields: dict[str, str], elements: list[Element], history: History) -> str:
    return _click(_find(elements, tag="button", text=fields["target"])[0])


def _click_link(fields: dict[str, str], elements: list[Element], history: History) -> str:
    return _click(_find(elements, cls="alink", text=fields["target"])[0])


def _choose_list(fields: dict[str, str], elements: list[Element], history: History) -> str:
    options, wanted = _find(elements, tag="select")[0], fields["target"]
    if options.value != wanted:
        return f"select [{options.ref}] {_quote(wanted)}"
    return _click(_find(elements, tag="button")[0])


def _enter_text(fields: dict[str, str], elements: list[Element], history: History) -> str:
    return _fill_then_click([(_find(elements, tag="input_text")[0], fields["target"])],
                            _find(elements, tag="button")[0])


def _enter_password(fields: dict[str, str], elements: list[Element], history: History) -> str:
    return _fill_then_click([(box, fields["target"]) for box in _find(elements, tag="input_password")],
                            _find(elements, tag="button")[0])


def _login_user(fields: dict[str, str], elements: list[Element], history: History) -> str:
    return _fill_then_click([(_find(elements, id="username")[0], fields["username"]),
                             (_find(elements, id="password")[0], fields["password"])],
                            _find(elements, tag="button")[0])


def _click_checkboxes(fields: dict[str, str], elements: list[Element], history: History) -> str:
    wanted = {value for key, value in fields.items() if key.startswith("target")}
    for index, box in enumerate(elements):
        if box.tag == "input_checkbox":
            label = next((e.text for e in elements[index + 1:] if e.ref is None), "")  # the text after the box
            if box.checked != (label in wanted):
                return _click(box)
    return _click(_find(elements, tag="button")[0])


def _click_tab_2(fields: dict[str, str], elements: list[Element], history: History) -> str:
    if links := _find(elements, cls="alink", text=fields["target"]):
        return _click(links[0])
    tabs = _find(elements, cls="ui-tabs-anchor")
    seen = set(_clicked_texts(history)) | ({tabs[0].text} if tabs else set())  # the first tab shows at the start
    unseen = [tab for tab in tabs if tab.text not in seen]
    return _click((unseen or tabs)[0])


def _use_autocomplete(fields: dict[str, str], elements: list[Element], history: History) -> str:
    start, end = fields["start"], fields.get("end", "")
    box = _find(elements, id="tags")[0]
    value = box.value or ""
    if value.startswith(start) and value.endswith(end):
        return _click(_find(elements, tag="button")[0])
    for item in _find(elements, cls="ui-menu-item-wrapper"):
        if item.text.startswith(start) and item.text.endswith(end):
            return _click(item)
    return "wait" if value == start else _type(box, start)  # the menu can lag behind the typing


def _search_engine(fields: dict[str, str], elements: list[Element], history: History) -> str:
    box, rank = _find(elements, id="search-text")[0], int(fields["rank"])
    results = _find(elements, cls="search-title")
    if box.value != fields["query"]:
        return _type(box, fields["query"])
    if not results:
        return _click(_find(elements, id="search")[0])
    pages = [text for text in _clicked_texts(history) if text.isdigit()]
    page, wanted = int(pages[-1]) if pages else 1, (rank - 1) // 3 + 1  # three results a page; search shows page 1
    if page != wanted:
        return _click(_find(elements, cls="page-link", text=str(wanted))[0])
    return _click(results[(rank - 1) % 3])


def _email_inbox(fields: dict[str, str], elements: list[Element], history: History) -> str:
    task, sender = fields["task"], fields["by"]
    if task in ("delete", "star"):
        icon = "trash" if task == "delete" else "star"
        index = elements.index(_find(elements, cls="email-sender", text=sender)[0])
        return _click(_find(elements[index:], cls=icon)[0])  # the icons follow their email's sender line
    answer, send, text = (("reply-text", "send-reply", fields["message"]) if task == "reply"
                          else ("forward-sender", "send-forward", fields["to"]))
    if boxes := _find(elements, id=answer) or _find(elements, cls=answer):
        return _fill_then_click([(boxes[0], text)], _find(elements, id=send)[0])
    if buttons := _find(elements, text=task.capitalize()):
        return _click(buttons[0])
    return _click(_find(elements, cls="email-sender", text=sender)[0])


_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")


def _book_flight(fields: dict[str, str], elements: list[Element], history: History) -> str:
    if prices := _find(elements, cls="flight-price"):  # results: "3h 5m" then "Book flight for $123" per flight
        durations = [_minutes(e.text) for e in _find(elements, cls="time-duration")]
        costs = [int(e.text.rsplit("$", 1)[1]) for e in prices]
        score = costs if fields["criterion"] == "cheapest" else durations
        return _click(prices[score.index(min(score))])
    for box_id, place in (("flight-from", fields["from"]), ("flight-to", fields["to"])):
        box = _find(elements, id=box_id)[0]
        if place in (box.value or "") and (box.value or "").endswith(")"):
            continue  # a full airport name, as the autocomplete menu writes it
        items = [e for e in _find(elements, cls="ui-menu-item-wrapper") if place in e.text]
        if items and box.focused:
            return _click(items[0])
        return "wait" if box.focused and box.value == place else _type(box, place)
    date = _find(elements, id="datepicker")[0]
    if date.value != fields["date"]:
        month, day, year = (int(part) for part in fields["date"].split("/"))
        shown = _find(elements, cls="ui-datepicker-month")
        if not shown:
            return _click(date)
        shown_year = int(_find(elements, cls="ui-datepicker-year")[0].text)
        offset = (year * 12 + month) - (shown_year * 12 + _MONTHS.index(shown[0].text) + 1)
        if offset:
            return _click(_find(elements, text="Next" if offset > 0 else "Prev")[0])
        return _click(_find(elements, cls="ui-state-default", text=str(day))[0])
    return _click(_find(elements, id="search")[0])


def _minutes(text: str) -> int:
    hours, minutes = re.findall(r"\d+", text)[:2]
    return int(hours) * 60 + int(minutes)


SOLVERS: dict[str, Solver] = {
    "click-button": _click_button, "click-link": _click_link, "enter-text": _enter_text,
    "enter-password": _enter_password, "login-user": _login_user, "click-checkboxes": _click_checkboxes,
    "click-tab-2": _click_tab_2, "use-autocomplete-nodelay": _use_autocomplete, "search-engine": _search_engine,
    "email-inbox": _email_inbox, "book-flight-nodelay": _book_flight, "choose-list": _choose_list,
}
