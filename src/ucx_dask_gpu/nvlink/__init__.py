"""verify-nvlink: prove, pair by pair, that NVLink delivers -- ucx_perftest between two GPUs each process sees alone,
NVLink counters, the transport UCX names, a cudaMemcpyPeer baseline -- and cannot be fooled."""
