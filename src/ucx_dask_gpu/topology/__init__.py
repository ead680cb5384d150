"""One GPU host's topology (GPUs, NVLinks, CPU affinity, NICs) from the machine or `nvidia-smi topo -m` text, the Dask
worker plan made from it (one worker per GPU: cores, nearest NIC, UCX settings), and the cluster that applies it."""
