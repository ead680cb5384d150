"""Conda recipes (recipes/, v1 recipe.yaml) and the local channel: `ucx-dask-gpu conda regen|render|lint|channel|
test-install`.

The real rattler-build (py-rattler-build) renders every recipe variant (recipes.py) and builds the packages this
machine can build; only the installation of their build/host requirements, which needs conda-forge, is stood in for
(standin.py). py-rattler indexes the channel and installs from it; rattler-build runs the recipes' tests (channel.py).
The values the self-contained recipes take from stack.toml are written into them by `conda regen` (settings.py).
"""
