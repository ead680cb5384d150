"""The recipes' view of stack.toml: the [conda] settings (validated by the stack model) and the variant config
rendered from them."""
from __future__ import annotations

from ..stack import CondaSpec, Stack
from ..stack.generate import CBC_PATH, render_conda_build_config

__all__ = ["CBC_PATH", "render_conda_build_config", "settings"]


def settings(st: Stack) -> CondaSpec:
    return st.conda
