"""What a result records about where it was measured: git commit and dirty flag (or the commit given where there is
no checkout), package versions, and the libucp a process has mapped."""
import subprocess

from ucx_dask_gpu.bench import cluster, provenance
from ucx_dask_gpu.ucx.transports import mapped_libucp


def git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_git_commit_and_dirty_flag(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("a")
    git(tmp_path, "add", "f")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert provenance.git_state(tmp_path) == {"commit": head, "dirty": False, "source": "git"}
    (tmp_path / "f").write_text("b")
    assert provenance.git_state(tmp_path)["dirty"] is True
    (tmp_path / "untracked").write_text("x")  # untracked files do not make a tree dirty
    git(tmp_path, "checkout", "-q", "f")
    assert provenance.git_state(tmp_path)["dirty"] is False


def test_commit_given_where_there_is_no_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    s = provenance.git_state(tmp_path)
    assert s["commit"] is None and s["git"]
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    s = provenance.git_state(tmp_path)
    assert (s["commit"], s["dirty"], s["source"]) == ("abc123", None, f"${provenance.COMMIT_ENV}")


def test_a_given_commit_wins_over_a_stale_checkout(tmp_path, monkeypatch):
    # A copied tree can carry an old .git: what the operator says it is wins, git's view is kept beside it.
    git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("a")
    git(tmp_path, "add", "f")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    s = provenance.git_state(tmp_path)
    assert s["commit"] == "abc123" and s["git"]["source"] == "git" and s["git"]["commit"] != "abc123"


def test_versions_name_the_stack():
    v = provenance.versions()
    assert {"dask", "distributed", "numpy", "python"} <= set(v)
    assert any(k.startswith("distributed-ucxx") for k in v) and any(k.startswith("ucxx") for k in v)


def test_collect_without_gpus():
    p = provenance.collect("cmd --x", None)
    assert p["command"] == "cmd --x" and p["cpu_count"] >= 1 and "gpus" not in p


def test_process_facts_name_the_mapped_libucp():
    import ucxx  # noqa: F401  loads libucp into this process

    facts = cluster.process_facts(["PATH", "distributed.comm.compression"])
    assert facts["libucp"] == mapped_libucp() and facts["libucp"].split("/")[-1].startswith("libucp.so")
    assert facts["PATH"] and "distributed.comm.compression" in facts
