"""Conda recipes (recipes/, v1 recipe.yaml): `ucx-dask-gpu conda regen|pack|variants|render|lint|publishable`.

The real rattler-build (py-rattler-build) renders every recipe variant under conda-forge's global pinning + its CUDA
migrator, stacked as conda-smithy stacks them (variants.py; recipes.py checks the rendering). The values the
self-contained recipes take from stack.toml are written into them by `conda regen`, the patches ucx-src-build carries
are copied in by `conda pack` (settings.py). publish.py decides what an upload may send: never a package built with
stand-ins. Building the packages on a host without channel access is not the product's job: tools/conda_standin.
"""
