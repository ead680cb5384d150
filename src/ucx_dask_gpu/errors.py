"""One exception type for problems a user can fix, and the exit codes the CLI maps them to.

Every command ends bad input with ONE line on stderr and a non-zero exit; the codes are distinct so scripts and
operators can tell failures apart without parsing text.
"""
from __future__ import annotations

# Exit codes. docs/exit-codes.md is generated from this table (`python -m tools.docmap --write`; a unit test
# keeps them equal): each code's comment is its meaning there, and a `# ... (N-M)` line starts a group.
# General (1-9)
VERDICT_FAILED = 1        # ran, but the verdict is negative: an NVLink pair failed or is invalid, a workload's or the
                          # demo's answer is wrong, a UCX prefix fails `verify`, a generated file is out of date
USAGE = 2                 # bad arguments or a malformed address: one line from the command's parser
BAD_STACK = 3             # stack.toml unreadable, not UTF-8, not TOML, or refused by its model
SOURCE_UNREACHABLE = 4    # a pinned source archive is neither upstream, nor in a source mirror, nor in the cache (the
                          # line names each missing archive and where to put it)
HASH_MISMATCH = 5         # a source archive or a wheel has other content than its pin, or has no pin (not in the
                          # lock)
BUILD_FAILED = 6          # a build step failed (UCX, the UCXX wheels, the image, a conda package)
NO_DOCKER = 7             # no Docker engine answers, and none could be started
ENV_MISMATCH = 8          # refused by the scheduler's guard: this environment's stack id differs from the scheduler's
OUTPUT_REFUSED = 9        # a file or directory named to write to cannot be written (a directory where a file is
                          # asked for, a missing or read-only parent, a file there this tool did not write: the first
                          # one named): refused before any work starts, nothing touched; or the disk filled while
                          # writing what is not worth keeping (certificates, generated data): nothing of it left
# GPU and UCX prerequisites (10-19)
NO_GPU = 10               # no GPU visible (a GPU worker, verify-nvlink, a GPU benchmark)
ONE_GPU = 11              # one GPU where two are needed
NO_NVLINK = 12            # no GPU pair is connected by NVLink
PERFTEST_MISSING = 13     # ucx_perftest not found for a named UCX
PERFTEST_FAILED = 14      # ucx_perftest ran but failed or printed nothing readable
NVML_UNAVAILABLE = 15     # NVML (libnvidia-ml) cannot be loaded or answered with an error
MISSING_CAPABILITY = 16   # a required UCX capability (--require ib,cuda) cannot be built on this host
UCX_NOT_FOUND = 17        # no UCX prefix / ucx_info where one was named or expected
RESULT_KEPT = 18          # the work finished but its output could not be written where asked; the result is kept
                          # (beside it, in the temp directory, or on stdout) and the one line says where
APT_LOCKED = 19           # ci/install_prereqs.sh: another apt/dpkg process held its lock past the wait
# Client workloads and a worker's start (20-29)
SCHEDULER_UNREACHABLE = 20  # workload or a worker's start: nothing answered at the scheduler address (refused,
                            # unknown host, unreachable)
DATA_INVALID = 21         # workload from-map: the data directory has no usable files
TLS_INIT_FAILED = 22      # tls init: no openssl command, or openssl failed making a key or a certificate
WORKLOAD_FAILED = 23      # workload: the computation raised on the cluster (e.g. no GPU on a cupy worker)
NOT_A_SCHEDULER = 24      # workload or a worker's start: what answered at the scheduler address is not a Dask
                          # scheduler, or said nothing in time
NO_WORKERS = 25           # workload: fewer than --min-workers workers joined within --wait-workers
TLS_REFUSED = 26          # workload or a worker's start: the TLS handshake failed (no client certificate, one the
                          # cluster's CA did not sign, or a scheduler certificate this client does not trust)
ALL_WORKERS_LOST = 27     # workload: every worker left mid-run and none joined again within --timeout
SCHEDULER_LOST = 28       # workload: the connection to the scheduler closed mid-run (scheduler stopped or unreachable)
BINDING_NOT_LOADABLE = 29  # workload: the UCX binding (ucxx and its libucxx/libucp), or another library Client()
                           # imports, cannot be loaded in this process
# Reproducible image + SBOM (30-39)
NOT_REPRODUCIBLE = 30    # two builds (two clones at different paths) gave different prefixes, wheels or image ids
BAD_ARCHIVE = 31         # an image/rootfs archive is malformed, or docker save/load disagreed with us
SBOM_INVALID = 32        # the SBOM fails the CycloneDX schema
SBOM_MISMATCH = 33       # the SBOM disagrees with the lock, the build info or the image's dpkg status
SBOM_GENERATOR = 34      # the installed SBOM generator is not the version stack.toml [sbom] pins
# Image + cluster (40-49)
NO_SUCH_COMMAND = 40     # the image was started with a command it does not have (not on PATH, not executable) or with
                         # none; any command it has runs, as in docker-library images
CLUSTER_FAILED = 41      # a cluster container exited or a role did not come up in time
TRANSPORT_CONFLICT = 42  # UCX transport settings contradict each other (UCX_TLS next to distributed-ucxx flags, ...)
ROOTFS_INVALID = 43      # an exported image root filesystem: a part missing or its sha256 wrong, or unusable on this
                         # host
# Topology + topology cluster (50-59)
BAD_TOPOLOGY = 50        # nvidia-smi topo -m text that cannot be read
SYSFS_UNREADABLE = 51    # sysfs (PCI devices, NICs) missing or unreadable
TOPOLOGY_CLUSTER_FAILED = 52  # the topology-aware local cluster did not start, or stopped on its own
# Conda recipes + channel (60-69)
RECIPE_INVALID = 60      # a conda recipe does not render, fails lint, or disagrees with stack.toml
PACKAGE_INVALID = 61     # a built conda package fails its checks (relocation, linkage, contents)
INSTALL_FAILED = 62      # solving/installing from the channel, or the recipe's tests in that prefix, failed
STANDIN_REFUSED = 63     # a package built with stand-ins (about.json extra.standin, a `_standin` build string) where a
                         # publish reads: nothing is uploaded
# Benchmarks: bench transpose | svd | transfer (70-79)
BENCH_CONFIG = 70        # a --variant (its config file or a KEY=VALUE) unreadable or invalid
BENCH_DEPENDENCY = 71    # a package the requested mode needs (dask-cuda, cupy, distributed-ucxx) is missing
BENCH_FAILED = 72        # a variant failed: its cluster did not start, workload error, wrong result, timeout (the
                         # report is still written)
REFERENCE_FAILED = 73    # dask-cuda's local_cupy failed or printed output we cannot parse


class UserError(Exception):
    """A failure with a one-line explanation and a specific exit code."""

    def __init__(self, message: str, exit_code: int = USAGE):
        # Keep it to one line: callers print str(err) as-is.
        super().__init__(" ".join(str(message).split()))
        self.exit_code = exit_code
