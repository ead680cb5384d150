"""Conda recipes (recipes/, v1 recipe.yaml): regenerated and packed from stack.toml (settings.py), rendered by the
real rattler-build under conda-forge's stacked variants (variants.py) and checked (recipes.py), and what an upload may
send (publish.py)."""
