"""Files generated from stack.toml must not drift from it: environment.yml and the Python locks (runtime, UCXX
build)."""
import shutil
import subprocess
import sys

from ucx_dask_gpu import stack
from ucx_dask_gpu.stack.generate import check_lock_matches, render_environment_yml
from ucx_dask_gpu.stack.lock import load_lock


def _copy_repo_inputs(tmp_path, edit):
    """stack.toml (edited) + the locks in a scratch tree, so a drift can be provoked without touching the repo."""
    st = stack.load()
    for rel in (st.python.lock, st.ucxx.lock, st.test_tools.lock):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(st.root / rel, tmp_path / rel)
    (tmp_path / "stack.toml").write_text(edit(st.path.read_text()))
    return stack.load(tmp_path / "stack.toml")


def test_committed_environment_yml_is_what_stack_toml_generates():
    st = stack.load()
    assert (st.root / "environment.yml").read_text() == render_environment_yml(st)


def test_environment_yml_and_the_documented_install_line_agree():
    """README and docs/conda.md give the install line RAPIDS-style: our channel, rapidsai, conda-forge, strict, with
    cuda-version; environment.yml has the same channels in the same order and this channel's UCX/UCXX."""
    import yaml

    st = stack.load()
    line = (f"conda install {' '.join(f'-c {c}' for c in st.conda.channels)} --strict-channel-priority {st.name} "
            f"cuda-version={st.cuda_major}.0")
    assert st.conda.channels[1:] == ("rapidsai", "conda-forge")
    for doc in ("README.md", "docs/conda.md"):
        assert line in (st.root / doc).read_text(), doc
    env = yaml.safe_load((st.root / "environment.yml").read_text())
    assert tuple(env["channels"]) == st.conda.channels
    assert f"ucx={st.ucx.version}" in env["dependencies"] and f"cuda-version={st.cuda_major}.0" in env["dependencies"]


def test_committed_lock_satisfies_stack_toml():
    assert check_lock_matches(stack.load()) == []


def test_a_requirement_edit_is_caught_as_drift(tmp_path):
    st = _copy_repo_inputs(tmp_path, lambda s: s.replace('"cupy-cuda13x==14.2.0"', '"cupy-cuda13x==13.6.0"'))
    problems = check_lock_matches(st)
    assert len(problems) == 1 and "cupy-cuda13x" in problems[0] and "14.2.0" in problems[0]


def test_a_ucxx_build_requirement_edit_is_caught_as_drift(tmp_path):
    st = _copy_repo_inputs(tmp_path, lambda s: s.replace('"cmake>=4.0,<5"', '"cmake>=5"'))
    problems = check_lock_matches(st)
    assert len(problems) == 1 and "cmake" in problems[0] and str(st.ucxx.lock) in problems[0]


def test_a_dev_tool_edit_changes_environment_yml(tmp_path):
    st = _copy_repo_inputs(tmp_path, lambda s: s.replace('"cython", ', '"cython", "ninja", '))
    rendered = render_environment_yml(st)
    assert "  - ninja\n" in rendered
    assert rendered != (stack.load().root / "environment.yml").read_text()


def test_env_yml_check_command_fails_on_drift(tmp_path):
    st = _copy_repo_inputs(tmp_path, lambda s: s.replace('"cython", ', '"cython", "ninja", '))
    shutil.copy(stack.load().root / "environment.yml", tmp_path / "environment.yml")
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "stack", "--file", str(st.path), "env-yml", "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "out of date" in proc.stderr


def test_a_test_tool_edit_is_caught_as_drift(tmp_path):
    st = _copy_repo_inputs(tmp_path, lambda s: s.replace('"dask-jobqueue==0.9.0"', '"dask-jobqueue==0.8.5"'))
    problems = check_lock_matches(st)
    assert len(problems) == 1 and "dask-jobqueue" in problems[0] and str(st.test_tools.lock) in problems[0]


def test_the_test_tools_lock_keeps_the_runtime_versions():
    """It installs into the runtime venv: every package both locks pin has the same version in both."""
    st = stack.load()
    runtime, tools = load_lock(st.lock_path()), load_lock(st.root / st.test_tools.lock)
    shared = set(runtime) & set(tools)
    assert {"dask", "distributed"} <= shared
    assert {n: (runtime[n].version, tools[n].version) for n in shared if runtime[n].version != tools[n].version} == {}
