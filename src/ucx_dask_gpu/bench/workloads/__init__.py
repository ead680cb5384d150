"""The benchmarked computations, one module each (base.py says what a Workload is)."""
from .base import Workload
from .svd import SVD
from .transpose import TRANSPOSE

WORKLOADS: dict[str, Workload] = {w.name: w for w in (TRANSPOSE, SVD)}
