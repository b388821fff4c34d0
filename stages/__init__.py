"""The pipeline's stages as recipes, one module per DVC stage (`stages/<name>.py`, its `run(params, root)`).

`dreamgym stage NAME` imports `stages.NAME` alone and runs it, so a stage's dvc.yaml deps are its own file and the
modules it imports (tests/test_dvc_stages.py checks them); this package imports nothing, or every stage would
depend on every stage file.
"""
