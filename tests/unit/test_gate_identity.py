"""The environment contract and the stack id derived from it: which distributions count, how names from PyPI and
conda meet, the refusal message, and `ucx-dask-gpu guard show|id`."""
from __future__ import annotations

import importlib.metadata
import json
import platform
import subprocess
import sys

from ucx_dask_gpu.gate import identity
from ucx_dask_gpu.stack.lock import load_lock

# The lock's contract distributions under their PyPI names, as `pip install -r lock` installs them.
PIP = {"python": "3.11", "cloudpickle": "3.1.3", "msgpack": "1.2.4", "dask": "2026.7.1", "distributed": "2026.7.1",
       "numpy": "2.4.6", "pandas": "3.1.1", "pyarrow": "26.0.1", "cupy-cuda13x": "14.2.0", "rmm-cu13": "26.8.0",
       "dask-cuda": "26.8.0", "ucxx-cu13": "0.51.1", "distributed-ucxx-cu13": "0.51.1", "ucx-dask-gpu": "0.1.0",
       "libucxx-cu13": "0.51.1", "pytest": "9.0.0"}


def _ident(pkgs: dict[str, str], python: str = "3.11.2") -> dict:
    pkgs = {k: v for k, v in pkgs.items() if k != "python"}
    terms = identity.contract(pkgs, python)
    return {"stack-id": identity.contract_id(terms), "python": python,
            "packages-sha256": identity.packages_digest(pkgs), "packages": identity.encode_packages(pkgs)}


def test_cuda_suffixes_are_not_part_of_the_name():
    assert identity.contract_name("cupy-cuda13x") == identity.contract_name("cupy") == "cupy"
    assert identity.contract_name("rmm_cu13") == "rmm"
    assert identity.contract_name("Distributed-UCXX-cu12") == "distributed-ucxx"
    assert identity.contract_name("dask-cuda") == "dask-cuda"  # a name, not a suffix


def test_a_conda_environment_with_the_lock_versions_has_the_pip_environments_id():
    """conda-forge and our channel name them cupy, rmm, ucxx, distributed-ucxx (no CUDA suffix); the C++ libraries
    come without Python metadata: the contract does not see the difference."""
    pip = {k: v for k, v in PIP.items() if k != "python"}
    conda = {identity.contract_name(k): v for k, v in pip.items() if not k.startswith("libucxx")}
    conda["msgpack"] = pip["msgpack"]  # conda-forge's msgpack-python installs the `msgpack` distribution
    assert identity.contract(conda, "3.11.7") == identity.contract(pip, "3.11.2")
    changed = dict(conda, cloudpickle="3.1.2")
    assert identity.contract_id(identity.contract(changed, "3.11")) != identity.contract_id(identity.contract(pip,
                                                                                                            "3.11"))


def test_only_the_contract_counts():
    base = identity.contract({k: v for k, v in PIP.items() if k != "python"}, "3.11.2")
    assert set(base) == {"python", *identity.CONTRACT} and base["python"] == "3.11"
    others = identity.contract({**PIP, "pytest": "1.0", "matplotlib": "3.0"}, "3.11.9")
    assert identity.contract_id(others) == identity.contract_id(base)
    assert identity.contract_id(identity.contract(PIP, "3.12.0")) != identity.contract_id(base)
    missing = identity.contract({k: v for k, v in PIP.items() if k != "cupy-cuda13x"}, "3.11")
    assert missing["cupy"] is None and identity.contract_id(missing) != identity.contract_id(base)


def test_installed_packages_match_importlib_metadata():
    pkgs = identity.installed_packages()
    for name in ("dask", "distributed", "numpy"):
        assert pkgs[name] == importlib.metadata.version(name)
    assert identity.decode_packages(identity.encode_packages(pkgs)) == pkgs


def test_same_contract_is_accepted_whatever_else_is_installed():
    ours = _ident(PIP)
    theirs = _ident({**PIP, "pytest": "1.0", "jupyterlab": "4.0"}, "3.11.9")
    assert identity.check_peer(ours, "client", "Client-1", theirs, None) is None
    assert [d[0] for d in identity.other_differences(ours, theirs)] == ["jupyterlab", "pytest"]


def test_a_changed_pin_is_refused_naming_it_and_both_ids():
    ours = _ident(PIP)
    theirs = _ident({**PIP, "cloudpickle": "3.1.3.post1", "pytest": "1.0"})
    msg = identity.check_peer(ours, "worker", "tcp://w:1", theirs, None)
    assert ours["stack-id"] in msg and theirs["stack-id"] in msg and "tcp://w:1" in msg
    assert "cloudpickle: 3.1.3 vs 3.1.3.post1" in msg
    assert "pytest" not in msg and "dask:" not in msg and "\n" not in msg


def test_the_peers_own_id_is_not_trusted():
    """A peer that sends another environment under our id is judged by what it sent."""
    ours = _ident(PIP)
    theirs = dict(_ident({**PIP, "numpy": "1.26.4"}), **{"stack-id": ours["stack-id"]})
    assert "numpy: 2.4.6 vs 1.26.4" in identity.check_peer(ours, "client", "c", theirs, None)


def test_python_minor_counts():
    msg = identity.check_peer(_ident(PIP, "3.11.2"), "worker", "w", _ident(PIP, "3.12.1"), None)
    assert "python: 3.11 vs 3.12" in msg


def test_peer_without_guard_is_refused_with_how_to_load_it():
    ours = _ident(PIP)
    versions = {"host": {"python": "3.11.7.final.0"},
                "packages": {"python": "3.11.7.final.0", "dask": "2026.7.1", "numpy": "1.26.4"}}
    msg = identity.check_peer(ours, "client", "Client-1", None, versions)
    assert "did not send its environment" in msg and "import ucx_dask_gpu.gate.guard" in msg
    # Only what the peer could report is compared: pandas is not in its report, so it is not listed.
    assert msg.endswith("differing (scheduler vs client): numpy: 2.4.6 vs 1.26.4")
    worker = identity.check_peer(ours, "worker", "w", None, versions)
    assert f"--preload {identity.GUARD}" in worker


def test_long_differences_are_truncated():
    diff = [(f"p{i:02d}", "1", "2") for i in range(30)]
    assert identity.format_diff(diff).endswith(f"(+{30 - identity.MAX_LISTED} more)")


def test_lock_versions_give_this_venvs_id_when_it_was_installed_from_the_lock(st):
    """`make venv` installs the lock, our UCXX wheels and this package: its stack id is what the lock predicts (the
    image build checks the same inside the image)."""
    pins = {name: pin.version for name, pin in load_lock(st.lock_path()).items()}
    installed = identity.installed_packages()
    ucxx = {n: v for n, v in installed.items() if identity.contract_name(n) in ("ucxx", "distributed-ucxx")}
    predicted = identity.contract({**pins, **ucxx, st.name: st.version}, st.python.version)
    own = identity.own_contract()
    if platform.python_version().rsplit(".", 1)[0] != st.python.version:
        return  # not the lock's Python: nothing to compare
    assert own == predicted, {k: (own[k], predicted[k]) for k in own if own[k] != predicted[k]}


def test_guard_show_and_id_print_the_computed_id():
    show = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "guard", "show", "--json"], capture_output=True,
                          text=True, check=True)
    info = json.loads(show.stdout)
    assert info["stack_id"] == identity.stack_id() == identity.contract_id(info["contract"])
    assert info["packages"] == len(identity.installed_packages())
    out = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "guard", "id"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == info["stack_id"]
    text = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "guard", "show"], capture_output=True, text=True,
                          check=True).stdout
    assert info["stack_id"] in text and "cloudpickle" in text and "distributed-ucxx" in text


def test_preload_names_are_the_modules_dask_loads():
    """The shipped dask config, the refusal message and the entrypoint name the preloads by these strings."""
    from ucx_dask_gpu.gate import daskconfig, guard, quietclose
    from ucx_dask_gpu.ucx import startup

    assert identity.GUARD == guard.__name__
    assert daskconfig.QUIET_CLOSE == quietclose.__name__
    assert daskconfig.STARTUP == startup.__name__
    installed = daskconfig.render("cpu")[daskconfig.COMMON]
    assert installed.count(f"preload: [{identity.GUARD}") == 4  # first on every role


def test_versions_compare_as_pep440_releases():
    assert identity.normal_version("0.51.01") == identity.normal_version("0.51.1") == "0.51.1"
    assert identity.normal_version("2026.07.1") == "2026.7.1"
    assert identity.normal_version("3.1.3.post1") == "3.1.3.post1"
    assert identity.normal_version("1.0+local") == "1.0+local"


def test_our_conda_metapackage_pins_give_the_locks_stack_id(st):
    """`conda install -c ourchannel ucx-dask-gpu`: its run requirements (the recipe's generated pins) install the
    contract at the lock's versions, so that environment has the stack id of the venv and the image; a channel
    that pinned one of them differently would give another id, and the refusal names it."""
    from ucx_dask_gpu.conda.settings import context_key, context_values

    pins = context_values(st, st.name)
    to_pypi = {conda: pypi for pypi, conda in st.conda.names.items() if conda}
    conda_env = {to_pypi.get(name, name): pins[context_key(name)] for name in st.conda.metapackage
                 if context_key(name) in pins}
    conda_env.update({"ucxx": pins["ucxx_version"], "distributed-ucxx": pins["ucxx_version"], st.name: st.version})
    locked = {name: pin.version for name, pin in load_lock(st.lock_path()).items()}
    locked.update({"ucxx-cu13": st.ucxx.source.version, "distributed-ucxx-cu13": st.ucxx.source.version,
                   st.name: st.version})
    conda_terms = identity.contract(conda_env, st.python.version)
    assert None not in conda_terms.values(), conda_terms  # every contract distribution is pinned by the channel
    assert conda_terms == identity.contract(locked, st.python.version)
    ours = _ident({**locked, "python": st.python.version})
    other = _ident({**conda_env, "pandas": "0.0.1"})
    assert "pandas: " in identity.check_peer(ours, "client", "conda-client", other, None)
