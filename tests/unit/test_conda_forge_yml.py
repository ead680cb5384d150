"""conda-forge.yml validates against conda-smithy's own schema (an unchanged copy in ../shared/conda-smithy/): a key
conda-smithy does not know, or a value it does not accept, fails here before a feedstock's rerender would."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO.parent / "shared" / "conda-smithy" / "conda-forge.json"
# The schema's `bot` property refers to the conda-forge bot's schema online; offline it stands for "anything" (the
# copy's README says so).
BOT_SCHEMA = ("https://raw.githubusercontent.com/conda-forge/conda-forge-bot/refs/heads/main/conda_forge_tick/"
              "cf_tick_schema.json")


def _errors(config: dict) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012

    if not SCHEMA.is_file():
        pytest.skip(f"no copy of conda-smithy's schema at {SCHEMA}")
    schema = json.loads(SCHEMA.read_text())
    registry = Registry().with_resource(BOT_SCHEMA, DRAFT202012.create_resource({}))
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return sorted(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(config))


def test_conda_forge_yml_is_valid_for_conda_smithy():
    assert _errors(yaml.safe_load((REPO / "conda-forge.yml").read_text())) == []


@pytest.mark.parametrize("key, value", [("conda_build_tool", "rattlerbuild"), ("os_versions", {"linux_64": "alma8"}),
                                        ("os_version", {"linux_64": "alma7"})])
def test_what_conda_smithy_refuses_is_caught(key, value):
    config = yaml.safe_load((REPO / "conda-forge.yml").read_text())
    config[key] = value
    assert _errors(config), f"{key}: {value!r} passed"
