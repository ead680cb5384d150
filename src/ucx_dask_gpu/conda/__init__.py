"""Conda recipes (recipes/) and the local channel: `ucx-dask-gpu conda render|lint|channel|test-install`.

No conda channel is reachable from the build machines, so `conda build` cannot run here. This package does what
conda-build does, step by step, with real components: renders the recipes (Jinja2 + selectors + conda-build's
context functions), lints them and checks them against stack.toml, runs each recipe's build script under
conda-build's environment contract, packs real `.conda` archives (conda-package-handling), indexes a channel
(py-rattler) and installs from it into a fresh prefix (py-rattler solve + install), then runs the recipe's tests there.
"""
