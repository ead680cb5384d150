"""Conda recipes (recipes/, v1 recipe.yaml) and the local channel: `ucx-dask-gpu conda regen|pack|variants|render|
lint|channel|test-install`.

The real rattler-build (py-rattler-build) renders every recipe variant under conda-forge's global pinning + its CUDA
migrator, stacked as conda-smithy stacks them (variants.py; recipes.py checks the rendering), and builds every output
on a host without channel access; only what needs conda-forge or rapidsai is stood in for (standin.py: build/host requirements; placeholders.py:
their packages when solving). py-rattler indexes the channel and installs from it; rattler-build runs the recipes'
tests (channel.py). The values the self-contained recipes take from stack.toml are written into them by `conda regen`,
the patches ucx-src-build carries are copied in by `conda pack` (settings.py).
"""
