"""One exception type for problems a user can fix, and the exit codes the CLI maps them to.

Every command ends bad input with ONE line on stderr and a non-zero exit; the codes are distinct so scripts and
operators can tell failures apart without parsing text.
"""
from __future__ import annotations

# Exit codes (documented in README "Exit codes"). 1 is reserved for "ran, but the verdict is negative".
VERDICT_FAILED = 1
USAGE = 2
BAD_STACK = 3
SOURCE_UNREACHABLE = 4
HASH_MISMATCH = 5
BUILD_FAILED = 6
NO_DOCKER = 7
ENV_MISMATCH = 8
OUTPUT_REFUSED = 9        # a file or directory named to write to cannot be written (a directory where a file is
                          # asked for, a missing or read-only parent, a non-empty directory that is not ours): refused
                          # before any work starts, nothing touched
NO_GPU = 10
ONE_GPU = 11
NO_NVLINK = 12
PERFTEST_MISSING = 13
PERFTEST_FAILED = 14
NVML_UNAVAILABLE = 15
MISSING_CAPABILITY = 16   # a required UCX capability (--require ib,cuda) cannot be built here
UCX_NOT_FOUND = 17        # no UCX prefix / ucx_info where one was named or expected
RESULT_KEPT = 18          # the work finished but its output could not be written where asked; the result is kept
                          # (beside it, in the temp directory, or on stdout) and the one line says where
APT_LOCKED = 19           # ci/install_prereqs.sh: another apt/dpkg process held its lock past the wait
SCHEDULER_UNREACHABLE = 20  # workload: nothing answered at --scheduler (refused, unknown host, unreachable)
DATA_INVALID = 21         # workload from-map: the data directory has no usable files
WORKLOAD_FAILED = 23      # workload: the computation raised on the cluster (e.g. no GPU on a cupy worker)
NOT_A_SCHEDULER = 24      # workload: what answered at --scheduler is not a Dask scheduler, or said nothing in --timeout
NO_WORKERS = 25           # workload: fewer than --min-workers workers joined within --wait-workers
TLS_REFUSED = 26          # workload: TLS handshake failed (no client certificate, or not one the cluster's CA signed)
# Reproducible image + SBOM (30-39)
NOT_REPRODUCIBLE = 30    # two clean builds gave different image digests
BAD_ARCHIVE = 31         # an image/rootfs archive is malformed, or docker save/load disagreed with us
SBOM_INVALID = 32        # the SBOM fails the CycloneDX schema
SBOM_MISMATCH = 33       # the SBOM disagrees with the lock, the build info or the image's dpkg status
SBOM_GENERATOR = 34      # the installed SBOM generator is not the version stack.toml [sbom] pins
# Image + cluster (40-49)
UNKNOWN_ROLE = 40        # the image was started with a command that is not one of its roles
CLUSTER_FAILED = 41      # a cluster container exited or a role did not come up in time
TRANSPORT_CONFLICT = 42  # UCX transport settings contradict each other (UCX_TLS next to distributed-ucxx flags, ...)
ROOTFS_INVALID = 43      # an exported image root filesystem: a part missing or its sha256 wrong, or unusable here
# Topology + topology cluster (50-59)
BAD_TOPOLOGY = 50        # nvidia-smi topo -m text that cannot be read
SYSFS_UNREADABLE = 51    # sysfs (PCI devices, NICs) missing or unreadable
TOPOLOGY_CLUSTER_FAILED = 52  # the topology-aware local cluster did not start, or stopped on its own
# Conda recipes + channel (60-69)
RECIPE_INVALID = 60      # a conda recipe does not render, fails lint, or disagrees with stack.toml
PACKAGE_INVALID = 61     # a built conda package fails its checks (relocation, linkage, contents)
INSTALL_FAILED = 62      # solving/installing from the channel, or the recipe's tests in that prefix, failed
# Benchmarks: bench transpose | svd | transfer (70-79)
BENCH_CONFIG = 70        # a --variant (its config file or a KEY=VALUE) unreadable or invalid
BENCH_DEPENDENCY = 71    # a package the requested mode needs (dask-cuda, cupy, distributed-ucxx) is missing
BENCH_FAILED = 72        # a variant failed: its cluster did not start, workload error, wrong result, timeout
REFERENCE_FAILED = 73    # dask-cuda's local_cupy failed or printed output we cannot parse


class UserError(Exception):
    """A failure with a one-line explanation and a specific exit code."""

    def __init__(self, message: str, exit_code: int = USAGE):
        # Keep it to one line: callers print str(err) as-is.
        super().__init__(" ".join(str(message).split()))
        self.exit_code = exit_code
