import shutil
from pathlib import Path

import pytest
import yaml

from components.config import ParamsError, load_params, parse_params

REPO_PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


def raw():
    return yaml.safe_load(REPO_PARAMS.read_text())


def test_repository_params_load():
    params = load_params(REPO_PARAMS)
    assert params.data.max_text_length == 65536
    assert params.data.reward_range == [-1.0, 1.0]
    assert params.storage.backend in ("local", "s3")


def test_unknown_key_named_with_suggestion():
    tree = raw()
    tree["data"]["max_text_lenght"] = 10
    with pytest.raises(ParamsError, match=r"unknown key 'data.max_text_lenght' \(did you mean 'max_text_length'\?\)"):
        parse_params(tree)


def test_unknown_section_lists_allowed_keys():
    tree = raw()
    tree["dat"] = {}
    with pytest.raises(ParamsError, match=r"unknown key 'dat' \(did you mean 'data'\?\)"):
        parse_params(tree)


def test_mistyped_value_names_key_and_type():
    tree = raw()
    tree["data"]["max_text_length"] = "65536"
    with pytest.raises(ParamsError, match=r"'data.max_text_length' expects int, got str '65536'"):
        parse_params(tree)


def test_literal_choice_is_listed():
    tree = raw()
    tree["storage"]["backend"] = "gcs"
    with pytest.raises(ParamsError, match=r"'storage.backend' expects one of 'local', 's3'"):
        parse_params(tree)


def test_missing_key_and_bad_range():
    tree = raw()
    del tree["models"]["policy"]
    tree["data"]["reward_range"] = [1.0, -1.0]
    with pytest.raises(ParamsError) as error:
        parse_params(tree)
    assert "missing key 'models.policy' (expected str)" in str(error.value)
    assert "data.reward_range" in str(error.value) and "low < high" in str(error.value)


def test_overrides_and_file_errors(tmp_path):
    assert load_params(REPO_PARAMS, {"data.max_text_length": 7}).data.max_text_length == 7
    with pytest.raises(ParamsError, match="file not found"):
        load_params(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("data: [unclosed")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(tmp_path / "bad.yaml")


def test_cli_set_overrides(tmp_path):
    from dreamgym.cli import main

    assert main(["--params", str(REPO_PARAMS), "--set", "data.max_text_length=10", "params", "check"]) == 0
    assert main(["--params", str(REPO_PARAMS), "--set", "data.max_text_length=ten", "params", "check"]) == 2
    assert main(["--params", str(REPO_PARAMS), "--set", "novalue", "params", "check"]) == 2
    assert main(["--params", str(REPO_PARAMS), "--set", "seed=1", "flow", "validate"]) == 2  # flows read params.yaml


def test_profiles_switch_params_and_keep_comments(tmp_path, monkeypatch):
    import shutil

    from components.config import use_profile

    repo = Path(__file__).resolve().parents[1]
    shutil.copy(repo / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(repo / "profiles", tmp_path / "profiles")
    monkeypatch.chdir(tmp_path)
    original = load_params("params.yaml")
    comments = [line for line in (tmp_path / "params.yaml").read_text().splitlines() if "#" in line]

    changed = use_profile("gpu")
    gpu = load_params("params.yaml")
    assert changed and gpu.synthetic_rl.iterations == 50 and gpu.experience_model.training.lora.top_layers is None
    assert [line for line in (tmp_path / "params.yaml").read_text().splitlines() if "#" in line] != []
    assert use_profile("gpu") == {}  # already there

    use_profile("quick")  # the quick profile is params.yaml's defaults: back to where we started
    assert load_params("params.yaml") == original
    for profile in sorted(set(Path("profiles").glob("*.yaml")) - {Path("profiles/quick.yaml")}):  # every other
        assert use_profile(profile.stem) and load_params("params.yaml") != original
        use_profile("quick")
        assert load_params("params.yaml") == original, f"profiles/quick.yaml misses keys of {profile.name}"
    kept = [line.split("#", 1)[1] for line in (tmp_path / "params.yaml").read_text().splitlines() if "#" in line]
    assert kept == [line.split("#", 1)[1] for line in comments]
    assert not [line for line in (tmp_path / "params.yaml").read_text().splitlines() if line != line.rstrip()]

    with pytest.raises(ParamsError, match="no file"):
        use_profile("tpu")
    (tmp_path / "bad.yaml").write_text("synthetic_rl.iterations: -1\n")
    before = (tmp_path / "params.yaml").read_text()
    with pytest.raises(ParamsError, match="synthetic_rl.iterations"):
        use_profile(tmp_path / "bad.yaml")
    assert (tmp_path / "params.yaml").read_text() == before  # a bad profile writes nothing


def test_errors_inside_an_optional_section_name_its_own_keys():
    tree = raw()
    assert tree["experience_model"]["training"]["lora"] is not None  # the section is `LoraParams | None`
    tree["experience_model"]["training"]["lora"]["rr"] = 8
    with pytest.raises(ParamsError, match=r"unknown key 'experience_model.training.lora.rr' \(did you mean 'r'\?\)"):
        parse_params(tree)
    tree = raw()
    tree["experience_model"]["training"]["lora"]["alpha"] = "32"
    with pytest.raises(ParamsError, match=r"'experience_model.training.lora.alpha' expects int, got str '32'"):
        parse_params(tree)


def test_a_curriculum_that_could_never_play_a_generated_task_is_refused():
    tree = raw()
    tree["synthetic_rl"]["tasks_per_iteration"] = 1  # floor(0.5 x 1) = 0 generated tasks an iteration
    with pytest.raises(ParamsError, match=r"'synthetic_rl': the curriculum can never play a generated task.*"
                                          r"raise tasks_per_iteration to 2 or more, or set curriculum.enabled"):
        parse_params(tree)
    tree["synthetic_rl"]["curriculum"]["enabled"] = False  # the ablation: nothing to play, nothing refused
    assert parse_params(tree).synthetic_rl.tasks_per_iteration == 1


def test_cli_refuses_a_checkout_whose_code_python_does_not_import(tmp_path, monkeypatch, capsys):
    """A clone that shares another checkout's virtual environment would run that checkout's code while DVC hashes
    its own files: the command stops and says how to run this checkout's code. Identical code (the tests' project
    copies) and a project directory without `components/` run as usual."""
    from dreamgym.cli import main

    repo = Path(__file__).resolve().parent.parent
    clone = tmp_path / "clone"
    for package in ("components", "stages", "flows"):
        shutil.copytree(repo / package, clone / package)
    monkeypatch.chdir(clone)
    assert main(["--params", str(REPO_PARAMS), "params", "check"]) == 0  # the same code

    stage = clone / "stages" / "validate.py"
    stage.write_text(stage.read_text() + "\n# changed in this clone\n")
    assert main(["--params", str(REPO_PARAMS), "params", "check"]) == 2
    assert "code differs from the code Python imports (stages/validate.py)" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # no components/ here: the installed package is the code
    assert main(["--params", str(REPO_PARAMS), "params", "check"]) == 0


def test_runtime_settings_mirror_their_params_sections_and_have_no_defaults():
    """The settings the builders make from params have a section's keys as fields and no default of their own, so a
    knob's value lives in params.yaml only (a field params does not set is named here, with where it comes from)."""
    import dataclasses
    import inspect

    from components import config
    from components.llm.sft import LoraSettings, TrainingSettings
    from components.rl.curriculum import CurriculumSettings
    from components.rl.loop import PPOSettings, RLSettings
    from components.rl.policy import PolicyFormat
    from components.simulator.experience_model import InferenceSettings, PromptFormat, predict
    from components.simulator.replay_buffer import IndexSettings
    from components.simulator.synthetic import SyntheticEnvironment

    mirrors = [  # settings class, its params section, fields the builders set from elsewhere in params
        (PromptFormat, config.PromptParams, set()),
        (PolicyFormat, config.PolicyPromptParams, set()),
        (LoraSettings, config.LoraParams, set()),
        (TrainingSettings, config.TrainingParams, {"seed"}),
        (CurriculumSettings, config.CurriculumParams, set()),
        (PPOSettings, config.PPOParams, set()),
        # policy.*, seed, and sim_to_real.real_transitions (the builder's None for synthetic RL)
        (RLSettings, config.SyntheticRLParams, {"max_turns", "max_action_tokens", "batched_rollouts", "seed",
                                                "transition_budget"}),
        (IndexSettings, config.BufferIndexParams, set()),
    ]
    for settings, section, elsewhere in mirrors:
        fields = dataclasses.fields(settings)
        with_default = [f.name for f in fields
                        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not with_default, f"{settings.__name__} has defaults of its own: {with_default}"
        not_settings = {RLSettings: {"out_dir", "curriculum"},  # the writer's: builders.curriculum_writer reads them
                        CurriculumSettings: {"writer_pairs_per_task", "writer_training"}}.get(settings, set())
        keys = set(section.model_fields) - not_settings
        assert {f.name for f in fields} == keys | elsewhere, settings.__name__

    # the experience model's inference knobs: one settings object, which predict and the synthetic environment take
    inference = {f.name for f in dataclasses.fields(InferenceSettings)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert inference == {f.name for f in dataclasses.fields(InferenceSettings)}, "InferenceSettings has defaults"
    assert inference - {"reward_range"} <= set(config.InferenceParams.model_fields)  # reward_range: data.*
    for function in (predict, SyntheticEnvironment.__init__):
        assert inspect.signature(function).parameters["settings"].default is inspect.Parameter.empty
